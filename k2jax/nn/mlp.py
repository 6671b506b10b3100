"""SwiGLU MLP: down(silu(x W_gate) * (x W_up)). Used for the dense blocks and the shared experts."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from k2jax.nn.common import param
from k2jax.ops.matmul import einsum


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
        h_BTF = (jax.nn.silu(einsum("...D,DF->...F", x_BTD, gate_DF, dtype=dt))
                 * einsum("...D,DF->...F", x_BTD, up_DF, dtype=dt))
        return einsum("...F,FD->...D", h_BTF, down_FD, dtype=dt)
