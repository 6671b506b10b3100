"""SwiGLU MLP: down(silu(x W_gate) * (x W_up)). Used for the dense blocks and the shared experts."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from k2jax.nn.common import param
from k2jax.ops.matmul import einsum
from k2jax.ops.quant import is_quantized
from k2jax.ops.split_mlp import swiglu_split_tokens
from k2jax.sharding import cutting_axes, split_specs


class MLP(nn.Module):
    """x [..., D] -> [..., D] through a hidden width F = intermediate_size."""

    intermediate_size: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x_BTD):
        D, F = x_BTD.shape[-1], self.intermediate_size
        gate_DF = param(self, "gate_proj", (D, F), ("embed", "mlp"), self.param_dtype)
        up_DF = param(self, "up_proj", (D, F), ("embed", "mlp"), self.param_dtype)
        down_FD = param(self, "down_proj", (F, D), ("mlp", "embed"), self.param_dtype)
        dt = self.param_dtype
        axis = _split_axis(x_BTD, gate_DF)
        if axis is not None and not any(map(is_quantized, (gate_DF, up_DF, down_FD))):
            return swiglu_split_tokens(x_BTD, gate_DF, up_DF, down_FD, axis, dt)
        h_BTF = (jax.nn.silu(einsum("...D,DF->...F", x_BTD, gate_DF, dtype=dt))
                 * einsum("...D,DF->...F", x_BTD, up_DF, dtype=dt))
        return einsum("...F,FD->...D", h_BTF, down_FD, dtype=dt)


def _split_axis(x_BTD, gate_DF) -> str | None:
    """The mesh axis along which both a lone row's tokens (sequence parallel) and the weights' hidden width
    are split, when it is one and nothing else is: then k2jax.ops.split_mlp lays the product out itself
    (along the slice's rings, rather than the compiler's one all-gather of the weights or of the tokens)."""
    if x_BTD.ndim != 3:
        return None
    x_spec = split_specs(("batch", "length", "act_embed"), x_BTD.shape)
    w_spec = split_specs(("embed", "mlp"), gate_DF.shape)
    if x_spec is None or w_spec is None:
        return None
    mesh_shape = dict(jax.sharding.get_abstract_mesh().shape)
    (b, t, d), (wd, f) = ([cutting_axes(e, mesh_shape) for e in spec] for spec in (x_spec, w_spec))
    if len(t) != 1 or t != f or b or d or wd:
        return None
    return t[0]
