"""Train step of configs/bench.json: tokens/s, achieved FLOP/s against the measured matmul peak, and memory
per remat policy.

    python bench/train.py [--batch 1] [--tokens 512] [--steps 5] [--dtype bfloat16] [--master]
                          [--remat none,save_matmuls,full] [--moe-impl auto]

Random params in --dtype (with --master: float32 params, cast to --dtype inside the step, so the optimizer
updates float32 master weights); default AdamW. Model FLOPs per step = 3 × the forward's matmul FLOPs
(forward + backward, bench/common.py's forward_flops); recomputation under remat is not counted as useful
work. Memory: XLA's compiled estimate (arguments + outputs + temporaries, minus donated aliases) on every
backend, and the device's measured peak where the backend reports one (GPU/TPU). That peak is a process-wide
high-water mark: compare it across policies by running one policy per process (--remat full).
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from common import REPO, forward_flops, matmul_peak, median, time_fn  # noqa: I001

from k2jax import K2Config, K2Model, init_params
from k2jax.train import make_train_step


def compiled_bytes(compiled) -> float:
    m = compiled.memory_analysis()
    if m is None:
        return float("nan")
    return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
            - m.alias_size_in_bytes)


def device_peak() -> float:
    stats = jax.devices()[0].memory_stats() or {}
    return float(stats.get("peak_bytes_in_use", float("nan")))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=f"{REPO}/configs/bench.json")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per policy (after one warm-up step)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--master", action="store_true", help="float32 master params, compute in --dtype")
    ap.add_argument("--remat", default="none,save_matmuls,full")
    ap.add_argument("--moe-impl", default="auto", help="k2jax.nn.moe.MOE_IMPLS (auto: tiled on CPU, ragged else)")
    args = ap.parse_args()

    cfg = K2Config.from_hf_config(json.load(open(args.config)))
    dtype = jnp.dtype(args.dtype)
    n_tok = args.batch * args.tokens
    flops = 3 * args.batch * forward_flops(cfg, args.tokens)
    peak = matmul_peak(dtype)
    print(f"config {args.config}: {cfg.num_hidden_layers} layers, {cfg.n_routed_experts} experts top-"
          f"{cfg.num_experts_per_tok}; {args.batch} x {args.tokens} tokens, {args.dtype}"
          f"{' (float32 master)' if args.master else ''}, MoE {args.moe_impl}; {flops / 1e9:.1f} model GFLOP per step; "
          f"matmul peak {peak / 1e9:.1f} GFLOP/s; jax {jax.__version__}, backend {jax.default_backend()}")
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (args.batch, args.tokens)), jnp.int32)
    batch = {"tokens": tokens}
    rows = []
    for remat in args.remat.split(","):
        params = init_params(cfg, param_dtype=jnp.float32 if args.master else dtype)
        step = make_train_step(K2Model(cfg, dtype, args.moe_impl, remat))
        opt_state = step.init(params)
        compiled = step.fn.lower(params, opt_state, batch).compile()
        state = [params, opt_state]

        def run():
            state[0], state[1], metrics = compiled(state[0], state[1], batch)
            return metrics

        times = time_fn(run, repeats=args.steps, warmup=1)
        t = median(times)
        rows.append((remat, t, n_tok / t, flops / t, compiled_bytes(compiled), device_peak()))
        del state, params, opt_state, compiled
    print(f"\n{'remat':<13} {'step ms':>9} {'tokens/s':>10} {'GFLOP/s':>9} {'of peak':>8} {'compiled MiB':>13} "
          f"{'device peak MiB':>16}")
    for remat, t, tps, achieved, mem, dev in rows:
        print(f"{remat:<13} {t * 1e3:>9.1f} {tps:>10.0f} {achieved / 1e9:>9.1f} {achieved / peak:>7.0%} "
              f"{mem / 2**20:>13.1f} {dev / 2**20:>16.1f}")


if __name__ == "__main__":
    main()
