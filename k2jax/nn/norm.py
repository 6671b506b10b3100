"""RMSNorm: computed in float32, cast back to the input dtype, then scaled (transformers' order)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from k2jax.nn.common import param


class RMSNorm(nn.Module):
    """y = weight * (x * rsqrt(mean(x², -1) + eps)).astype(x.dtype); x [..., D] -> [..., D]."""

    eps: float = 1e-6
    param_dtype: jnp.dtype = jnp.float32
    axis: str = "norm"  # logical axis name of the weight

    @nn.compact
    def __call__(self, x):
        w = param(self, "weight", (x.shape[-1],), (self.axis,), self.param_dtype, nn.initializers.ones)
        return rms_norm(x, w, self.eps)


def rms_norm(x, weight, eps: float):
    """Functional RMSNorm (also used by the absorbed decode path)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (weight * y.astype(x.dtype)).astype(x.dtype)
