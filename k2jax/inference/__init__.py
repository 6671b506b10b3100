"""Inference: the latent KV cache and batched generation (the attention kernels are in k2jax.ops.attention).

`generate` lives in k2jax.inference.generate (exported as k2jax.generate); it is not imported here, so that
importing the cache helpers does not pull in the model. k2jax.inference.sampling is the per-row sampler
(OpenAI / vLLM settings, all traced) that the jitted steps call.
"""

from k2jax.inference.cache import cache_bytes, cache_shapes, init_cache

__all__ = ["cache_bytes", "cache_shapes", "init_cache"]
