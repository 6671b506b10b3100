"""Rotary position embedding with YaRN scaling and DeepSeek's interleaved pair layout.

The checkpoint's rotary columns are interleaved pairs (x0, x1), (x2, x3), ...; pair i is rotated by
angle pos·inv_freq[i] and the result is written as [rotated evens; rotated odds] (transformers' layout).
q and k use the same layout, so their dot product is that of the interleaved rotation.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from k2jax.config import K2Config, yarn_mscale


def inv_freq(cfg: K2Config) -> np.ndarray:
    """Per-pair inverse frequencies [qk_rope_head_dim // 2], float32, mirroring transformers' float32 math."""
    d, base = cfg.qk_rope_head_dim, cfg.rope_theta
    pos_freqs = np.float32(base) ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d))
    extra = (np.float32(1.0) / pos_freqs).astype(np.float32)
    if cfg.rope_type == "default":
        return extra
    s = cfg.rope_factor
    inter = (np.float32(1.0) / (np.float32(s) * pos_freqs)).astype(np.float32)

    def corr_dim(rotations):
        return d * math.log(cfg.rope_original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(base))

    low, high = corr_dim(cfg.rope_beta_fast), corr_dim(cfg.rope_beta_slow)
    if cfg.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # as transformers: avoid a zero-width ramp
    ramp = np.clip((np.arange(d // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extra_factor = np.float32(1) - ramp
    return (inter * (1 - extra_factor) + extra * extra_factor).astype(np.float32)


def attention_factor(cfg: K2Config) -> float:
    """YaRN multiplies cos and sin by this (1 for Kimi K2: mscale == mscale_all_dim)."""
    if cfg.rope_type == "default":
        return 1.0
    if cfg.rope_attention_factor is not None:
        return float(cfg.rope_attention_factor)
    s = cfg.rope_factor
    if cfg.rope_mscale and cfg.rope_mscale_all_dim:
        return yarn_mscale(s, cfg.rope_mscale) / yarn_mscale(s, cfg.rope_mscale_all_dim)
    return yarn_mscale(s)


def apply_rope(x_BTNP, positions_BT, cfg: K2Config):
    """Rotate x [B, T, N, P] (P = qk_rope_head_dim) at integer positions [B, T]; returns x's shape and dtype."""
    freqs_BTp = positions_BT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq(cfg))
    scale = attention_factor(cfg)
    cos = (jnp.cos(freqs_BTp) * scale).astype(x_BTNP.dtype)[:, :, None, :]
    sin = (jnp.sin(freqs_BTp) * scale).astype(x_BTNP.dtype)[:, :, None, :]
    half = x_BTNP.shape[-1] // 2
    if cfg.rope_interleave:
        x1, x2 = x_BTNP[..., 0::2], x_BTNP[..., 1::2]
    else:
        x1, x2 = x_BTNP[..., :half], x_BTNP[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
