"""`k2jax demo` end to end (small settings, in a subprocess that sets up its own simulated devices), and the
README's set-up command in a fresh virtual environment (slow: CI runs it, `-m "not slow"` skips it)."""

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from tests.conftest import CONFIGS, REPO

SMALL = json.loads((CONFIGS / "tiny.json").read_text()) | {"vocab_size": 1024}  # 8 experts: one per device


def _env():
    """The environment without the test suite's device settings: the demo must set up its own."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "JAX_NUM_CPU_DEVICES")}
    return env | {"PYTHONPATH": str(REPO)}


def test_demo_runs_the_whole_path_with_the_expected_sections(tmp_path):
    cfg = tmp_path / "small.json"
    cfg.write_text(json.dumps(SMALL))
    work = tmp_path / "work"
    p = subprocess.run([sys.executable, "-m", "k2jax.cli", "demo", "--config", str(cfg), "--batch", "3",
                        "--max-new-tokens", "4", "--workdir", str(work)],
                       env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=300)
    out = p.stdout
    assert p.returncode == 0, out + p.stderr[-3000:]
    assert "RANDOM weights" in out
    assert "8 simulated CPU devices, mesh expert=8" in out
    for k, what in enumerate(["writing a synthetic checkpoint", "converting", "restoring on the mesh expert=8",
                              "sharding plan", "generating: a batch of 3 prompts, 4 new tokens"], 1):
        assert f"[{k}/5] {what}" in out, (what, out)
    # one expert per device, each a different one, and the same bytes on every device (as `k2jax plan` says)
    rows = re.findall(r"^\s+(\d) cpu\s+experts? (\S+)\s+([\d.]+) MiB$", out, re.M)
    assert [(int(d), e) for d, e, _ in rows] == [(d, str(d)) for d in range(8)], out
    per_device = {b for _, _, b in rows}
    assert len(per_device) == 1 and f"estimate from the abstract tree: {per_device.pop()} MiB per device" in out
    # one line per prompt; repr quotes a text holding ' with "
    assert len(re.findall(r"""^\s+(['"]).*\1 -> (['"]).*\2$""", out, re.M)) == 3, out
    assert re.search(r"prefill: \d+ prompt tokens in \d+ ms = [\d,]+ tokens/s", out)
    assert re.search(r"decode:  3 steps x 3 sequences in [\d.]+ s = [\d,]+ tokens/s", out)
    # --workdir keeps the source checkpoint, the complete conversion and the tokenizer
    assert (work / "hf-fp8" / "model.safetensors.index.json").is_file()
    assert (work / "k2jax-bf16" / "k2jax_manifest.json").is_file()
    assert (work / "tokenizer" / "tiktoken.model").is_file()


def test_demo_refuses_a_mesh_that_does_not_fit_before_any_work(tmp_path):
    p = subprocess.run([sys.executable, "-m", "k2jax.cli", "demo", "--devices", "4", "--mesh", "expert=8",
                        "--workdir", str(tmp_path / "w")], env=_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "k2jax demo: error: mesh spec 'expert=8': axis sizes multiply to 8, but there are 4 devices" in p.stderr
    assert not (tmp_path / "w" / "hf-fp8").exists()


# ------------------------------------------------------------------------------------------------------
def _readme_setup_command() -> str:
    """The first command of the README's set-up section (the install + demo line a new user copies)."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Set-up", 1)[1]
    return re.search(r"```bash\n(.+?)\n```", section, re.S).group(1).strip()


def _copy_working_tree(dst: pathlib.Path) -> None:
    """What a fresh clone (plus this checkout's uncommitted files) holds: the files git does not ignore."""
    try:
        names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                               capture_output=True, check=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: everything but environments
        shutil.copytree(REPO, dst, ignore=shutil.ignore_patterns(".git", ".venv", ".oracle-venv", "__pycache__",
                                                                "*.egg-info", ".pytest_cache", "build", "dist"))
        return
    for name in filter(None, names):
        if (REPO / name).is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dst / name)


@pytest.mark.slow
def test_readme_setup_command_runs_the_demo_in_a_fresh_venv(tmp_path):
    """A copy of the working tree without any environment, and the README's command alone: it builds .venv
    (pip's cache keeps this to a minute or two once the wheels have been fetched) and runs `k2jax demo`."""
    command = _readme_setup_command()
    assert command == "bash tools/setup.sh && .venv/bin/k2jax demo", command
    tree = tmp_path / "k2jax"
    _copy_working_tree(tree)
    env = {k: v for k, v in _env().items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    p = subprocess.run(["bash", "-c", command], cwd=tree, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "[5/5] generating" in p.stdout and "decode:" in p.stdout and "RANDOM weights" in p.stdout, p.stdout
