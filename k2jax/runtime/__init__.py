"""The inference runtime, below the HTTP layer (k2jax.serving): the paged latent KV cache (cache), the page pool
and prefix cache (pages) and the scheduler (scheduler), plain Python; the per-row sampler (sampling), the jitted
step that runs the model over the cache and samples (runner), the engine that ties them together (engine) with
its metrics, compile counter and incremental detokenizer (metrics, compiles, detok), and batched generation
(generate, exported as k2jax.generate; not imported here, so that importing the cache helpers does not pull in
the model)."""

from k2jax.runtime.cache import cache_bytes, init_cache, kv_bytes_per_token

__all__ = ["cache_bytes", "init_cache", "kv_bytes_per_token"]
