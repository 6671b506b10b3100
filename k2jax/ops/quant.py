"""Quantized linear weights held on device: FP8 e4m3 with block scales, INT4 with group scales.

A `QuantizedWeight` stands where a param array would, in k2jax's einsum layout [*lead, *in, *out] (lead: the
stacked layer / expert axes; in: the contraction dims; out: the rest). Its scales cover blocks of the
flattened [In, Out] matrix; the formats, their blocks and dtypes, and the params each holds quantized are the
table in k2jax.quant_policy:

    w[..., i, o] = q[..., i, o] * scales[..., i // block_in, o // block_out]

- "fp8":  q float8_e4m3fn, scales float32 (the Kimi-K2-Instruct release's `weight_scale_inv`, transposed
          with the weight).
- "int4": q symmetric int4 in -8..7, scales bfloat16 (the Kimi-K2-Thinking release's `weight_scale`,
          transposed). Stored two values per uint8 along the last (output) axis, low nibble first, each as
          value + 8, so the held bytes are half an element (XLA:CPU keeps jnp.int4 one per byte).

It is a pytree of (values, scales) with the format static, so it passes through jit, nn.scan's layer
slicing and shardings; a leading-axis index (`w[layer]`, `w[expert_ids]`) indexes both.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from k2jax.ops.spec import shard_count
from k2jax.quant_policy import FORMATS


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """values: fp8 [*lead, *in, *out] or packed int4 uint8 [*lead, *in, ..., out/2]; scales (float32 for
    fp8, bfloat16 for int4) [*lead, ceil(In/block_in), ceil(Out/block_out)]; fmt "fp8" | "int4"; in_ndim: how
    many dims after lead are input dims."""

    values: jax.Array
    scales: jax.Array
    fmt: str = dataclasses.field(metadata=dict(static=True))
    in_ndim: int = dataclasses.field(default=1, metadata=dict(static=True))

    @property
    def block(self) -> tuple[int, int]:
        """(inputs, outputs) that share one scale (k2jax.quant_policy)."""
        return FORMATS[self.fmt].block

    @property
    def lead_ndim(self) -> int:
        return self.scales.ndim - 2

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical (dequantized) shape."""
        s = tuple(self.values.shape)
        return s[:-1] + (2 * s[-1],) if self.fmt == "int4" else s

    @property
    def ndim(self) -> int:
        return len(self.values.shape)

    @property
    def nbytes(self) -> int:
        """Bytes held: values and scales (also for abstract jax.ShapeDtypeStruct leaves)."""
        return sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in (self.values, self.scales))

    def __getitem__(self, idx) -> "QuantizedWeight":
        """Index the lead axes (layers, experts) of values and scales alike."""
        return QuantizedWeight(self.values[idx], self.scales[idx], self.fmt, self.in_ndim)

    def dequantize(self, dtype=jnp.float32):
        """The plain weight [*lead, *in, *out] in `dtype` (computed in float32): the reference."""
        return dequantize_weight(self, dtype)


def _matrix_shape(shape, lead: int, in_ndim: int) -> tuple[int, int]:
    slot = shape[lead:]
    return math.prod(slot[:in_ndim]), math.prod(slot[in_ndim:])


def unpack_int4(packed):
    """uint8 [..., n/2] -> int8 [..., n] in -8..7 (low nibble first)."""
    xp = np if isinstance(packed, np.ndarray) else jnp
    lo = (packed & 0xF).astype(xp.int8) - 8
    hi = (packed >> 4).astype(xp.int8) - 8
    return xp.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def pack_int4(q):
    """int values in -8..7 [..., n] (n even) -> uint8 [..., n/2] (low nibble first, each stored as value + 8)."""
    xp = np if isinstance(q, np.ndarray) else jnp
    if q.shape[-1] % 2:
        raise ValueError(f"int4 packing needs an even last dim, got shape {tuple(q.shape)}")
    u = (q.astype(xp.int16) + 8).astype(xp.uint8).reshape(*q.shape[:-1], q.shape[-1] // 2, 2)
    return u[..., 0] | (u[..., 1] << 4)


def dequantize_weight(w: QuantizedWeight, dtype=jnp.float32):
    """A QuantizedWeight -> the plain weight [*lead, *in, *out] in dtype: values * scales broadcast over the
    blocks, computed in float32. Works on numpy or jax arrays."""
    xp = np if isinstance(w.values, np.ndarray) else jnp
    q = unpack_int4(w.values) if w.fmt == "int4" else w.values
    lead = w.lead_ndim
    shape = tuple(q.shape)
    In, Out = _matrix_shape(shape, lead, w.in_ndim)
    bi, bo = w.block
    q2 = q.reshape(*shape[:lead], In, Out).astype(xp.float32)
    s = xp.repeat(xp.repeat(w.scales.astype(xp.float32), bi, axis=-2)[..., :In, :], bo, axis=-1)[..., :Out]
    return (q2 * s).reshape(shape).astype(dtype)


def quantize_weight(w, fmt: str, in_ndim: int = 1, lead_ndim: int = 0) -> QuantizedWeight:
    """A plain weight [*lead, *in, *out] -> QuantizedWeight (absmax scaling per block). numpy or jax in.

    fp8: scale = absmax / 448 per 128x128 block; int4: symmetric, scale = absmax / 7 per group of 32 inputs.
    Lossy: for tests and for requantizing an FP8 source's routed experts to INT4.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantization format {fmt!r} (formats: {', '.join(FORMATS)})")
    xp = np if isinstance(w, np.ndarray) else jnp
    shape = tuple(w.shape)
    lead = shape[:lead_ndim]
    In, Out = _matrix_shape(shape, lead_ndim, in_ndim)
    bi, bo = FORMATS[fmt].block
    if fmt == "int4" and In % bi:
        raise ValueError(f"int4 groups of {bi} must divide the input dim {In} (weight shape {shape})")
    w2 = w.astype(xp.float32).reshape(*lead, In, Out)
    pi, po = -In % bi, -Out % bo
    wp = xp.pad(w2, [(0, 0)] * lead_ndim + [(0, pi), (0, po)])
    nb_i, nb_o = (In + pi) // bi, (Out + po) // bo
    blocks = wp.reshape(*lead, nb_i, bi, nb_o, bo)
    amax = xp.abs(blocks).max(axis=(-3, -1))
    qmax = FORMATS[fmt].qmax
    scales = xp.where(amax > 0, amax / qmax, 1.0).astype(xp.float32)
    if fmt == "int4":  # round the scale first, so that the values are quantized against the scale kept
        scales = scales.astype(ml_dtypes.bfloat16 if xp is np else jnp.bfloat16).astype(xp.float32)
    s = xp.repeat(xp.repeat(scales, bi, axis=-2)[..., :In, :], bo, axis=-1)[..., :Out]
    if fmt == "fp8":
        values = (w2 / s).astype(ml_dtypes.float8_e4m3fn if xp is np else jnp.float8_e4m3fn).reshape(shape)
    else:
        values = pack_int4(xp.clip(xp.round(w2 / s), -8, qmax).astype(xp.int8).reshape(shape))
        scales = scales.astype(ml_dtypes.bfloat16 if xp is np else jnp.bfloat16)
    return QuantizedWeight(values, scales, fmt, in_ndim)


def is_quantized(w) -> bool:
    return isinstance(w, QuantizedWeight)


def compute_dtype(w, x):
    """The dtype a matmul of activations x with weight w runs in: a plain weight's own dtype (as the modules
    always did), x's for a QuantizedWeight (the model's param dtype: fp8 / int4 values are only storage)."""
    return x.dtype if is_quantized(w) else w.dtype


def materialize(w, dtype):
    """w itself if plain; a QuantizedWeight dequantized to `dtype`. Called right at a matmul's operand inside
    the jitted step, so no dequantized copy of the weight outlives the op. XLA:CPU and XLA:TPU still write
    the dequantized operand out as a temp and read it back (bench/quant.py measures CPU's): a TPU decode step
    reads fp8 weights as held instead (k2jax.ops.matmul.einsum_fp8_blocks), and quantized experts through
    the Pallas kernel (k2jax.ops.gmm)."""
    return dequantize_weight(w, dtype) if is_quantized(w) else w


def scale_partition(w: QuantizedWeight, values_spec, mesh_shape: dict) -> tuple:
    """The PartitionSpec entries of w.scales given those of w.values (one per values dim), by the placement
    rule of k2jax.quant_policy: the lead dims (layers, experts) as the values; the input and the output block
    dims take the mesh axes of the first dim of their group when that shards whole blocks (each shard a
    multiple of the block, the block count divisible), else None (replicated). Used by k2jax.sharding (param
    shardings) and the expert-parallel shard_map alike."""
    spec = tuple(values_spec) + (None,) * (w.ndim - len(tuple(values_spec)))
    lead, ni = w.lead_ndim, w.in_ndim
    shape = w.shape
    In, Out = _matrix_shape(shape, lead, ni)
    out = list(spec[:lead])
    for group, size, block, nblocks in ((range(lead, lead + ni), In, w.block[0], w.scales.shape[-2]),
                                        (range(lead + ni, len(shape)), Out, w.block[1], w.scales.shape[-1])):
        first, *rest = [spec[d] for d in group]
        n = shard_count(first, mesh_shape)
        ok = first is not None and all(r is None for r in rest) and (size // n) % block == 0 and nblocks % n == 0
        out.append(first if ok else None)
    return tuple(out)


def dequantize_shard(w: QuantizedWeight, offsets, dtype):
    """Dequantize a shard of a weight whose scales are the whole weight's (replicated; see scale_partition):
    w.values [*lead, *in, *out] local, offsets (in_offset, out_offset) of this shard in the flattened
    [In, Out] matrix (traced ints) -> [*lead, *in, *out] in dtype. Each element's scale is gathered by its
    global block index."""
    q = unpack_int4(w.values) if w.fmt == "int4" else w.values
    lead = w.lead_ndim
    shape = tuple(q.shape)
    In, Out = _matrix_shape(shape, lead, w.in_ndim)
    bi, bo = w.block
    rows = (offsets[0] + jnp.arange(In)) // bi
    cols = (offsets[1] + jnp.arange(Out)) // bo
    s = jnp.take(jnp.take(w.scales.astype(jnp.float32), rows, axis=-2), cols, axis=-1)
    return (q.reshape(*shape[:lead], In, Out).astype(jnp.float32) * s).reshape(shape).astype(dtype)


def held_shapes(shape: tuple[int, ...], fmt: str, in_ndim: int = 1, lead_ndim: int = 0) -> QuantizedWeight:
    """The QuantizedWeight (of jax.ShapeDtypeStruct: nothing allocated) that `quantize_weight` makes of a weight
    of logical `shape`: what a load holds for it, values and scales."""
    return jax.eval_shape(lambda w: quantize_weight(w, fmt, in_ndim, lead_ndim),
                          jax.ShapeDtypeStruct(tuple(shape), jnp.float32))
