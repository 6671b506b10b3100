"""Shared helpers for the benchmark scripts: timing, model FLOPs, the machine's matmul peak."""

from __future__ import annotations

import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # bench/ scripts run from anywhere; the oracle client lives under tests/
    sys.path.insert(0, REPO)


def time_fn(fn, *args, repeats: int = 5, warmup: int = 1) -> list[float]:
    """Wall seconds of `fn(*args)` (blocked until ready), after warm-up."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return times


def median(xs) -> float:
    return statistics.median(xs)


def matmul_peak(dtype, n: int = 2048, repeats: int = 5) -> float:
    """Measured FLOP/s of one large n×n×n matmul in `dtype`, accumulating in float32 (how k2jax multiplies)."""
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), dtype)
    b = jax.random.normal(jax.random.PRNGKey(1), (n, n), dtype)
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    return 2 * n**3 / median(time_fn(f, a, b, repeats=repeats))


def forward_flops(cfg, tokens: int) -> float:
    """Matmul FLOPs of one causal forward over `tokens` positions: 2 × active matmul params × tokens, plus
    attention scores and values over the causal half of the T×T square."""
    D, N = cfg.hidden_size, cfg.num_attention_heads
    K, P, V, R = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    q = D * cfg.q_lora_rank + cfg.q_lora_rank * N * (K + P) if cfg.q_lora_rank else D * N * (K + P)
    mla = q + D * (R + P) + R * N * (K + V) + N * V * D
    dense = 3 * D * cfg.intermediate_size
    moe = 3 * D * cfg.moe_intermediate_size * (cfg.num_experts_per_tok + cfg.n_shared_experts) + D * (
        cfg.n_routed_experts or 0)
    per_token = cfg.num_hidden_layers * mla + cfg.num_dense_layers * dense + cfg.num_moe_layers * moe
    per_token += D * cfg.vocab_size
    attn = cfg.num_hidden_layers * 2 * N * (K + P + V) * tokens * (tokens + 1) / 2
    return 2 * per_token * tokens + attn
