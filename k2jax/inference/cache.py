"""The latent KV cache: per layer only the normalised latent ckv [B, S, R] and the rotated shared rotary key
k_pe [B, S, P] (K2_REFERENCE.md §3: 576 values per token per layer for Kimi K2, nothing per head).

Layout: {group: {"ckv": [L, B, S, R], "k_pe": [L, B, S, P]}} for group in dense_layers / moe_layers, each
stacked on a leading layer axis like its params (block l reads [l]). Leaves are in the params' dtype. With a
mesh the batch axis is split over 'data'.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from k2jax.config import K2Config
from k2jax.sharding import logical_to_spec


def _groups(cfg: K2Config):
    return [(name, n) for name, n in (("dense_layers", cfg.num_dense_layers), ("moe_layers", cfg.num_moe_layers))
            if n]


def cache_shapes(cfg: K2Config, batch: int, max_len: int, dtype=jnp.bfloat16):
    """The cache tree as jax.ShapeDtypeStruct leaves (no memory allocated)."""
    dt = jnp.dtype(dtype)
    return {name: {"ckv": jax.ShapeDtypeStruct((n, batch, max_len, cfg.kv_lora_rank), dt),
                   "k_pe": jax.ShapeDtypeStruct((n, batch, max_len, cfg.qk_rope_head_dim), dt)}
            for name, n in _groups(cfg)}


def init_cache(cfg: K2Config, batch: int, max_len: int, dtype=jnp.bfloat16):
    """An all-zero cache for `batch` sequences of up to `max_len` tokens."""
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), cache_shapes(cfg, batch, max_len, dtype))


def cache_bytes(cfg: K2Config, batch: int, max_len: int, dtype=jnp.bfloat16) -> int:
    """Bytes of the whole cache: layers × batch × max_len × (kv_lora_rank + qk_rope_head_dim) × itemsize."""
    return sum(int(np.prod(s.shape)) * s.dtype.itemsize
               for s in jax.tree.leaves(cache_shapes(cfg, batch, max_len, dtype)))


def pad_to_cache(entries, max_len: int):
    """Prefill's latents {group: {"ckv": [L, B, T, R], ...}} -> a cache of max_len slots (T first ones filled)."""
    def pad(x):
        if x.shape[2] > max_len:
            raise ValueError(f"prefill of {x.shape[2]} tokens does not fit a cache of {max_len} slots")
        return jnp.pad(x, [(0, 0), (0, 0), (0, max_len - x.shape[2]), (0, 0)])
    return jax.tree.map(pad, entries)


def cache_sharding(mesh: jax.sharding.Mesh):
    """Sharding of every cache leaf [L, B, S, *]: the batch split like the activations' batch (k2jax.sharding
    RULES: over 'data' and 'fsdp'), the rest replicated."""
    spec = logical_to_spec(("layers", "batch", None, None))
    return NamedSharding(mesh, PartitionSpec(*(_present(e, mesh) for e in spec)))


def batch_shards(mesh: jax.sharding.Mesh) -> int:
    """How many pieces the cache's batch is cut into on `mesh` (the batch must be a multiple)."""
    entry = cache_sharding(mesh).spec[1]
    return int(np.prod([mesh.shape[a] for a in ((entry,) if isinstance(entry, str) else entry or ())]))


def _present(entry, mesh):
    """A PartitionSpec entry restricted to the mesh's axes (a mesh may lack some of k2jax's axis names)."""
    axes = tuple(a for a in ((entry,) if isinstance(entry, str) else entry or ()) if a in mesh.axis_names)
    return axes or None
