"""gs:// everywhere a path is taken, against a real GCS emulator (gcp-storage-emulator, started here, in memory;
tests/storage_servers.py): convert gs:// -> gs:// (ranged reads of the source, never a whole file) equal to a
local conversion object for object, load / plan / info / generate / serve from gs://, a convert killed mid-way
and resumed, two processes restoring from gs:// each reading only the chunks of its own devices (counted at a
proxy in front of the emulator, one per process), and bad inputs: a missing bucket or object, no credentials, a
truncated object, each a clear error naming the URL and nothing left that `load` would take."""

import json
import os
import pathlib
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

import k2jax
from k2jax.checkpoint.convert import convert, main
from k2jax.checkpoint.orbax_layout import IncompleteCheckpointError
from k2jax.testing import write_release_checkpoint
from tests.conftest import CONFIGS, REPO
from tests.processes import result, run_all
from tests.storage_servers import BUCKET, Proxy, download, emulator, free_port, gcs_env, upload

TINY = json.loads((CONFIGS / "tiny.json").read_text())  # 3 layers (1 dense, 2 MoE), 8 experts
CFG = TINY | {"vocab_size": 1024}  # the demo tokenizer's ids
ROOT = f"gs://{BUCKET}"


@pytest.fixture(scope="module")
def gcs():
    """The emulator's proxy; this process's clients point at it (for good: tensorstore reads it once)."""
    url, proxy = emulator()
    os.environ.update(gcs_env(proxy.url))
    return proxy


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """(HF source, its local conversion) on disk."""
    d = tmp_path_factory.mktemp("gcs")
    src = write_release_checkpoint(CFG, d / "src", num_shards=3, seed=5)
    assert main([str(src), str(d / "dst"), "--quiet"]) == 0
    return src, d / "dst"


@pytest.fixture(scope="module")
def remote(gcs, local):
    """(gs:// source, gs:// conversion of it), with the proxy's record of the conversion's reads."""
    src = upload(local[0], f"{ROOT}/src")
    gcs.clear()
    assert main([src, f"{ROOT}/dst", "--quiet"]) == 0
    return src, f"{ROOT}/dst", gcs.reads(BUCKET)


def _files(d: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _bits(tree):
    return [np.asarray(x).view(np.uint8) for x in jax.tree.leaves(tree)]


def test_convert_gs_to_gs_is_the_local_conversion_read_in_ranges(local, remote):
    src_dir, dst_dir = local
    _, dst, reads = remote
    objects = download(dst)
    assert "commit_success.txt" in objects and objects.pop("commit_success.txt")  # what Orbax looks for on GCS
    assert objects == _files(dst_dir)  # the same objects, byte for byte, manifest included
    # every read of a safetensors object is a range of it (a header, a tensor or rows of one), none the whole file
    sizes = {f"src/{p.name}": p.stat().st_size for p in src_dir.glob("*.safetensors")}
    shard_reads = [(o, rng, n) for o, rng, n in reads if o in sizes]
    assert {o for o, _, _ in shard_reads} == set(sizes)
    assert all(rng and rng.startswith("bytes=") and n < sizes[o] for o, rng, n in shard_reads), shard_reads[:5]
    assert sum(n for _, _, n in shard_reads) <= sum(sizes.values()) + 4096  # (headers are read twice: verify, open)


def test_load_plan_and_info_read_gs(local, remote):
    _, dst, _ = remote
    cfg, params = k2jax.load(dst)
    ref_cfg, ref = k2jax.load(local[1])
    assert cfg == ref_cfg
    assert all(np.array_equal(a, b) for a, b in zip(_bits(params), _bits(ref)))
    from k2jax.cli import main as cli

    assert cli(["plan", dst, "--mesh", "expert=2"]) == 0
    assert cli(["info", f"{dst}/config.json"]) == 0


_KILLED = r"""
import os, signal, sys
from k2jax.checkpoint.convert import destination, main, pool
marked = []
def mark_then_die(dst, unit):
    destination.mark_done(dst, unit)
    marked.append(unit)
    if len(marked) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
pool.mark_done = mark_then_die
sys.exit(main(sys.argv[1:]))
"""


def test_a_killed_conversion_resumes_on_gs(gcs, remote):
    src, dst, _ = remote
    d = f"{ROOT}/killed"
    p = subprocess.run([sys.executable, "-c", _KILLED, src, d, "--quiet", "--workers", "1"],
                       env=os.environ | {"PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=180)
    assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]
    assert len([k for k in download(d) if k.startswith(".k2jax_convert/done/")]) == 2
    with pytest.raises(IncompleteCheckpointError, match="incomplete conversion"):
        k2jax.load(d)
    resumed = convert(src, d, quiet=True)
    assert resumed.complete and resumed.units_skipped == 2 and 0 < resumed.units_converted
    assert download(d) == download(dst)  # bit-identical to the uninterrupted one, no progress markers left
    assert convert(src, d, quiet=True).tensors == 0  # the same command again: nothing to do


_RESTORE = r"""
import json, sys
import jax
rank, port, ckpt = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=rank)
import k2jax
from k2jax.checkpoint.orbax_layout import leaves_by_name
cfg, params = k2jax.load(ckpt, mesh=k2jax.make_mesh("expert=8"))
print("RESULT", json.dumps({name: sorted({tuple((sl.indices(n)[0], sl.indices(n)[1]) for sl, n in zip(s.index, a.shape))
                                          for s in a.addressable_shards})
                            for name, a in leaves_by_name(params).items()}), flush=True)
"""


def test_two_processes_restoring_from_gs_each_read_only_their_chunks(gcs, remote):
    """Each process talks to GCS through its own proxy, which records the objects it reads: exactly the chunks
    its 4 devices' shards touch (of the expert stacks, its 4 experts' slots), never the other process's."""
    from k2jax.checkpoint.orbax_layout import stored_array

    _, dst, _ = remote
    upstream, _ = emulator()
    proxies = [Proxy(upstream) for _ in range(2)]
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env |= {"XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    outs = run_all([[sys.executable, "-c", _RESTORE, str(r), str(port), dst] for r in range(2)],
                   [env | gcs_env(proxies[r].url) for r in range(2)], timeout=240)
    prefix = dst[len(ROOT) + 1:] + "/"
    for rank, (out, proxy) in enumerate(zip(outs, proxies)):
        regions = result(out)
        want = set()
        for name, regs in regions.items():
            spec = stored_array(dst, name)
            for region in regs:
                ranges = [range(a // c, -(-b // c)) for (a, b), c in zip(region, spec["chunks"])]
                want |= {f"{name}/" + ".".join(map(str, idx)) for idx in np.ndindex(*[len(r) for r in ranges])
                         for idx in [tuple(r[i] for r, i in zip(ranges, idx))]}
        read = {o[len(prefix):] for o, _, _ in proxy.reads(BUCKET) if o.startswith(prefix)}
        chunks = {o for o in read if not o.rsplit("/", 1)[-1].startswith((".", "_")) and "/" in o}
        assert chunks == want, (rank, sorted(chunks ^ want)[:10])
        experts = {int(o.rsplit("/", 1)[1].split(".")[1]) for o in chunks if ".experts." in o}
        assert experts == set(range(4 * rank, 4 * rank + 4))
        proxy.close()


def test_generate_from_gs_with_a_gs_tokenizer(remote):
    from k2jax.synthetic import DEMO_TOKENIZER_DIR

    _, dst, _ = remote
    tok = upload(DEMO_TOKENIZER_DIR, f"{ROOT}/tokenizer")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    p = subprocess.run([sys.executable, "-m", "k2jax.cli", "generate", "--checkpoint", dst, "--tokenizer", tok,
                        "--chat", "--prompt", "Hello", "--max-new-tokens", "4", "--no-stop"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "prompt " in p.stderr and "4 new" in p.stderr, p.stderr[-2000:]


def test_serve_from_gs(remote):
    import openai

    from tests.serve_util import running

    _, dst, _ = remote
    port = free_port()
    argv = [sys.executable, "-m", "k2jax.cli", "serve", "--checkpoint", dst, "--port", str(port),
            "--max-batch", "2", "--max-len", "64", "--prefill-chunk", "32"]
    with running([argv], port):
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=300)
        assert c.models.list().data[0].id == "dst"  # the URL's last part
        r = c.completions.create(model="dst", prompt=[1, 2, 3], max_tokens=3, temperature=0)
        assert r.usage.completion_tokens == 3


# ------------------------------------------------------------------------------------------------------
def _fails(argv, capsys, *needles):
    assert main(argv) == 2
    err = capsys.readouterr().err
    for n in needles:
        assert n in err, err
    assert "Traceback" not in err
    return err


def _nothing_to_load(url):
    with pytest.raises((OSError, IncompleteCheckpointError)):
        k2jax.load(url)


def test_missing_bucket_or_object(gcs, local, remote, capsys):
    _fails([f"gs://no-such-bucket-k2jax/src", f"{ROOT}/out1", "--quiet"], capsys,
           "no such bucket gs://no-such-bucket-k2jax")
    _fails([f"{ROOT}/nothing-here", f"{ROOT}/out1", "--quiet"], capsys, f"{ROOT}/nothing-here: no such object or prefix")
    _nothing_to_load(f"{ROOT}/out1")
    _fails([str(local[0]), "gs://no-such-bucket-k2jax/dst", "--quiet"], capsys, "no such bucket gs://no-such-bucket-k2jax")
    with pytest.raises(FileNotFoundError, match="no such bucket gs://no-such-bucket-k2jax"):
        k2jax.load("gs://no-such-bucket-k2jax/dst")
    with pytest.raises(FileNotFoundError, match=f"{ROOT}/nothing-here: no such checkpoint directory"):
        k2jax.load(f"{ROOT}/nothing-here")


def test_no_credentials(gcs, local, tmp_path, monkeypatch, capsys):
    """A bucket that refuses anonymous requests (as GCS does a private one) when no credentials are found; a
    credentials setting that names no file is refused before any request."""
    from k2jax.checkpoint.storage import gcs_fs

    gcs_fs().mkdir("k2jax-private")
    upload(local[0], "gs://k2jax-private/src")
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path))  # no gcloud login here
    gcs.private.add("k2jax-private")
    try:
        _fails(["gs://k2jax-private/src", f"{ROOT}/out2", "--quiet"], capsys, "gs://k2jax-private/src",
               "access refused", "no Google Cloud credentials were found", "gcloud auth application-default login")
        _nothing_to_load(f"{ROOT}/out2")
    finally:
        gcs.private.discard("k2jax-private")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing-key.json"))
    _fails([f"{ROOT}/src", f"{ROOT}/out2", "--quiet"], capsys, f"GOOGLE_APPLICATION_CREDENTIALS={tmp_path}")
    _nothing_to_load(f"{ROOT}/out2")


def test_truncated_object(gcs, local, tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    for p in local[0].iterdir():
        (src / p.name).write_bytes(p.read_bytes())
    shard = sorted(src.glob("*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-1000])
    url = upload(src, f"{ROOT}/truncated")
    _fails([url, f"{ROOT}/out3", "--quiet"], capsys, f"{url}/{shard.name}", "truncated")
    _nothing_to_load(f"{ROOT}/out3")
