"""Inference: the latent KV cache, MLA attention kernels for prefill and decode, batched generation.

`generate` lives in k2jax.inference.generate (exported as k2jax.generate); it is not imported here because
k2jax.nn.mla imports this package's attention kernels.
"""

from k2jax.inference.attention import attend_absorbed, attend_blocked
from k2jax.inference.cache import cache_bytes, cache_shapes, init_cache

__all__ = ["attend_absorbed", "attend_blocked", "cache_bytes", "cache_shapes", "init_cache"]
