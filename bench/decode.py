"""Decode benchmark: absorbed vs expanded MLA decode steps, cache bytes, long prefill memory, and k2jax's
generate against transformers' generate on the same weights.

    python bench/decode.py [--contexts 256,2048,8192] [--batches 1,16] [--repeats 3] [--skip-hf] [--skip-long]

1. Decode step time (bench config, bf16, whole model, one jitted step): absorbed vs expanded attention on the
   same latent cache, at each context and batch, with the ratio side by side. Goal: absorbed faster at 2k+.
2. Cache bytes per token, per layer (goal for Kimi K2: 576 × 2 bytes).
3. Peak memory of a 32k-token prefill of the tiny config (key-blocked attention), measured in a subprocess.
4. Greedy generate, batch 1, 128 new tokens: k2jax (bf16 and f32) vs transformers (the oracle: float32,
   eager, use_cache=True) on the same weights, timed around the call. Goal: k2jax decode tokens/s >= 3×.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time

from common import REPO, median, time_fn  # noqa: F401  (also puts the repo on sys.path)

import jax
import jax.numpy as jnp

from k2jax import K2Config, K2Model, generate, load_hf
from k2jax.runtime.cache import init_cache, kv_bytes_per_token
from k2jax.nn.model import expert_views
from k2jax.testing import prefill_memory, random_params

CONFIGS = os.path.join(REPO, "configs")


def decode_step_times(cfg, params, batch, context, repeats, expanded=True):
    """Seconds per decode step (absorbed, expanded) with `context` tokens already in a random paged cache."""
    S = context + 8
    cache = init_cache(cfg, batch, S, "bfloat16")
    key = jax.random.PRNGKey(0)
    cache = cache.replace(pages=jax.tree.map(lambda x: jax.random.normal(key, x.shape, x.dtype), cache.pages),
                          lengths=jnp.full((batch,), context, jnp.int32))
    tokens = jnp.ones((batch, 1), jnp.int32)
    out = []
    for attention in ("auto", "plain") if expanded else ("auto",):
        model = K2Model(cfg, jnp.bfloat16, attention=attention)  # auto: absorbed for one token per row
        step = jax.jit(lambda p, c, m=model: m.apply({"params": p}, tokens, None, None, c)[0])
        out.append(median(time_fn(step, params, cache, repeats=repeats)))
    return out


def long_prefill(length):
    """(seconds, MiB resident before, MiB the peak grew) of a tiny-config prefill, in its own process."""
    return prefill_memory(length, f"{REPO}/configs/tiny.json")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="256,2048,8192")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--skip-hf", action="store_true", help="skip the transformers comparison")
    ap.add_argument("--skip-long", action="store_true", help="skip the 32k-token prefill")
    args = ap.parse_args()
    cfg = K2Config.from_hf_config(os.path.join(CONFIGS, "bench.json"))
    print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({os.cpu_count()} cpus); bench config "
          f"{cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads, "
          f"kv_lora {cfg.kv_lora_rank}, rope {cfg.qk_rope_head_dim}; bf16")

    print("\n== cache bytes per token")
    for name in ("bench", "kimi_k2"):
        c = K2Config.from_hf_config(os.path.join(CONFIGS, f"{name}.json"))
        per_tok = kv_bytes_per_token(c)
        naive = c.num_hidden_layers * c.num_attention_heads * (c.qk_head_dim + c.v_head_dim) * 2
        print(f"{name:8s}: {per_tok / c.num_hidden_layers:.0f} B per layer "
              f"(= ({c.kv_lora_rank} + {c.qk_rope_head_dim}) x 2), {per_tok / 2**10:.1f} KiB per token; "
              f"per-head K/V would be {naive / per_tok:.1f}x more")

    print("\n== decode step (whole model, one token per sequence), ms: absorbed vs expanded, with the per-layer "
          "expert views `k2jax generate` steps with on CPU; last column: absorbed on the stacked params alone")
    stacked = random_params(cfg, jnp.bfloat16, scale=0.05)
    params = expert_views(stacked)
    print(f"{'batch':>5} {'context':>7} {'absorbed':>9} {'expanded':>9} {'exp/abs':>8} {'stacked':>8}")
    for b in map(int, args.batches.split(",")):
        for ctx in map(int, args.contexts.split(",")):
            a, e = decode_step_times(cfg, params, b, ctx, args.repeats)
            s = decode_step_times(cfg, stacked, b, ctx, args.repeats, expanded=False)[0]
            print(f"{b:5d} {ctx:7d} {a * 1e3:9.1f} {e * 1e3:9.1f} {e / a:7.2f}x {s * 1e3:8.1f}", flush=True)
    del stacked, params

    if not args.skip_long:
        print("\n== long prefill, tiny config, key-blocked attention (subprocess)")
        for L in (8192, 32768):
            secs, before, grew = long_prefill(L)
            plain = 4 * L * L * 4 / 2**30
            print(f"{L:6d} tokens: {secs:.1f} s, resident {before / 1024:.2f} GiB before, peak +{grew:.0f} MiB "
                  f"during the run; the plain path's f32 scores alone would be {plain:.1f} GiB", flush=True)

    if args.skip_hf:
        return
    from tests.oracle.client import Oracle, require_oracle

    oracle = require_oracle()
    if oracle is None:
        print(f"\n(skipping transformers: {Oracle.unavailable_reason()})")
        return
    print(f"\n== greedy generate, batch 1, 16-token prompt, {args.new_tokens} new tokens")
    prompt = [list(range(1, 17))]
    with oracle, tempfile.TemporaryDirectory() as d:
        req = {"config": cfg.to_hf_config(), "seed": 0}
        oracle.run(req | {"save": {"dir": d, "format": "hf"}, "generate": {"prompts": prompt, "max_new_tokens": 2}})
        t = time.perf_counter()  # the model is cached in the oracle: this times generate (+ npz I/O)
        hf = oracle.run(req | {"generate": {"prompts": prompt, "max_new_tokens": args.new_tokens}})["generate.0"]
        hf_s = time.perf_counter() - t
        print(f"transformers (float32, eager): {args.new_tokens / hf_s:8.1f} tokens/s overall ({hf_s:.2f} s)")
        for dtype in (jnp.bfloat16, jnp.float32):
            p = load_hf(d, dtype)[1]
            model = K2Model(cfg, dtype)
            generate(model, p, prompt, args.new_tokens)  # compile
            tm = {}
            t = time.perf_counter()
            toks, _ = generate(model, p, prompt, args.new_tokens, timings=tm)
            total = time.perf_counter() - t
            decode_tps = tm["decode_steps"] / tm["decode_s"]
            same = int((toks[0] == hf[:len(toks[0])]).cumprod().sum())
            print(f"k2jax ({jnp.dtype(dtype).name:8s}):          {args.new_tokens / total:8.1f} tokens/s overall, "
                  f"decode {decode_tps:.1f} tokens/s, prefill {tm['prefill_s'] * 1e3:.1f} ms -> "
                  f"{args.new_tokens / total / (args.new_tokens / hf_s):.1f}x transformers; "
                  f"first {same} tokens equal transformers'", flush=True)


if __name__ == "__main__":
    main()
