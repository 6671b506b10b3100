"""Quantized weights: bytes held, decode and prefill time, and the INT4-from-FP8 logit error, side by side.

    python bench/quant.py [--config configs/bench.json] [--context 2048] [--batches 1,16] [--repeats 3]

1. Param bytes in bf16, fp8 (the decoder blocks' linears in e4m3 + 128x128 float32 scales) and int4 (the
   routed experts in 4 bits + bf16 scales per group of 32), for the bench config measured on the arrays
   after quantize_params, and for Kimi K2 from abstract_params(cfg, quant=...) (values and scales; nothing
   allocated). Goal for K2: fp8 <= 0.51x bf16, int4 <= 0.30x.
2. Decode step (one token per row at `--context` tokens of cache, absorbed attention) and prefill (1 x 512)
   time on this machine for each, computing in bf16, with the per-layer expert views the runtime steps with
   on one CPU device. Goal: fp8 and int4 decode no slower than bf16. Beside each: the compiled step's temp bytes and
   how many bf16/f32 temps the size of a dequantized weight (>= D*F elements) its HLO writes: on XLA:CPU a
   dot reads materialised operands, so a dequantization the compiler cannot fuse into the dot shows up there.
3. Logits of an FP8 source (quantize_params "fp8") against the same model with its routed experts requantized
   to INT4 groups of 32 (what load(..., quant="int4") does with the FP8 release): max and mean |error|
   relative to max |logit|, and greedy next-token agreement.
"""

from __future__ import annotations

import argparse
import os
import re

from common import REPO, median, time_fn  # noqa: F401  (also puts the repo on sys.path)

import jax
import jax.numpy as jnp
import numpy as np

from k2jax import K2Config, K2Model, abstract_params
from k2jax.runtime.cache import init_cache
from k2jax.nn.quantized import quantize_params, requantize_params
from k2jax.ops.quant import is_quantized
from k2jax.nn.model import expert_views
from k2jax.testing import random_params

FORMATS = ("bf16", "fp8", "int4")


def tree_bytes(tree) -> int:
    return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


def held(params, fmt):
    """params (float32, numpy) -> the tree held on device for `fmt`, the plain leaves in bf16."""
    tree = params if fmt == "bf16" else quantize_params(params, None, fmt)
    return jax.tree.map(lambda a: a if is_quantized(a) else jnp.asarray(a, jnp.bfloat16), tree,
                        is_leaf=is_quantized)


def dequant_temps(hlo: str, min_elems: int) -> int:
    """How many fusions in compiled HLO text take fp8 / u8 inputs and write a bf16/f32 array of >= min_elems
    elements: a dequantized weight written to memory before its dot (not fused into the dot's operand)."""
    headers = {m.group(1): m.group(2) for m in re.finditer(r"^%?([\w.\-]+) \((.*?)\) -> ", hlo, re.M)}
    n = 0
    for m in re.finditer(r"= (?:bf16|f32)\[([\d,]*)\][^\n]*? fusion\([^\n]*?calls=%?([\w.\-]+)", hlo):
        elems = int(np.prod([int(d) for d in m.group(1).split(",") if d]))
        if elems >= min_elems and re.search(r"(f8e4m3fn|u8)\[", headers.get(m.group(2), "")):
            n += 1
    return n


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=os.path.join(REPO, "configs", "bench.json"))
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    cfg = K2Config.from_hf_config(args.config)
    k2 = K2Config.from_hf_config(os.path.join(REPO, "configs", "kimi_k2.json"))

    print("1. param bytes (values + scales)")
    base = random_params(cfg, np.float32, seed=0, scale=0.05)
    trees = {f: held(base, f) for f in FORMATS}
    b16 = tree_bytes(trees["bf16"])
    k2_bytes = {f: tree_bytes(abstract_params(k2, jnp.bfloat16, quant=None if f == "bf16" else f)) for f in FORMATS}
    print(f"   {'':8}{'bench config':>16}{'ratio':>8}{'Kimi K2 (GiB)':>16}{'ratio':>8}")
    for f in FORMATS:
        print(f"   {f:8}{tree_bytes(trees[f]):>16,}{tree_bytes(trees[f]) / b16:>8.3f}"
              f"{k2_bytes[f] / 2**30:>16,.1f}{k2_bytes[f] / k2_bytes['bf16']:>8.3f}")
    print(f"   goal for K2: fp8 <= 0.51x ({k2_bytes['fp8'] / k2_bytes['bf16']:.3f}), "
          f"int4 <= 0.30x ({k2_bytes['int4'] / k2_bytes['bf16']:.3f})")

    print(f"\n2. step time, bf16 compute, {jax.default_backend()} (with the runtime's per-layer expert views), ms")
    model = K2Model(cfg, jnp.bfloat16)
    D, F = cfg.hidden_size, cfg.moe_intermediate_size
    rows = []
    for f in FORMATS:
        p = expert_views(trees[f])
        row = {}
        for B in (int(b) for b in args.batches.split(",")):
            cache = init_cache(cfg, B, args.context + 8, "bfloat16")
            cache = cache.replace(pages=jax.tree.map(lambda x: jnp.asarray(np.random.default_rng(0).standard_normal(
                x.shape) * 0.5, x.dtype), cache.pages), lengths=jnp.full((B,), args.context, jnp.int32))
            tok = jnp.ones((B, 1), jnp.int32)
            step = jax.jit(lambda p, c: model.apply({"params": p}, tok, None, None, c)[0])
            compiled = step.lower(p, cache).compile()
            row[f"decode b{B}"] = median(time_fn(compiled, p, cache, repeats=args.repeats)) * 1e3
            row[f"temp b{B} MiB"] = compiled.memory_analysis().temp_size_in_bytes / 2**20
            row[f"deq temps b{B}"] = dequant_temps(compiled.as_text(), D * F)
        T = args.prefill
        toks = jnp.ones((1, T), jnp.int32)
        pre = jax.jit(lambda p: model.apply({"params": p}, toks, None, None, None, jnp.full((1,), T - 1)))
        row[f"prefill 1x{T}"] = median(time_fn(pre, p, repeats=args.repeats)) * 1e3
        rows.append((f, row))
    keys = list(rows[0][1])
    print("   " + f"{'':8}" + "".join(f"{k:>16}" for k in keys))
    for f, row in rows:
        print("   " + f"{f:8}" + "".join(f"{row[k]:>16.1f}" if isinstance(row[k], float) else f"{row[k]:>16}"
                                      for k in keys))
    for k in keys:
        if k.startswith("decode") or k.startswith("prefill"):
            print(f"   {k}: fp8/bf16 {rows[1][1][k] / rows[0][1][k]:.2f}x, int4/bf16 {rows[2][1][k] / rows[0][1][k]:.2f}x")

    print("\n3. INT4 requantization of an FP8 source vs the FP8 logits (float32 compute)")
    fp8 = quantize_params(base, cfg, "fp8")
    int4 = requantize_params(fp8, "int4", jnp.bfloat16)  # FP8 -> INT4 experts, the rest bf16
    ids = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 64)))
    fwd = jax.jit(lambda p: K2Model(cfg, jnp.float32).apply({"params": p}, ids))
    f32 = jax.tree.map(lambda a: a if is_quantized(a) else jnp.asarray(a, jnp.float32), fp8, is_leaf=is_quantized)
    i32 = jax.tree.map(lambda a: a if is_quantized(a) else jnp.asarray(a, jnp.float32), int4, is_leaf=is_quantized)
    a, b = np.asarray(fwd(f32)), np.asarray(fwd(i32))
    scale = np.abs(a).max()
    print(f"   max |err| / max |logit| {np.abs(a - b).max() / scale:.4f}, mean {np.abs(a - b).mean() / scale:.5f}, "
          f"greedy agreement {np.mean(a.argmax(-1) == b.argmax(-1)):.3f} over {a.shape[0] * a.shape[1]} positions")


if __name__ == "__main__":
    main()
