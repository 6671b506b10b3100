"""Prefill forward of configs/bench.json (1 × 512 tokens): k2jax against transformers, same weights.

    python bench/forward.py [--tokens 512] [--rounds 5] [--bias-scale 0.0]

transformers' DeepseekV3ForCausalLM runs in the oracle environment (Python 3.11, torch CPU, 2 threads); the
two are alternated round by round so both see the same machine state. Prints median times, the speed-up, and
k2jax's achieved GFLOP/s against the measured matmul peak of the same dtype. The weights are random; how
evenly they spread tokens over the experts matters to both implementations, so the load skew is printed too.
k2jax runs both param layouts: "stacked" (each projection of the MoE layers' experts one [L, E, D, F] array,
as checkpoints and training hold them) and "split" (k2jax.split_experts: one array per layer, made once at
load; the layout `k2jax generate` serves from on CPU, where the scan's slice of a stacked array is a copy).
"""

from __future__ import annotations

import argparse
import json
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from common import REPO, forward_flops, matmul_peak, median, time_fn  # noqa: I001

from k2jax import K2Config, K2Model, load_hf, split_experts
from tests.oracle.client import Oracle


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=f"{REPO}/configs/bench.json")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--bias-scale", type=float, default=0.0,
                    help="the random e_score_correction_bias is uniform in +-this (default 0: a trained model's bias "
                         "evens the load out; the parity tests' 0.5, there to expose bias bugs, sends most "
                         "tokens to a few experts)")
    args = ap.parse_args()

    hf_cfg = json.load(open(args.config))
    cfg = K2Config.from_hf_config(hf_cfg)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, args.tokens))
    flops = forward_flops(cfg, args.tokens)
    print(f"config {args.config}: {cfg.num_hidden_layers} layers, {cfg.n_routed_experts} experts top-"
          f"{cfg.num_experts_per_tok}; 1 x {args.tokens} tokens = {flops / 1e9:.1f} GFLOP; jax {jax.__version__}, "
          f"backend {jax.default_backend()}")
    rows = []
    with Oracle() as oracle, tempfile.TemporaryDirectory() as tmp:
        base = {"config": hf_cfg, "seed": 0, "bias_scale": args.bias_scale}
        oracle.run(base | {"save": {"dir": tmp, "format": "hf"}})
        for dtype in ("bfloat16", "float32"):
            _, stacked = load_hf(tmp, dtype=jnp.dtype(dtype))
            layouts = {"stacked": stacked, "split": split_experts(stacked)}
            model = K2Model(cfg, jnp.dtype(dtype))
            fwd = jax.jit(lambda p, t: model.apply({"params": p}, t))
            toks = jnp.asarray(tokens, jnp.int32)
            for params in layouts.values():
                jax.block_until_ready(fwd(params, toks))
            if dtype == "bfloat16":
                print(f"tokens per expert, max / mean over the {cfg.n_routed_experts} experts, by MoE layer: "
                      + " ".join(f"{r:.2f}" for r in load_skew(model, stacked, toks)))
            oracle.run(base | {"bench": {"input_ids": tokens, "dtype": dtype, "warmup": 1, "repeats": 1}})
            ours, theirs = {name: [] for name in layouts}, []
            for _ in range(args.rounds):
                theirs += list(oracle.run(base | {"bench": {"input_ids": tokens, "dtype": dtype, "warmup": 0,
                                                            "repeats": 1}})["bench.times"])
                for name, params in layouts.items():
                    ours[name] += time_fn(fwd, params, toks, repeats=1, warmup=0)
            peak = matmul_peak(jnp.dtype(dtype))
            for name in layouts:
                rows.append((dtype, name, median(ours[name]), median(theirs), flops / median(ours[name]), peak))
            del stacked, layouts, params
    print(f"\n{'dtype':<9} {'layout':<8} {'k2jax ms':>9} {'HF ms':>9} {'speed-up':>9} {'k2jax GFLOP/s':>14} "
          f"{'matmul peak':>12} {'of peak':>8}")
    for dtype, name, ours, theirs, achieved, peak in rows:
        print(f"{dtype:<9} {name:<8} {ours * 1e3:>9.1f} {theirs * 1e3:>9.1f} {theirs / ours:>8.2f}x "
              f"{achieved / 1e9:>14.1f} {peak / 1e9:>12.1f} {achieved / peak:>7.0%}")


def load_skew(model, params, tokens) -> np.ndarray:
    """max / mean tokens per expert in each MoE layer (1 = perfectly even)."""
    _, state = model.apply({"params": params}, tokens, mutable=["intermediates"])
    load_LE = np.asarray(state["intermediates"]["moe_layers"]["mlp"]["gate"]["load"][0])
    return load_LE.max(-1) / load_LE.mean(-1)


if __name__ == "__main__":
    main()
