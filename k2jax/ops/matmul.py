"""Matmuls of activations with weights, accumulating in float32."""

from __future__ import annotations

import math

import jax.numpy as jnp

from k2jax.ops.quant import is_quantized, materialize

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
        w = materialize(w, x.dtype if dtype is None else dtype)
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
