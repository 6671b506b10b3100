"""Helpers for the tests and benchmarks (never imported by k2jax itself): measuring a child process, the prefill
memory probe, and, for their convenience, the synthetic checkpoints and random params they build on
(k2jax.checkpoint.hf_write.write_release_checkpoint, k2jax.synthetic.random_params).
"""

from __future__ import annotations

import os
import subprocess
import sys

from k2jax.checkpoint.hf_write import write_release_checkpoint
from k2jax.synthetic import random_params

__all__ = ["prefill_memory", "random_params", "run_measured", "write_release_checkpoint"]

_LAUNCHER = ("import os, subprocess, sys, time; t = time.perf_counter(); p = subprocess.Popen(sys.argv[1:]); "
             "_, st, u = os.wait4(p.pid, 0); "
             "print(u.ru_maxrss * 1024, time.perf_counter() - t, u.ru_utime + u.ru_stime); "
             "sys.exit(os.waitstatus_to_exitcode(st))")


def run_measured(cmd: list[str], env: dict | None = None) -> tuple[int, int, float, float]:
    """Run `cmd` -> (exit status, its peak RSS in bytes, wall seconds, CPU seconds).

    The peak comes from wait4 in a small launcher process, not in the caller: a child's ru_maxrss starts
    from the RSS of the process it was forked from (Linux keeps the old image's high-water mark across exec),
    which in a test or benchmark process holding a model would swamp the figure.
    """
    p = subprocess.run([sys.executable, "-c", _LAUNCHER, *cmd], env=env, stdout=subprocess.PIPE, text=True)
    rss, wall, cpu = p.stdout.split()[-3:]
    return p.returncode, int(rss), float(wall), float(cpu)


_PREFILL_SCRIPT = """
import time, jax, jax.numpy as jnp
from k2jax import K2Config, K2Model, init_params
from k2jax.runtime.cache import init_cache
cfg = K2Config.from_hf_config({config!r})
model, L = K2Model(cfg), {length}
params = init_params(cfg, jax.random.PRNGKey(0))
tokens = jax.random.randint(jax.random.PRNGKey(1), (1, L), 0, cfg.vocab_size)
cache = init_cache(cfg, 1, L, "float32", page_size=64)
f = jax.jit(lambda p, t, c: model.apply({{"params": p}}, t, None, None, c, jnp.full((1,), L - 1)))
compiled = f.lower(params, tokens, cache).compile()

def status(key):  # kB; VmHWM is this process's own peak (getrusage's maxrss also counts the parent at fork)
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key))

open("/proc/self/clear_refs", "w").write("5")  # restart the peak from here: only the run is measured
before = status("VmRSS:")
t = time.perf_counter()
logits, cache = jax.block_until_ready(compiled(params, tokens, cache))
assert logits.shape == (1, cfg.vocab_size) and int(cache.lengths[0]) == L
print(time.perf_counter() - t, before / 1024, (status("VmHWM:") - before) / 1024)
"""


def prefill_memory(length: int, config: str | os.PathLike, timeout: float = 900) -> tuple[float, float, float]:
    """Run one prefill of `length` tokens of `config` (random params, one CPU device) in a fresh process:
    -> (seconds, MiB resident before the run, MiB the peak grew during the run; compile excluded)."""
    script = _PREFILL_SCRIPT.format(config=str(config), length=int(length))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout, env=env)
    if out.returncode:
        raise RuntimeError(f"prefill of {length} tokens failed:\n{out.stderr[-3000:]}")
    seconds, before, grew = (float(x) for x in out.stdout.split()[-3:])
    return seconds, before, grew
