"""FP8 (E4M3) weights with per-block scales, as in the DeepSeek-V3 / Kimi K2 release.

A weight w [out, in] is stored as fp8 [out, in] plus float32 `scale_inv` [ceil(out/bo), ceil(in/bi)], and
    w[i, j] = fp8[i, j] * scale_inv[i // bo, j // bi].
Edge blocks are partial (kv_a_proj_with_mqa [576, 7168] has scale_inv [5, 56]).

Both functions are vectorised (no loop over blocks) and work on numpy or jax arrays; extra leading axes
(e.g. stacked experts) are carried along.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448
DEFAULT_BLOCK = (128, 128)


def ensure_numpy_float8() -> None:
    """safetensors 0.8 looks up `numpy.float8_e4m3fn` to read F8_E4M3 tensors; numpy has no such attribute,
    ml_dtypes has the type. The one place this is patched (done on import of k2jax.checkpoint)."""
    if not hasattr(np, "float8_e4m3fn"):
        np.float8_e4m3fn = ml_dtypes.float8_e4m3fn


ensure_numpy_float8()


def scale_shape(shape: tuple[int, ...], block=DEFAULT_BLOCK) -> tuple[int, ...]:
    """scale_inv shape of a weight [..., out, in]: [..., ceil(out/bo), ceil(in/bi)]."""
    *lead, out, inn = shape
    return (*lead, math.ceil(out / block[0]), math.ceil(inn / block[1]))


def _xp(x):
    """numpy for numpy inputs, jax.numpy for jax arrays (the converter may dequantize on device)."""
    if isinstance(x, np.ndarray):
        return np
    import jax.numpy as jnp
    return jnp


def _pad_to_blocks(xp, x, block):
    *lead, out, inn = x.shape
    po, pi = -out % block[0], -inn % block[1]
    if po or pi:
        x = xp.pad(x, [(0, 0)] * len(lead) + [(0, po), (0, pi)])
    return x


def dequantize(w_fp8, scale_inv, block=DEFAULT_BLOCK, dtype=np.float32):
    """fp8 [..., out, in] * per-block scale_inv [..., ceil(out/bo), ceil(in/bi)] -> dtype [..., out, in].

    Computed in float32 and cast once at the end. The weight is padded to whole blocks, viewed as
    [..., ob, bo, ib, bi] and multiplied by scale_inv[..., :, None, :, None], then cropped: partial edge blocks
    take their block's scale like any other element.
    """
    xp = _xp(w_fp8)
    block = tuple(block)
    *lead, out, inn = w_fp8.shape
    want = scale_shape(w_fp8.shape, block)
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"dequantize: scale_inv shape {tuple(scale_inv.shape)} does not match weight "
                         f"{tuple(w_fp8.shape)} with block {block}: expected {want}")
    x = _pad_to_blocks(xp, w_fp8.astype(np.float32), block)
    ob, ib = want[-2:]
    x = x.reshape(*lead, ob, block[0], ib, block[1]) * scale_inv.astype(np.float32)[..., :, None, :, None]
    x = x.reshape(*lead, ob * block[0], ib * block[1])[..., :out, :inn]
    return x.astype(dtype)


def quantize(w, block=DEFAULT_BLOCK):
    """w [..., out, in] -> (fp8 [..., out, in], float32 scale_inv [..., ceil(out/bo), ceil(in/bi)]).

    scale_inv = amax(|block|) / 448, so each block's largest value maps to the largest finite E4M3; an
    all-zero block gets scale 1 (a zero scale would be rejected by the loader and means nothing).
    """
    xp = _xp(w)
    block = tuple(block)
    *lead, out, inn = w.shape
    ob, ib = scale_shape(w.shape, block)[-2:]
    x = _pad_to_blocks(xp, w.astype(np.float32), block).reshape(*lead, ob, block[0], ib, block[1])
    amax = xp.max(xp.abs(x), axis=(-3, -1))
    scale = xp.where(amax > 0, amax / FP8_MAX, 1.0).astype(np.float32)
    # Clip: amax / (amax / 448) can round to just above 448, which E4M3 (no inf) would turn into NaN.
    q = xp.clip(x / scale[..., :, None, :, None], -FP8_MAX, FP8_MAX)
    q = q.reshape(*lead, ob * block[0], ib * block[1])[..., :out, :inn].astype(FP8)
    return q, scale
