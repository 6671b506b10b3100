"""A lone prompt's time to its first token on a mesh of data-parallel shards, side by side in one run: the
ragged step spreading its chunks over every shard's segment (the server's default), the ragged step keeping
them in its own shard's segment (every other segment then computes the same size of padding: the server
before the spread), and the rectangular step (`--step-layout rectangular`: a lone row's chunk split over the
chips). Random weights, in-process Engines on XLA:CPU's host devices, the best of a few prompts each (fresh
tokens: no prefix reuse).

    PYTHONPATH=. python bench/lone_prompt.py [--mesh data=2,expert=4] [--tokens 2048] [--config configs/bench.json]

On CPU the shards' programs run on the host's cores, so the figures weigh the work each layout computes in
all, not a pod's time (for that: `k2jax plan --compile ... --programs ragged_spread,ragged_chunk,prefill`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--mesh", default="data=2,expert=4", help="the mesh (its product of axes: host devices)")
ap.add_argument("--tokens", type=int, default=2048, help="the prompt's tokens")
ap.add_argument("--config", default=None, help="a config.json (default configs/bench.json)")
ap.add_argument("--dtype", default="bfloat16")
ap.add_argument("--prefill-chunk", type=int, default=512)
ap.add_argument("--idle-chunk", type=int, default=2048, help="most prompt tokens a step takes while none decodes")
ap.add_argument("--repeats", type=int, default=2, help="timed prompts per layout (after one that compiles)")
args = ap.parse_args()
devices = 1
for part in args.mesh.split(","):
    devices *= int(part.split("=")[1])
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # host devices (a TPU plugin would claim the run)
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import k2jax  # noqa: E402
from k2jax.runtime.engine import Engine, Request, SamplingParams  # noqa: E402
from k2jax.runtime.scheduler import pow2_upto  # noqa: E402
from k2jax.testing import random_params  # noqa: E402

PAGE = 64


def first_token_s(eng: Engine, prompt: list[int]) -> float:
    """Seconds from submitting `prompt` (max_tokens 1) to its last event, stepping the engine here."""
    events = []
    t = time.perf_counter()
    eng.submit(Request(prompt, SamplingParams(max_tokens=1), events.append))
    while not (events and events[-1].finish_reason):
        eng.step()
    return time.perf_counter() - t


def unspread(eng: Engine) -> None:
    """The scheduler as it was before the spread: a lone chunk in its own shard's segment, whose chunk
    regions then go up to idle_chunk."""
    s = eng.sched
    top = -(-s.idle // s.block) * s.block
    s.spread_sizes = []
    s.region_sizes = sorted({-(-t // s.block) * s.block for t in pow2_upto(top, lo=min(top, max(64, s.block)))})


def main():
    cfg = k2jax.K2Config.from_hf_config(args.config or os.path.join(REPO, "configs", "bench.json"))
    dt = jnp.dtype(args.dtype)
    model = k2jax.K2Model(cfg, dt)
    mesh = k2jax.make_mesh(args.mesh)
    params = jax.device_put(random_params(cfg, dt, seed=0), k2jax.param_shardings(cfg, mesh, warn=False))
    max_len = -(-(args.tokens + 8) // PAGE) * PAGE
    flags = dict(max_batch=1, max_len=max_len, prefill_chunk=args.prefill_chunk, idle_chunk=args.idle_chunk,
                 page_size=PAGE, mesh=mesh, stall_bound=False)
    rng = np.random.default_rng(0)
    layouts = {"ragged, spread": dict(), "ragged, own segment": dict(), "rectangular": dict(ragged=False)}
    times = {}
    with k2jax.use_mesh(mesh):
        for name, extra in layouts.items():
            eng = Engine(model, params, **flags, **extra)
            if name == "ragged, own segment":
                unspread(eng)
            runs = [first_token_s(eng, rng.integers(0, cfg.vocab_size, args.tokens).tolist())
                    for _ in range(1 + args.repeats)]
            times[name] = min(runs[1:])
            print(f"{name:<22} {times[name]:8.3f} s  (first, compiling: {runs[0]:.1f} s; shards: "
                  f"{eng.pool.shards})", flush=True)
    base = times["ragged, spread"]
    print(f"\na lone {args.tokens}-token prompt's first token on {args.mesh} ({cfg.num_hidden_layers} layers, "
          f"{args.dtype}, idle chunk {args.idle_chunk}):")
    for name, t in times.items():
        print(f"  {name:<22} {t:8.3f} s   {t / base:5.2f}x the spread's")


if __name__ == "__main__":
    main()
