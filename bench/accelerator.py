"""One full-width Kimi K2 MoE block on an accelerator, in bf16, fp8 and int4: prefill MFU, decode step time
and weight bytes read per second, ragged vs dense MoE. One prepared script; nothing to install.

    PYTHONPATH=. python bench/accelerator.py            # configs/kimi_k2.json dims, one MoE layer (17 B params)
    PYTHONPATH=. python bench/accelerator.py --small    # a scaled-down block (runs on CPU in a minute or two)

The model is K2Model with one MoE decoder block of Kimi K2's widths (MLA, 384 routed experts + 1 shared,
top-8) and a 1024-token vocabulary (so the embedding and lm_head do not count). Weights are random, made on
the device in their held form (no host copy, no quantization pass): bf16; fp8 (e4m3 values, float32 128x128
block scales: every linear of the block); int4 (packed 4-bit routed experts, bf16 scales per group of 32).

Prints, per format:
- prefill 1 x T (T = 4096): seconds and MFU = model FLOPs (bench/common.forward_flops) / time / the chip's
  bf16 dense peak (table below; on CPU a measured matmul peak);
- decode step (one token per row, context C) at batch 1 and 64 for the ragged_dot MoE and the gathered
  (tiled) one: seconds, the weight bytes the step must read (attention + shared expert + router + the
  distinct routed experts the batch chooses, expected value under uniform routing) and those bytes / time
  against the chip's HBM bandwidth;
- the MoE alone (router output given) at 512 tokens: ragged_dot vs the dense reference (every expert on
  every token), bf16.
Stops starting new measurements past --budget seconds (default 450) and says what it skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import REPO, forward_flops, matmul_peak, median, time_fn  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from k2jax import K2Config, K2Model, abstract_params  # noqa: E402
from k2jax.runtime.cache import init_cache  # noqa: E402
from k2jax.ops.moe import moe_dense, moe_grouped  # noqa: E402
from k2jax.ops.quant import QuantizedWeight, is_quantized  # noqa: E402

# bf16 dense peak FLOP/s and HBM bytes/s by device kind (vendor figures).
CHIPS = {"H200": (989e12, 4.8e12), "H100": (989e12, 3.35e12), "A100": (312e12, 2.0e12),
         "TPU v5p": (459e12, 2.76e12), "TPU v6": (918e12, 1.64e12), "TPU v5 lite": (197e12, 0.82e12)}
FORMATS = ("bf16", "fp8", "int4")


def block_config(small: bool) -> K2Config:
    cfg = K2Config.from_hf_config(os.path.join(REPO, "configs", "kimi_k2.json"))
    cfg = dataclasses.replace(cfg, num_hidden_layers=1, first_k_dense_replace=0, vocab_size=1024)
    if small:
        cfg = dataclasses.replace(cfg, hidden_size=512, moe_intermediate_size=256, n_routed_experts=32,
                                  num_experts_per_tok=4, num_attention_heads=4, q_lora_rank=192,
                                  kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
                                  intermediate_size=512)
    return cfg


def chip():
    d = jax.devices()[0]
    for name, figs in CHIPS.items():
        if name.lower() in d.device_kind.lower():
            return d.device_kind, figs
    return d.device_kind, (matmul_peak(jnp.bfloat16, 1024, 3), None)


def random_held(cfg, fmt, seed=0):
    """Random params in their held form, each leaf made on the device by its own small jit."""
    shapes = abstract_params(cfg, jnp.bfloat16, quant=None if fmt == "bf16" else fmt)
    leaves, tree = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=is_quantized)
    out = []
    for i, (path, s) in enumerate(leaves):
        key = jax.random.PRNGKey(seed + i)
        name = str(getattr(path[-1], "key", ""))
        if is_quantized(s):
            v, sc = s.values, s.scales
            if fmt == "fp8":
                values = jax.jit(lambda k: jax.random.normal(k, v.shape, jnp.bfloat16).astype(v.dtype))(key)
                scales = jnp.full(sc.shape, 0.02, sc.dtype)
            else:
                values = jax.jit(lambda k: jax.random.bits(k, v.shape, jnp.uint8))(key)
                scales = jnp.full(sc.shape, 0.005, sc.dtype)
            out.append(QuantizedWeight(values, scales, s.fmt, s.in_ndim))
        elif name == "weight":  # norms
            out.append(jnp.ones(s.shape, s.dtype))
        elif name == "e_score_correction_bias":
            out.append(jnp.zeros(s.shape, s.dtype))
        else:
            out.append(jax.jit(lambda k: (jax.random.normal(k, s.shape, jnp.float32) * 0.02).astype(s.dtype))(key))
    return jax.block_until_ready(jax.tree.unflatten(tree, out))


def nbytes(tree) -> int:
    return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


def decode_read_bytes(params, cfg, batch) -> float:
    """Weight bytes one decode step reads: everything but the routed experts and the vocab, plus the expected
    number of distinct routed experts a batch chooses (uniform routing) times one expert's bytes."""
    experts = params["moe_layers"]["mlp"]["experts"]
    ex = nbytes(experts)
    E, K = cfg.n_routed_experts, cfg.num_experts_per_tok
    touched = E * (1 - (1 - K / E) ** batch)
    rest = nbytes(params) - ex - nbytes(params["embed_tokens"]) - nbytes(params["lm_head"])
    return rest + ex / E * touched


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="a scaled-down block (CPU)")
    ap.add_argument("--prefill", type=int, default=None, help="prefill tokens (default 4096; --small 256)")
    ap.add_argument("--context", type=int, default=None, help="decode context (default 4096; --small 256)")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget", type=float, default=450.0, help="seconds after which no new measurement starts")
    args = ap.parse_args()
    t_start = time.perf_counter()
    cfg = block_config(args.small)
    T = args.prefill or (256 if args.small else 4096)
    C = args.context or (256 if args.small else 4096)
    kind, (peak, hbm) = chip()
    print(f"device: {kind} ({jax.default_backend()}), jax {jax.__version__}; bf16 peak {peak / 1e12:.0f} TFLOP/s"
          + (f", HBM {hbm / 1e12:.2f} TB/s" if hbm else ""))
    print(f"block: D={cfg.hidden_size} E={cfg.n_routed_experts} K={cfg.num_experts_per_tok} "
          f"F={cfg.moe_intermediate_size} heads={cfg.num_attention_heads}; prefill 1x{T}, decode context {C}")
    skipped = []

    def over():
        return time.perf_counter() - t_start > args.budget

    for fmt in FORMATS:
        if over():
            skipped.append(fmt)
            continue
        params = random_held(cfg, fmt)
        print(f"\n[{fmt}] weights held {nbytes(params) / 2**30:.2f} GiB "
              f"(routed experts {nbytes(params['moe_layers']['mlp']['experts']) / 2**30:.2f} GiB)")
        for impl in ("ragged", "tiled"):
            model = K2Model(cfg, jnp.bfloat16, moe_impl=impl)
            if impl == "ragged" and not over():
                toks = jnp.ones((1, T), jnp.int32)
                pre = jax.jit(lambda p: model.apply({"params": p}, toks, None, None, None, jnp.full((1,), T - 1)))
                s = median(time_fn(pre, params, repeats=args.repeats))
                print(f"  prefill 1x{T} ({impl}): {s * 1e3:.1f} ms, MFU {forward_flops(cfg, T) / s / peak:.3f}")
            for B in (int(b) for b in args.batches.split(",")):
                if over():
                    skipped.append(f"{fmt} decode {impl} b{B}")
                    continue
                cache = init_cache(cfg, B, C + 8, "bfloat16")
                cache = cache.replace(pages=jax.tree.map(lambda x: jnp.full(x.shape, 0.1, x.dtype), cache.pages),
                                      lengths=jnp.full((B,), C, jnp.int32))
                tok = jnp.ones((B, 1), jnp.int32)
                dec = jax.jit(lambda p, c: model.apply({"params": p}, tok, None, None, c)[0])
                s = median(time_fn(dec, params, cache, repeats=args.repeats))
                rd = decode_read_bytes(params, cfg, B)
                bw = f", {rd / s / 1e9:.1f} GB/s" + (f" = {rd / s / hbm:.2f} of HBM" if hbm else "")
                print(f"  decode b{B} ({impl}): {s * 1e3:.2f} ms, reads {rd / 2**20:,.1f} MiB of weights{bw}")
        del params

    if over():
        skipped.append("ragged vs dense MoE")
    else:
        M = 512
        E, D, F, K = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
        k = jax.random.split(jax.random.PRNGKey(9), 5)
        w = [jax.jit(lambda k, s=s: (jax.random.normal(k, s, jnp.float32) * 0.02).astype(jnp.bfloat16))(kk)
             for kk, s in zip(k[:3], [(E, D, F), (E, D, F), (E, F, D)])]
        x = jax.random.normal(k[3], (M, D), jnp.bfloat16)
        idx = jax.vmap(lambda kk: jax.random.permutation(kk, E)[:K])(jax.random.split(k[4], M)).astype(jnp.int32)
        wt = jnp.full((M, K), 1.0 / K, jnp.float32)
        t_r = median(time_fn(jax.jit(lambda *a: moe_grouped(*a, impl="ragged")), x, idx, wt, *w, repeats=args.repeats))
        t_d = median(time_fn(jax.jit(moe_dense), x, idx, wt, *w, repeats=args.repeats))
        print(f"\nMoE alone, {M} tokens, bf16: ragged {t_r * 1e3:.1f} ms, dense {t_d * 1e3:.1f} ms, "
              f"dense/ragged {t_d / t_r:.1f}x")
    if skipped:
        print(f"\nskipped (past --budget {args.budget:.0f} s): {', '.join(skipped)}")
    print(f"total {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
