"""Small helpers shared by the modules: parameters with logical axis names, matmuls with f32 accumulation."""

from __future__ import annotations

import math

import flax.linen as nn
import jax.numpy as jnp

# Same scale as transformers' initializer_range; real weights come from checkpoints.
DEFAULT_INIT = nn.initializers.normal(stddev=0.02)


def param(module: nn.Module, name: str, shape, axes: tuple[str | None, ...], dtype, init=DEFAULT_INIT):
    """Create a parameter annotated with logical axis names (mapped to mesh axes by k2jax.sharding)."""
    assert len(axes) == len(shape), (name, shape, axes)
    return module.param(name, nn.with_logical_partitioning(init, axes), tuple(shape), dtype)


# XLA:CPU runs a matmul with fewer rows than this as a matrix-vector product that first converts the whole
# bf16 weight to float32 (3x slower than 4 rows, measured on a 1024 x 2048 weight): decode has 1 row.
_MIN_ROWS = 4


def einsum(eq: str, x, w, out_dtype=None):
    """einsum of activations x with a weight w in w's dtype, accumulating in float32 (about 3x faster for bf16
    on XLA:CPU than a bf16-accumulating dot, and more exact); the result in `out_dtype` (default w's dtype).

    x's leading axis must lead the output too (all the modules' equations: "BTD,DQ->BTQ", "...D,DF->...F").
    With fewer than _MIN_ROWS rows (decode), that axis is padded with zeros and the padding dropped again.
    """
    x = x.astype(w.dtype)
    x_spec, w_spec = eq.split("->")[0].split(",")
    letters = x_spec.replace("...", "")  # a leading "..." stands for x's first axes
    axes = dict(zip(letters, x.shape[x.ndim - len(letters):]))
    rows = x.size // math.prod(axes[a] for a in letters if a in w_spec)
    n = x.shape[0]
    if rows < _MIN_ROWS and x.ndim >= 2:
        x = jnp.pad(x, [(0, n * -(-_MIN_ROWS // rows) - n)] + [(0, 0)] * (x.ndim - 1))
    out = jnp.einsum(eq, x, w, preferred_element_type=jnp.float32)[:n]
    return out.astype(w.dtype if out_dtype is None else out_dtype)
