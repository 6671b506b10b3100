"""Hugging Face repo ids, against a local Hub endpoint (tests/storage_servers.HubStub, HF_ENDPOINT) serving a
synthetic release: `k2jax convert REPO DST` equals the conversion of the same files on disk; `--layers` fetches only
the files holding those layers (the others' headers by ranged reads); --revision, a private repo with HF_TOKEN;
a repo or revision that does not exist and a file whose sha256 differs from the Hub's listing are clear errors
naming them, with nothing left that `load` would take. Every command runs as a user runs it: a subprocess."""

import json
import os
import subprocess
import sys

import pytest

from k2jax.checkpoint.convert import main as convert_main
from k2jax.testing import write_release_checkpoint
from tests.conftest import CONFIGS, REPO
from tests.storage_servers import HubStub, hub_env

TINY = json.loads((CONFIGS / "tiny.json").read_text())
REPO_ID = "k2jax-test/tiny-fp8"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    d = tmp_path_factory.mktemp("hub")
    src = write_release_checkpoint(TINY, d / "src", num_shards=3, seed=9)
    assert convert_main([str(src), str(d / "local"), "--quiet"]) == 0
    wm = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    stub = HubStub({REPO_ID: {"main": src, "v2": src}, "k2jax-test/private": {"main": src},
                    "k2jax-test/corrupt": {"main": src}}, private={"k2jax-test/private"},
                   lie={("k2jax-test/corrupt", "model-2-of-3.safetensors"): "0" * 64})
    yield stub, src, d / "local", wm, d
    stub.close()


def _files(d):
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _convert(hub, home, *argv, token=None):
    stub = hub[0]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")} | hub_env(stub.url, home) | \
        {"JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)} | ({"HF_TOKEN": token} if token else {})
    return subprocess.run([sys.executable, "-m", "k2jax.cli", "convert", *map(str, argv)], env=env,
                          capture_output=True, text=True, timeout=300)


def test_convert_from_a_repo_id_equals_the_local_conversion(hub):
    stub, src, local, _, d = hub
    p = _convert(hub, d / "home1", REPO_ID, d / "out1")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "fetching 3 file(s)" in p.stderr and "complete." in p.stderr
    assert _files(d / "out1") == _files(local)
    fetched = [f for f, rng in stub.gets(REPO_ID) if f.endswith(".safetensors") and rng is None]
    assert sorted(fetched) == sorted(p.name for p in src.glob("*.safetensors"))  # each once
    # again, same cache: nothing fetched again, nothing converted
    before = len(stub.gets(REPO_ID))
    p = _convert(hub, d / "home1", REPO_ID, d / "out1")
    assert p.returncode == 0 and "nothing to do" in p.stderr, p.stderr[-2000:]
    assert not [f for f, rng in stub.gets(REPO_ID)[before:] if f.endswith(".safetensors") and rng is None]


def test_layers_fetch_only_the_files_that_hold_them(hub):
    stub, src, _, wm, d = hub
    before = len(stub.gets(REPO_ID))
    p = _convert(hub, d / "home2", REPO_ID, d / "out2", "--layers", "2:3", "--revision", "v2")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "not complete until every layer range is converted" in p.stderr
    need = {f for n, f in wm.items() if n.startswith("model.layers.2.")}
    gets = stub.gets(REPO_ID)[before:]
    assert {f for f, rng in gets if f.endswith(".safetensors") and rng is None} == need
    assert need != {f for f in wm.values()}
    # the other files: only their headers, by ranged reads
    other = [(f, rng) for f, rng in gets if f.endswith(".safetensors") and f not in need]
    assert other and all(rng and rng.startswith("bytes=") for _, rng in other)


def test_private_repo_needs_a_token(hub):
    _, _, local, _, d = hub
    p = _convert(hub, d / "home3", "k2jax-test/private", d / "out3")
    assert p.returncode == 2 and "k2jax-test/private: no such Hugging Face repo" in p.stderr and \
        "huggingface-cli login" in p.stderr, p.stderr[-2000:]
    assert not (d / "out3").exists()
    p = _convert(hub, d / "home3", "k2jax-test/private", d / "out3", token="hf_test_token")
    assert p.returncode == 0, p.stderr[-3000:]
    assert _files(d / "out3") == _files(local)


@pytest.mark.parametrize("argv, needle", [
    (["k2jax-test/no-such-repo"], "k2jax-test/no-such-repo: no such Hugging Face repo"),
    ([REPO_ID, "--revision", "no-such-branch"], f"{REPO_ID}: no revision 'no-such-branch'"),
    (["k2jax-test/corrupt"], "differ from the Hub's"),
])
def test_bad_repo_inputs(hub, argv, needle, tmp_path):
    p = _convert(hub, tmp_path / "home", argv[0], tmp_path / "out", *argv[1:])
    assert p.returncode == 2 and needle in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "out" / "k2jax_manifest.json").exists()
