"""Inference: the paged latent KV cache (k2jax.inference.cache), the per-row sampler
(k2jax.inference.sampling), the jitted step that runs the model over the cache and samples
(k2jax.inference.runner), and batched generation (k2jax.inference.generate, exported as k2jax.generate; not
imported here, so that importing the cache helpers does not pull in the model)."""

from k2jax.inference.cache import cache_bytes, init_cache, kv_bytes_per_token

__all__ = ["cache_bytes", "init_cache", "kv_bytes_per_token"]
