"""Making the paged latent KV cache (k2jax.ops.paged.PagedCache): pools, page tables, their sizes and
shardings.

A pool {group: [L, A, Y, R + P]} holds A pages of Y tokens for each layer group (dense_layers, moe_layers);
page 0 of each data-parallel shard is its trash page (k2jax.ops.paged). `init_cache` gives each row its own
contiguous run of pages, for a batch of known maximum length (k2jax.generate, tests); the serving engine
allocates pages as rows grow (k2jax.runtime.pages).

KV_DTYPES: "bfloat16", "float32", or "float8" (e4m3 values with a float32 scale per token and part: half
the bytes of bf16 plus 8 bytes per token and layer).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from k2jax.config import K2Config
from k2jax.ops.paged import PagedCache, batch_axes
from k2jax.runtime.settings import DEFAULT_PAGE_SIZE

KV_DTYPES = ("bfloat16", "float32", "float8")
TPU_LANE = 128  # on a TPU each token's values are padded to a multiple of this (k2jax.ops.paged)


def groups(cfg: K2Config) -> list[tuple[str, int]]:
    """(layer group, its layers) of the model, in order."""
    return [(name, n) for name, n in (("dense_layers", cfg.num_dense_layers), ("moe_layers", cfg.num_moe_layers))
            if n]


def storage_dtype(kv_dtype) -> jnp.dtype:
    """The pool's element dtype for a KV_DTYPES name (or a dtype)."""
    return jnp.dtype(jnp.float8_e4m3fn if str(kv_dtype) == "float8" else kv_dtype)


def lane(mesh=None) -> int:
    """The multiple a pool pads each token's values to: TPU_LANE on TPU devices (the mesh's, or the default
    backend's without one), else 1 (no padding)."""
    if mesh is not None and getattr(mesh, "devices", None) is not None:
        platform = np.asarray(mesh.devices).flat[0].platform
    else:
        platform = jax.default_backend()
    return TPU_LANE if platform == "tpu" else 1


def token_width(cfg: K2Config, lane: int = 1) -> int:
    """Values per token and layer in a pool: kv_lora_rank + qk_rope_head_dim, rounded up to `lane`."""
    C = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    return -(-C // lane) * lane


def kv_bytes_per_token(cfg: K2Config, kv_dtype="bfloat16", lane: int = 1) -> int:
    """Bytes one token holds in the cache over all layers: layers x (kv_lora_rank + qk_rope_head_dim) values
    (rounded up to `lane`: a TPU pool's, see `lane`), plus two float32 scales per layer for float8. The one
    place KV bytes are counted (k2jax.plan too)."""
    dt = storage_dtype(kv_dtype)
    per_layer = token_width(cfg, lane) * dt.itemsize
    if dt == jnp.float8_e4m3fn:
        per_layer += 2 * 4
    return cfg.num_hidden_layers * per_layer


def pool_shapes(cfg: K2Config, num_pages: int, page_size: int, kv_dtype="bfloat16", lane: int = 1):
    """(pages, scales) as jax.ShapeDtypeStruct trees: {group: [L, A, Y, R + P rounded up to lane]} and, for
    float8, {group: [L, A, 2 * Y]} float32 (k2jax.ops.paged's layout; else {})."""
    dt = storage_dtype(kv_dtype)
    C = token_width(cfg, lane)
    pages = {g: jax.ShapeDtypeStruct((n, num_pages, page_size, C), dt) for g, n in groups(cfg)}
    scales = ({g: jax.ShapeDtypeStruct((n, num_pages, 2 * page_size), jnp.float32) for g, n in groups(cfg)}
              if dt == jnp.float8_e4m3fn else {})
    return pages, scales


def pool_sharding(mesh, rows: int):
    """The pool's sharding on `mesh` for batches of `rows` rows: pages split like the batch (its mesh axes,
    k2jax.ops.paged.batch_axes), the rest whole. None without a mesh."""
    if mesh is None:
        return None
    axes = batch_axes(rows, mesh)
    return NamedSharding(mesh, PartitionSpec(None, axes or None))


def rows_sharding(mesh, rows: int):
    """The sharding of per-row arrays ([B, ...]: tokens, page tables, lengths) on `mesh`. None without one."""
    if mesh is None:
        return None
    axes = batch_axes(rows, mesh)
    return NamedSharding(mesh, PartitionSpec(axes or None))


def pool_tokens(cfg: K2Config, kv_dtype, bytes_per_shard: float, mesh=None, rows: int = 1) -> int:
    """Tokens a pool of `bytes_per_shard` bytes on each data-parallel shard holds over all of them (batches of
    `rows` rows on `mesh`), each token padded as `lane(mesh)` says: how --kv-memory and the default pool size
    become a token count."""
    per_token = kv_bytes_per_token(cfg, kv_dtype, lane(mesh))
    return int(bytes_per_shard / per_token) * data_shards(mesh, rows)


def data_shards(mesh, rows: int) -> int:
    """How many data-parallel shards a batch of `rows` rows (and its pool) is split into."""
    return 1 if mesh is None else math.prod(mesh.shape[a] for a in batch_axes(rows, mesh))


def empty_pool(cfg: K2Config, num_pages: int, page_size: int, kv_dtype="bfloat16", mesh=None, rows: int = 1):
    """An all-zero pool of `num_pages` pages (a multiple of the shard count), placed for batches of `rows`
    rows on `mesh` -> (pages, scales); each token's values padded as `lane(mesh)` says."""
    shards = data_shards(mesh, rows)
    if num_pages % shards:
        raise ValueError(f"a pool of {num_pages} pages does not split over {shards} data-parallel shards")
    sh = pool_sharding(mesh, rows)
    pages, scales = pool_shapes(cfg, num_pages, page_size, kv_dtype, lane(mesh))

    def zeros(s):
        return jnp.zeros(s.shape, s.dtype, device=sh)

    return jax.tree.map(zeros, pages), jax.tree.map(zeros, scales)


def init_cache(cfg: K2Config, batch: int, max_len: int, kv_dtype="bfloat16", page_size: int = DEFAULT_PAGE_SIZE,
               mesh=None) -> PagedCache:
    """An empty cache for `batch` rows of up to `max_len` tokens each, every row with its own contiguous
    pages (in its shard's part of the pool on `mesh`: rows and pages split over the batch's mesh axes)."""
    W = -(-max_len // page_size)
    shards = data_shards(mesh, batch)
    per_shard = batch // shards
    local = 1 + per_shard * W  # pages per shard: its trash page, then its rows' runs
    pages, scales = empty_pool(cfg, shards * local, page_size, kv_dtype, mesh, batch)
    row = np.arange(batch)[:, None]
    table = ((row // per_shard) * local + 1 + (row % per_shard) * W + np.arange(W)[None, :]).astype(np.int32)
    return PagedCache(pages, scales, _put(table, mesh, batch), _put(np.zeros(batch, np.int32), mesh, batch),
                      cfg.qk_rope_head_dim, () if mesh is None else batch_axes(batch, mesh),
                      pad=token_width(cfg, lane(mesh)) - token_width(cfg))


def _put(x, mesh, rows):
    sh = rows_sharding(mesh, rows)
    return jnp.asarray(x) if sh is None else jax.device_put(x, sh)


def cache_bytes(cfg: K2Config, batch: int, max_len: int, kv_dtype="bfloat16") -> int:
    """Bytes of the cache of `batch` rows of `max_len` tokens (pages rounded up, trash pages not counted)."""
    return batch * max_len * kv_bytes_per_token(cfg, kv_dtype)
