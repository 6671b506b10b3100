"""SwiGLU MLP: down(silu(x W_gate) * (x W_up)). Used for the dense blocks and the shared experts."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from k2jax.nn.common import param
from k2jax.ops.collectives import replicated
from k2jax.ops.matmul import einsum
from k2jax.ops.quant import is_quantized
from k2jax.sharding import split_specs


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
        if _gathers_weights(x_BTD.shape, F) and not any(map(is_quantized, (gate_DF, up_DF, down_FD))):
            gate_DF, up_DF = (replicated(w, split_specs(("embed", "mlp"), w.shape)) for w in (gate_DF, up_DF))
            down_FD = replicated(down_FD, split_specs(("mlp", "embed"), down_FD.shape))
        h_BTF = (jax.nn.silu(einsum("...D,DF->...F", x_BTD, gate_DF, dtype=dt))
                 * einsum("...D,DF->...F", x_BTD, up_DF, dtype=dt))
        return einsum("...F,FD->...D", h_BTF, down_FD, dtype=dt)


def _gathers_weights(shape_BTD, F: int) -> bool:
    """Whether a lone row's tokens, split over chips (sequence parallel), take the weights whole: each chip
    then receives 3·D·F values once, where the other way round (the tokens gathered, F split, the outputs
    reduce-scattered) moves 2·T·D. Yes for K2's shared experts on an 8192-token chunk (F = 2048); no for
    its dense MLP (F = 18432), which the compiler lays out itself. Gathered by k2jax.ops.collectives, one
    physical ring at a time, rather than as the compiler's all-reduce of a zero-filled buffer."""
    spec = split_specs(("batch", "length", "act_embed"), tuple(shape_BTD))
    return spec is not None and len(shape_BTD) == 3 and spec[1] is not None and 3 * F < 2 * shape_BTD[1]
