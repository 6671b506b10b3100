"""Compile time of the bench config's forward with 4 and with 32 MoE layers (nn.scan: should be about equal).

    python bench/compile.py [--tokens 512]

Lowered and compiled ahead of time from abstract params: nothing is allocated. Also with the per-layer expert
views that the runtime's steps take on one CPU device (k2jax.nn.model.expert_views), whose switch has one
branch per MoE layer: their compile time does grow with depth.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from common import REPO

from k2jax import K2Config, K2Model, abstract_params
from k2jax.nn.model import EXPERT_VIEWS


def compile_seconds(cfg, tokens: int, dtype, views: bool = False) -> float:
    params = abstract_params(cfg, dtype)
    if views:  # the shapes expert_views makes of concrete params
        stacks = params["moe_layers"]["mlp"]["experts"]
        params = params | {EXPERT_VIEWS: {k: (jax.ShapeDtypeStruct(v.shape[1:], v.dtype),) * v.shape[0]
                                          for k, v in stacks.items()}}
    toks = jax.ShapeDtypeStruct((1, tokens), jnp.int32)
    fwd = jax.jit(lambda p, t: K2Model(cfg, dtype).apply({"params": p}, t))
    t = time.perf_counter()
    fwd.lower(params, toks).compile()
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=512)
    args = ap.parse_args()
    bench = K2Config.from_hf_config(f"{REPO}/configs/bench.json")
    print(f"{'MoE layers':>10} {'bf16 compile s':>15} {'f32 compile s':>14} {'bf16 views s':>20}")
    compile_seconds(bench.replace(num_hidden_layers=2), 16, jnp.float32)  # warm up jax itself
    res = {}
    for n in (4, 32):
        cfg = bench.replace(num_hidden_layers=n + bench.num_dense_layers)
        # Best of two: compile time is noisy on a shared machine.
        res[n] = [min(compile_seconds(cfg, args.tokens, dt, views) for _ in range(2))
                  for dt, views in ((jnp.bfloat16, False), (jnp.float32, False), (jnp.bfloat16, True))]
        print(f"{n:>10} {res[n][0]:>15.2f} {res[n][1]:>14.2f} {res[n][2]:>20.2f}")
    print(f"ratio 32/4: bf16 {res[32][0] / res[4][0]:.2f}x, f32 {res[32][1] / res[4][1]:.2f}x (goal < 2x); "
          f"views, bf16 {res[32][2] / res[4][2]:.2f}x")


if __name__ == "__main__":
    main()
