"""Multi-host runs, as two CPU processes of 4 simulated devices each on 127.0.0.1 (jax.distributed, gloo
collectives): conversion split over the processes gives a checkpoint bit-identical to one process's; a
converted checkpoint loaded on the 8-device global mesh generates the same tokens as one process with 8
devices; `k2jax generate` prints from process 0 only. Every run is bounded in time, and its processes are
killed if anything fails."""

import json
import os
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import k2jax
from k2jax.checkpoint.convert import main as convert_main
from k2jax.testing import write_release_checkpoint
from tests.conftest import CONFIGS, REPO
from tests.processes import free_port, result, run_all

TINY = json.loads((CONFIGS / "tiny.json").read_text())  # 3 layers (1 dense, 2 MoE), 8 experts
PROMPTS = [[5, 6, 7], list(range(20, 31)), [42], [1, 2, 3, 4, 5]]
NEW = 5
MESHES = ["expert=8", "data=2,expert=4"]  # the batch split across the processes on the second
TIMEOUT_S = 240



def run_two(argv_of_rank, timeout=TIMEOUT_S) -> list[str]:
    """Start two processes (argv_of_rank(rank, port)), 4 CPU devices each; -> their outputs. Fails (after
    killing both) if either exits non-zero or they overrun `timeout` seconds together."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env |= {"XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    return run_all([argv_of_rank(rank, port) for rank in range(2)], [env, env], timeout, cwd=REPO)


def _launch(rank, port):
    return ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(rank)]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return write_release_checkpoint(TINY, tmp_path_factory.mktemp("src") / "hf", seed=7)


@pytest.fixture(scope="module")
def converted(source):
    dst = source.parent / "one-process"
    assert convert_main([str(source), str(dst), "--quiet"]) == 0
    return dst


def _files(d: pathlib.Path) -> dict[str, bytes]:
    return {str(f.relative_to(d)): f.read_bytes() for f in sorted(d.rglob("*")) if f.is_file()}


def test_two_process_conversion_is_bit_identical_to_one_process(source, converted):
    dst = source.parent / "two-processes"
    outs = run_two(lambda rank, port: [sys.executable, "-m", "k2jax.cli", "convert", str(source), str(dst),
                                       *_launch(rank, port)])
    # process 0 took layers 0:2 and the global tensors, process 1 layer 2; only process 0 reports
    assert "process 0 of 2: layers 0:2 and the global tensors" in outs[0] and "complete." in outs[0], outs[0]
    assert "complete." not in outs[1] and "convert:" not in outs[1], outs[1]
    one, two = _files(converted), _files(dst)
    assert one.keys() == two.keys()
    assert not [n for n in one if one[n] != two[n]]
    assert not (dst / ".k2jax_convert").exists()


_WORKER = r"""
import json, sys
import jax.numpy as jnp
from k2jax import distributed
rank, port, ckpt, prompts, new = int(sys.argv[1]), sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), int(sys.argv[5])
distributed.initialize(f"127.0.0.1:{port}", 2, rank)
import jax
import k2jax
out = {"devices": len(jax.devices()), "local": len(jax.local_devices())}
for spec in sys.argv[6:]:
    mesh = k2jax.make_mesh(spec)
    cfg, params = k2jax.load(ckpt, dtype=jnp.float32, mesh=mesh)
    experts = params["moe_layers"]["mlp"]["experts"]["gate_proj"]
    tokens, lengths = k2jax.generate(k2jax.K2Model(cfg), params, prompts, new, mesh=mesh)
    out[spec] = {"tokens": tokens.tolist(), "lengths": lengths.tolist(),
                 "experts": sorted({(s.index[1].start, s.index[1].stop) for s in experts.addressable_shards})}
print("RESULT", json.dumps(out), flush=True)
"""


def test_two_processes_generate_the_tokens_of_one_process(converted):
    reference = {}
    for spec in MESHES:  # this process: 8 simulated devices
        mesh = k2jax.make_mesh(spec)
        cfg, params = k2jax.load(converted, dtype=jnp.float32, mesh=mesh)
        tokens, lengths = k2jax.generate(k2jax.K2Model(cfg), params, PROMPTS, NEW, mesh=mesh)
        reference[spec] = (tokens.tolist(), lengths.tolist())
    assert reference[MESHES[0]] == reference[MESHES[1]]

    outs = run_two(lambda rank, port: [sys.executable, "-c", _WORKER, str(rank), str(port), str(converted),
                                       json.dumps(PROMPTS), str(NEW), *MESHES])
    results = [result(o) for o in outs]
    for rank, r in enumerate(results):
        assert (r["devices"], r["local"]) == (8, 4)
        for spec in MESHES:
            assert (r[spec]["tokens"], r[spec]["lengths"]) == reference[spec], (rank, spec)
        # each process's devices hold their own half of the experts on expert=8
        assert r["expert=8"]["experts"] == [[k, k + 1] for k in range(4 * rank, 4 * rank + 4)]


def test_generate_command_prints_from_process_zero_only(converted):
    ids = ",".join(map(str, PROMPTS[1]))
    outs = run_two(lambda rank, port: [sys.executable, "-m", "k2jax.cli", "generate", "--checkpoint",
                                       str(converted), "--mesh", "data=2,expert=4", "--dtype", "float32",
                                       "--prompt-ids", ids, "--max-new-tokens", str(NEW), "--no-stop",
                                       *_launch(rank, port)])
    cfg, params = k2jax.load(converted, dtype=jnp.float32)
    want, _ = k2jax.generate(k2jax.K2Model(cfg), params, [PROMPTS[1]], NEW)
    assert ",".join(map(str, want[0])) in outs[0].splitlines(), outs[0]
    assert "tokens/s" in outs[0]
    assert "tokens/s" not in outs[1] and ",".join(map(str, want[0])) not in outs[1], outs[1]


def test_incomplete_launch_flags_are_refused():
    from k2jax.distributed import initialize

    with pytest.raises(ValueError, match="go together"):
        initialize("127.0.0.1:1234", 2, None)
    with pytest.raises(ValueError, match="expected HOST:PORT"):
        initialize("127.0.0.1", 2, 0)
    with pytest.raises(ValueError, match="need 0 <= I < N"):
        initialize("127.0.0.1:1234", 2, 2)
    assert initialize() is False  # nothing asked: a single process
    assert np.array_equal([len(k2jax.distributed.share(10, i, 3)) for i in range(3)], [4, 3, 3])
