"""One runner step at a time, ragged against rectangular (k2jax.runtime.runner), side by side in one run: the
same rows and cache lengths through both layouts, on random weights, the best of a few runs each.

    PYTHONPATH=. python bench/ragged_steps.py [--config configs/bench.json] [--dtype bfloat16]

Cases: 8 rows decoding over 2048 cached tokens; a first prompt chunk of 512 and of 2048 tokens; a 512-token
chunk over 3584 cached tokens. A ragged step also carries its decode region (8 rows, unfed) beside a chunk,
as the server's do. Prints seconds per step and ragged / rectangular.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import k2jax  # noqa: E402
from k2jax.runtime.layout import Feed, RaggedShape, StepShape, lay_out  # noqa: E402
from k2jax.runtime.runner import Runner, host_batch, ragged_host_batch  # noqa: E402
from k2jax.testing import random_params  # noqa: E402

PAGE, SLOTS, BLOCK = 64, 8, 16


def best(fn, repeats: int) -> float:
    jax.block_until_ready(fn())
    out = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        out = min(out, time.perf_counter() - t)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=os.path.join(REPO, "configs", "bench.json"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    cfg = k2jax.K2Config.from_hf_config(args.config)
    dt = jnp.dtype(args.dtype)
    model, params = k2jax.K2Model(cfg, dt), random_params(cfg, dt, seed=0)
    W = 72  # 4608 tokens per row
    runner = Runner(model, params, slots=SLOTS, num_pages=1 + SLOTS * W, page_size=PAGE)
    table = np.arange(1, 1 + SLOTS * W, dtype=np.int32).reshape(SLOTS, W)
    rng = np.random.default_rng(0)

    def rect(rows, T, cached):
        read = 0 if cached == 0 else -(-cached // PAGE)
        shape = StepShape(rows, T, read, W)
        b = host_batch(shape, cfg.vocab_size)
        b.tokens[:] = rng.integers(0, cfg.vocab_size, b.tokens.shape)
        b.table[:] = table[:rows]
        b.lengths[:], b.count[:] = cached, T
        return best(lambda: runner.step(shape, b), args.repeats)

    def ragged(rows, T, cached):
        blocks = 0 if T == 1 else -(-T // BLOCK)
        shape = RaggedShape(SLOTS, blocks, BLOCK, SLOTS, W)
        feeds = {r: Feed(tuple(rng.integers(0, cfg.vocab_size, T).tolist()), cached, tuple(table[r].tolist()))
                 for r in range(rows)}
        b = ragged_host_batch(shape, cfg.vocab_size)
        b = b.replace(**lay_out(shape, feeds))
        return best(lambda: runner.step(shape, b), args.repeats)

    print(f"{os.path.basename(args.config)}, {dt.name}, {jax.devices()[0].device_kind}; seconds per step, best of "
          f"{args.repeats}")
    for what, rows, T, cached in (("8 rows decoding over 2048 cached", 8, 1, 2048),
                                  ("first chunk of 512", 1, 512, 0), ("first chunk of 2048", 1, 2048, 0),
                                  ("512-token chunk over 3584 cached", 1, 512, 3584)):
        r, g = rect(rows, T, cached), ragged(rows, T, cached)
        print(f"{what:36s} rectangular {r:.4f}  ragged {g:.4f}  ragged / rectangular {g / r:.2f}", flush=True)


if __name__ == "__main__":
    main()
