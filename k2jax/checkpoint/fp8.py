"""FP8 (E4M3) weights with per-block scales, as in the DeepSeek-V3 / Kimi K2 release.

A weight w [out, in] is stored as fp8 [out, in] plus float32 `scale_inv` [ceil(out/bo), ceil(in/bi)], and
    w[i, j] = fp8[i, j] * scale_inv[i // bo, j // bi].
Edge blocks are partial (kv_a_proj_with_mqa [576, 7168] has scale_inv [5, 56]).

This is the release's (HF) layout, [out, in] with (out, in) blocks; k2jax.ops.quant.QuantizedWeight holds the
same values and scales transposed into k2jax's layout. `dequantize_fp8_blocks` and `quantize_fp8_blocks` are
vectorised (no loop over blocks) and work on numpy or jax arrays; extra leading axes (e.g. stacked experts) are
carried along. `dequantize_fp8_transposed` and `transpose` are the converter's fast host paths (numpy in,
numpy out).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from k2jax.quant_policy import FORMATS

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448
DEFAULT_BLOCK = FORMATS["fp8"].block  # the release's weight_block_size (k2jax.quant_policy)


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
    return np if isinstance(x, np.ndarray) else jnp


def _pad_to_blocks(xp, x, block):
    *lead, out, inn = x.shape
    po, pi = -out % block[0], -inn % block[1]
    if po or pi:
        x = xp.pad(x, [(0, 0)] * len(lead) + [(0, po), (0, pi)])
    return x


def dequantize_fp8_blocks(w_fp8, scale_inv, block=DEFAULT_BLOCK, dtype=np.float32):
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
        raise ValueError(f"dequantize_fp8_blocks: scale_inv shape {tuple(scale_inv.shape)} does not match weight "
                         f"{tuple(w_fp8.shape)} with block {block}: expected {want}")
    x = _pad_to_blocks(xp, w_fp8.astype(np.float32), block)
    ob, ib = want[-2:]
    x = x.reshape(*lead, ob, block[0], ib, block[1]) * scale_inv.astype(np.float32)[..., :, None, :, None]
    x = x.reshape(*lead, ob * block[0], ib * block[1])[..., :out, :inn]
    return x.astype(dtype)


def quantize_fp8_blocks(w, block=DEFAULT_BLOCK):
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


# ------------------------------------------------------------------------------------------------------
# Host fast paths for the converter: HF [out, in] -> k2jax [in, out], C-contiguous.
_TILE = 256  # transpose's numpy tiles (the rows left over): 64 x 256, a tile's lines and pages in reach
RUN_BYTES = 128  # transpose: bytes of each contiguous run the XLA pass writes (its strips' rows x itemsize)
_XLA_MIN_BYTES = 1 << 16  # below this a transpose is all numpy (an XLA call costs more than the copy)


def _bits(x: np.ndarray) -> np.ndarray:
    """x viewed as the unsigned integer of its itemsize (numpy's strided copies of ml_dtypes types are slow)."""
    return x.view(f"u{x.dtype.itemsize}")


def transpose(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """x [R, C] -> x.T as a C-contiguous [C, R] array (`out` when given), bit for bit; any dtype (moved by its
    bits). `transpose_reference` is the plain form.

    Two passes that each read and write whole cache lines: one XLA loop turns strips of h rows (h x itemsize =
    RUN_BYTES) into [R/h, C, h], then numpy moves those h-element runs into place (and the last R % h rows).
    A transposing copy element by element (numpy's, or XLA's of the whole array) reads a whole row apart per
    element; for the release's power-of-two widths those rows fall into the same cache sets, and a 1-byte
    (e4m3) transpose runs at 0.2-0.4 GB/s against 2-3 GB/s for this.
    """
    R, C = x.shape
    out = np.empty((C, R), x.dtype) if out is None else out
    if out.shape != (C, R) or out.dtype != x.dtype or not out.flags.c_contiguous:
        raise ValueError(f"transpose: out {out.shape} {out.dtype} is not a C-contiguous {(C, R)} {x.dtype}")
    src, dst = _bits(x), _bits(out)
    h = max(1, RUN_BYTES // x.dtype.itemsize)
    q = R // h * h if x.nbytes >= _XLA_MIN_BYTES else 0
    if q:
        strips = np.asarray(_strips(np.ascontiguousarray(src[:q]), h))  # [q/h, C, h]
        runs = dst[:, :q]
        np.copyto(np.lib.stride_tricks.as_strided(runs, (C, q // h, h), (runs.strides[0], h * runs.strides[1],
                                                                         runs.strides[1])),
                  strips.transpose(1, 0, 2))
    for r in range(q, R, 64):  # the rest (all of a small array), tile by tile
        for c in range(0, C, _TILE):
            dst[c:c + _TILE, r:r + 64] = src[r:r + 64, c:c + _TILE].T
    return out


def transpose_reference(x: np.ndarray) -> np.ndarray:
    """The plain form of `transpose`."""
    return np.ascontiguousarray(x.T)


@functools.partial(jax.jit, static_argnums=1)
def _strips(x, h):
    """[R, C] -> [R/h, C, h]: each strip of h rows transposed (unsigned ints: XLA moves them as they are)."""
    R, C = x.shape
    return x.reshape(R // h, h, C).transpose(0, 2, 1)


def count_nonfinite(x: np.ndarray) -> int:
    """Count of NaN / inf elements, by bit pattern (fast for bf16 and e4m3, which numpy does not know). In
    pieces, so the temporaries stay small and in cache; a piece is counted only if a quick test finds one."""
    flat, n = x.reshape(-1), 0
    for i in range(0, flat.size, 1 << 20):
        part = flat[i:i + (1 << 20)]
        if _may_have_nonfinite(part):
            n += _count_nonfinite(part)
    return n


# An element is NaN / inf when its exponent bits (per lane of a uint64: e4m3fn bytes, bfloat16 halves) are
# all ones; adding one below them carries into the lane's top bit only then (no carry between lanes).
_LANES = {FP8: (0x7F7F7F7F7F7F7F7F, 0x0101010101010101, 0x8080808080808080),
          np.dtype(ml_dtypes.bfloat16): (0x7F807F807F807F80, 0x0080008000800080, 0x8000800080008000)}


def _may_have_nonfinite(x: np.ndarray) -> bool:
    lanes = _LANES.get(x.dtype)
    if lanes is None or x.nbytes % 8:
        return True
    mask, one, top = (np.uint64(v) for v in lanes)
    w = x.view(np.uint64) & mask
    w += one
    w &= top
    return bool(w.max(initial=0))


def _count_nonfinite(x: np.ndarray) -> int:
    if x.dtype == FP8:
        return int(np.count_nonzero((x.view(np.uint8) & 0x7F) == 0x7F))  # e4m3fn: NaN only
    if x.dtype == np.dtype(ml_dtypes.bfloat16):
        return int(np.count_nonzero((x.view(np.uint16) & 0x7F80) == 0x7F80))
    if x.dtype == np.float16:
        return int(np.count_nonzero((x.view(np.uint16) & 0x7C00) == 0x7C00))
    return int(x.size - np.count_nonzero(np.isfinite(x)))


def dequantize_fp8_transposed(w_OI: np.ndarray, scale: np.ndarray, block=DEFAULT_BLOCK, dtype=np.float32,
                              out: np.ndarray | None = None, tmp: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    """fp8 [out, in] with block scales -> (dtype [in, out] C-contiguous, into `out` (C-contiguous) when given;
    count of non-finite values): `dequantize_fp8_blocks(w, scale, block, float32).astype(dtype).T`, bit for bit.

    The e4m3 bytes are transposed first (`transpose`, into `tmp` (uint8 [in, out]) when given: one byte per
    element moved, not the output's two or four), then one XLA loop decodes (by bits), scales and rounds in the
    output's own order, contiguous and vectorised; its result is copied into `out`. Each element's arithmetic is
    the same, so the bits are. The count is of NaN bytes in the data (the only way a finite positive scale yields
    a non-finite value), or of the output's non-finite values where a scale is large enough to overflow.
    """
    O, I = w_OI.shape
    dtype = np.dtype(dtype)
    scale = scale.astype(np.float32, copy=False)
    if tuple(scale.shape) != scale_shape(w_OI.shape, block):
        raise ValueError(f"dequantize_fp8_transposed: scale_inv shape {tuple(scale.shape)} does not match weight "
                         f"{tuple(w_OI.shape)} with block {tuple(block)}")
    u_IO = transpose(w_OI.view(np.uint8), tmp)
    y = np.asarray(_dequantize_transposed(u_IO, np.ascontiguousarray(scale.T), tuple(block), dtype))
    out = np.empty((I, O), dtype) if out is None else out
    np.copyto(_bits(out), _bits(y))
    if float(np.max(scale, initial=0.0)) * FP8_MAX < 2.0 ** 127:
        return out, count_nonfinite(w_OI)
    return out, count_nonfinite(out)  # NaN scales (excluded by the loader's checks) land here too


@functools.partial(jax.jit, static_argnums=(2, 3))
def _dequantize_transposed(u_IO, s_IO, block, dtype):
    """e4m3 bytes [in, out] (the weight transposed), its block scales transposed [in/bi, out/bo] -> dtype [in, out]."""
    inn, out = u_IO.shape
    x = _pad_to_blocks(jnp, _e4m3_to_f32(u_IO), block[::-1])
    ib, ob = s_IO.shape
    x = x.reshape(ib, block[1], ob, block[0]) * s_IO[:, None, :, None]
    return x.reshape(ib * block[1], ob * block[0])[:inn, :out].astype(dtype)


def _e4m3_to_f32(u):
    """e4m3fn bytes (jax uint8) -> float32, exactly as `astype` (XLA's own conversion is slower): normal
    numbers by moving the bits into place, subnormals (exponent 0) as m * 2^-9."""
    b = u.astype(jnp.uint32)
    mag = b & 0x7F
    normal = lax.bitcast_convert_type((mag << 20) + (120 << 23), jnp.float32)  # rebias exponent 7 -> 127
    v = jnp.where(mag < 8, (b & 7).astype(jnp.float32) * np.float32(2.0 ** -9), normal)
    v = jnp.where(mag == 0x7F, np.float32(np.nan), v)
    return lax.bitcast_convert_type(lax.bitcast_convert_type(v, jnp.uint32) | ((b >> 7) << 31), jnp.float32)
