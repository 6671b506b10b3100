import subprocess
import sys

from k2jax.cli import main
from tests.conftest import CONFIGS

KIMI_EXPECTED = {
    "MLA (MoE block)": 101_124_096,
    "MLA (dense block)": 101_124_096,
    "dense MLP": 396_361_728,
    "dense block": 497_500_160,
    "MoE": 16_958_226_816,
    "MoE block": 17_059_365_248,
    "60 MoE blocks": 1_023_561_914_880,
    "whole model": 1_026_408_232_448,
}


def parse_rows(text):
    rows = {}
    for line in text.splitlines():
        name, _, num = line.rstrip().rpartition("  ")
        if num.replace(",", "").isdigit():
            rows[name.strip()] = int(num.replace(",", ""))
    return rows


def test_kimi_k2_counts_exact(capsys):
    assert main(["info", str(CONFIGS / "kimi_k2.json")]) == 0
    rows = parse_rows(capsys.readouterr().out)
    for name, n in KIMI_EXPECTED.items():
        assert rows[name] == n, name


def test_deepseek_v3_is_671b(capsys):
    assert main(["info", str(CONFIGS / "deepseek_v3.json")]) == 0
    assert parse_rows(capsys.readouterr().out)["whole model"] == 671_026_419_200


def test_console_script_entry_point():
    out = subprocess.run([sys.executable, "-m", "k2jax.cli", "info", str(CONFIGS / "kimi_k2.json")],
                         capture_output=True, text=True, check=True).stdout
    assert "1,026,408,232,448" in out and "active parameters per token: 32,861,500,928" in out


def test_bad_config_is_one_line_error(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"vocab_size": 10}')
    assert main(["info", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "missing required key 'hidden_size'" in err and "Traceback" not in err
