"""Matmuls of activations with weights, accumulating in float32."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from k2jax.ops.quant import QuantizedWeight, is_quantized, materialize
from k2jax.sharding import local_size

# XLA:CPU workaround: XLA:CPU runs a matmul with fewer rows than this as a matrix-vector product that first
# converts the whole bf16 weight to float32 (3x slower than 4 rows, measured on a 1024 x 2048 weight):
# decode has 1 row. einsum pads such activations to this many rows.
CPU_MIN_ROWS = 4


def einsum(eq: str, x, w, out_dtype=None, dtype=None):
    """einsum of activations x with a weight w in w's dtype, accumulating in float32 (about 3x faster for bf16
    on XLA:CPU than a bf16-accumulating dot, and more exact); the result in `out_dtype` (default w's dtype).

    w may be a k2jax.ops.quant.QuantizedWeight (FP8 blocks, INT4 groups): it is dequantized to `dtype`
    (default x's) right at the dot's operand, inside the caller's jitted step, and the matmul runs in that
    dtype. `einsum_reference` is the plain form (the whole weight dequantized first), tested equal.

    x's leading axis must lead the output too (all the modules' equations: "BTD,DQ->BTQ", "...D,DF->...F").
    With fewer than CPU_MIN_ROWS rows (decode), that axis is padded with zeros and the padding dropped again.
    """
    if is_quantized(w):
        cdt = x.dtype if dtype is None else dtype
        if block_rows_apply(eq, x, w, cdt):
            out = jax.lax.platform_dependent(
                x, w, tpu=lambda x, w: einsum_fp8_blocks(eq, x, w, cdt),
                default=lambda x, w: einsum(eq, x, materialize(w, cdt)))
            return out.astype(cdt if out_dtype is None else out_dtype)
        w = materialize(w, cdt)
    x = x.astype(w.dtype)
    x_spec, w_spec = eq.split("->")[0].split(",")
    letters = x_spec.replace("...", "")  # a leading "..." stands for x's first axes
    axes = dict(zip(letters, x.shape[x.ndim - len(letters):]))
    rows = x.size // math.prod(axes[a] for a in letters if a in w_spec)
    n = x.shape[0]
    if rows < CPU_MIN_ROWS and x.ndim >= 2:
        x = jnp.pad(x, [(0, n * -(-CPU_MIN_ROWS // rows) - n)] + [(0, 0)] * (x.ndim - 1))
    out = jnp.einsum(eq, x, w, preferred_element_type=jnp.float32)[:n]
    return out.astype(w.dtype if out_dtype is None else out_dtype)


def einsum_reference(eq: str, x, w, dtype=jnp.float32):
    """The plain quantized matmul: w dequantized (k2jax.ops.quant.dequantize) to `dtype`, then jnp.einsum
    with float32 accumulation; result in dtype."""
    w = materialize(w, dtype)
    return jnp.einsum(eq, x.astype(w.dtype), w, preferred_element_type=jnp.float32).astype(w.dtype)


# The rows a TPU's matrix unit takes at once: a weight tile streamed through it costs about the same for any
# number of rows up to this. einsum_fp8_blocks feeds it rows x input blocks rows.
MXU_ROWS = 128


def _split(eq: str, x, w: QuantizedWeight):
    """(x's leading letters, the contracted letters, w's output letters) when eq contracts x's trailing dims
    with w's input dims in order and keeps x's leading ones then w's outputs ("BTNV,NVD->BTD"); else None."""
    x_spec, rest = eq.split(",")
    w_spec, out_spec = rest.split("->")
    ins, outs = w_spec[:w.in_ndim], w_spec[w.in_ndim:]
    if "." in eq or not x_spec.endswith(ins) or out_spec != x_spec[:-len(ins)] + outs:
        return None
    return x_spec[:-len(ins)], ins, outs


def block_rows_apply(eq: str, x, w, dtype) -> bool:
    """Whether a TPU step takes einsum_fp8_blocks for x @ w: an fp8 weight of one layer (no lead axes) in
    an equation of _split's kind, with a device's rows x input blocks at most MXU_ROWS (decode's few rows),
    in bf16. x's first axis is the batch, split over the mesh as the "batch" logical axis."""
    if not (is_quantized(w) and w.fmt == "fp8" and w.lead_ndim == 0 and jnp.dtype(dtype) == jnp.bfloat16):
        return False
    parts = _split(eq, x, w)
    if parts is None or not parts[0]:
        return False
    rows = local_size("batch", x.shape[0]) * math.prod(x.shape[1:len(parts[0])])
    return rows * w.scales.shape[-2] <= MXU_ROWS


def einsum_fp8_blocks(eq: str, x, w: QuantizedWeight, dtype=jnp.bfloat16):
    """x @ w for an fp8 weight with 128 x 128 block scales, the weight read as it is held: a TPU's form for a
    few rows (block_rows_apply), where XLA:TPU fuses a convert, but no block scale, into a dot's operand.

    Each row is repeated once per input block with the other blocks' inputs zeroed, so one plain dot with
    the fp8 values (converted to bf16 inside the dot's fusion: exact) gives every block's partial sums,
    float32 [rows x blocks, *out]. Each is scaled by its block's scales and summed. The dot computes
    `blocks` times the rows, which a matrix unit takes at about the cost of one row while that stays within
    MXU_ROWS. The dequantize-then-dot form (materialize; einsum_reference) first writes the whole layer's
    weight dequantized to HBM and reads it back: 9 to 17 times the fp8 bytes of Kimi K2's attention
    projections by the TPU compiler's count, against 1.07 to 1.16 times here. The dequantized weight is
    not rounded to bf16 here, so the result differs from that form within bf16 rounding, and is closer to
    the exact one (tests/test_quant.py)."""
    lead, ins, outs = _split(eq, x, w)
    q = w.values
    in_shape, out_shape = q.shape[:len(ins)], q.shape[len(ins):]
    In, Out = math.prod(in_shape), math.prod(out_shape)
    nb = w.scales.shape[-2]
    bi, bo = w.block
    lead_shape = x.shape[:len(lead)]
    M = math.prod(lead_shape)
    x_MI = x.reshape(M, In).astype(dtype)
    mine_bI = (jnp.arange(In) // bi)[None, :] == jnp.arange(nb)[:, None]
    # The repeated rows as one dim, (row, block) row-major, so that a mesh's split of the rows stays a split
    # of it; the products keep the weight's output dims. Measured on q_b_proj ([1536, 64, 192]): with two
    # row dims, or its outputs flattened, XLA:TPU copies the layer's slice before the dot.
    xb = jnp.where(mine_bI[None], x_MI[:, None, :], 0).reshape((M * nb,) + in_shape)
    z, b, m = [c for c in "ZYXWU" if c not in eq][:3]  # letters of their own for the repeated rows
    p = jnp.einsum(f"{z}{ins},{ins}{outs}->{z}{outs}", xb, q.astype(dtype), preferred_element_type=jnp.float32)
    s_bO = jnp.repeat(w.scales.astype(jnp.float32), bo, axis=-1)[:, :Out].reshape((nb,) + out_shape)
    y_MO = jnp.einsum(f"{m}{b}{outs},{b}{outs}->{m}{outs}", p.reshape((M, nb) + out_shape), s_bO,
                      precision=jax.lax.Precision.HIGHEST)
    return y_MO.reshape(lead_shape + out_shape).astype(dtype)
