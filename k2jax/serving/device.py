"""The serving engine's two jitted steps over one slot cache, apart from the host-side bookkeeping.

The slot cache is k2jax.inference.cache's latent cache for `max_batch` rows and `max_len + 1` positions:
row b is slot b; the extra last position is a scratch column. K2Model.decode writes a step's new latents at
one index shared by the whole batch, but each slot is at its own position: so every row's new token is
written at the scratch column (a position every row may see, so causality is the kv_valid mask alone) and
then moved to that row's own position. Cache positions are only storage: RoPE is applied from `positions`,
and attention is a softmax over a set of keys, so where a key sits in its row does not matter.

- `prefill_chunk`: up to C tokens of one slot's prompt, as a C-token decode against that slot's row of the
  cache (the chunk attends to the row's earlier chunks and causally to itself), and the first new token
  sampled from the last prompt token's logits. C is one of a few fixed chunk sizes (compiled up front).
- `decode`: one token for every slot; rows that are not live only touch the scratch column.

With kv_cache_dtype float8 the cache holds e4m3 latents and a float32 scale per token (amax / 448 over the
token's latent), dequantized to the compute dtype for the step.

Letters: B slots, C chunk tokens, S cache positions, L layers, R latent rank, P rope dim, V vocabulary.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from k2jax.inference.cache import cache_shapes, cache_sharding
from k2jax.inference.generate import sample
from k2jax.nn.model import K2Model

E4M3_MAX = 448.0
CACHE_DTYPES = ("auto", "bfloat16", "float32", "float8")  # auto: the params' dtype


def slot_cache(cfg, max_batch: int, max_len: int, compute_dtype, kv_cache_dtype: str, mesh=None):
    """The zero slot cache: {group: {"ckv": [L, B, S, R], "k_pe": [L, B, S, P]}} with S = max_len + 1 (the
    scratch column), plus {"ckv_scale", "k_pe_scale": [L, B, S]} float32 for float8."""
    if kv_cache_dtype not in CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {CACHE_DTYPES}, got {kv_cache_dtype!r}")
    dt = {"float8": jnp.float8_e4m3fn, "auto": compute_dtype}.get(kv_cache_dtype, kv_cache_dtype)
    shapes = cache_shapes(cfg, max_batch, max_len + 1, dt)
    cache = {}
    for g, leaves in shapes.items():
        cache[g] = {k: jnp.zeros(s.shape, s.dtype) for k, s in leaves.items()}
        if kv_cache_dtype == "float8":
            cache[g] |= {f"{k}_scale": jnp.zeros(s.shape[:3], jnp.float32) for k, s in leaves.items()}
    if mesh is not None:
        sh = cache_sharding(mesh)
        cache = jax.tree.map(lambda x: jax.device_put(x, sh if x.ndim == 4 else jax.sharding.NamedSharding(
            mesh, jax.sharding.PartitionSpec(*sh.spec[:3]))), cache)
    return cache


def _quantized(cache) -> bool:
    return any("ckv_scale" in g for g in cache.values())


def dequantize(cache, dtype):
    """The model's view of the cache: {group: {"ckv", "k_pe"}} in `dtype` (float8 leaves times their scale)."""
    if not _quantized(cache):
        return cache
    return {g: {k: (v[k].astype(jnp.float32) * v[f"{k}_scale"][..., None]).astype(dtype) for k in ("ckv", "k_pe")}
            for g, v in cache.items()}


def quantize(x):
    """x [..., R] -> (e4m3 [..., R], float32 scale [...]): a per-token scale, amax / 448."""
    x = x.astype(jnp.float32)
    scale = jnp.maximum(jnp.max(jnp.abs(x), axis=-1), 1e-12) / E4M3_MAX
    return (x / scale[..., None]).astype(jnp.float8_e4m3fn), scale


def _sample_rows(logits_BV, seed_B, step_B, temperature_B, top_k_B, top_p_B):
    """One token per row, each with its own settings and key fold_in(PRNGKey(seed), step); greedy rows skip
    the sort when no row samples."""
    def draw():
        def one(logits_V, seed, step, t, k, p):
            key = jax.random.fold_in(jax.random.PRNGKey(seed), step)
            return sample(logits_V[None], key, t, k, p)[0]
        return jax.vmap(one)(logits_BV, seed_B, step_B, temperature_B, top_k_B, top_p_B)

    greedy = lambda: jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)  # noqa: E731
    return jax.lax.cond(jnp.any(temperature_B > 0), draw, greedy)


def make_steps(model: K2Model, max_len: int):
    """-> (prefill_chunk, decode), plain functions to jit with the cache (argument 1) donated.

    prefill_chunk(params, cache, slot, tokens_C, start, length, samp) -> (cache, token): writes the chunk's
    latents at positions start..start+C-1 of row `slot` (tokens past `length`, the prompt's length, are
    padding: written but never visible) and samples from the logits at position length - 1 (meaningful on
    the prompt's last chunk). samp = {"seed", "step", "temperature", "top_k", "top_p"} scalars.

    decode(params, cache, tokens_B, pos_B, live_B, samp_B) -> (cache, tokens_B): tokens_B at positions pos_B
    (each row sees its positions < pos_B), written at pos_B in live rows; samp_B as above, [B] each.
    """
    scratch = max_len  # the last of S = max_len + 1 positions
    S = max_len + 1

    def prefill_chunk(params, cache, slot, tokens_C, start, length, samp):
        C = tokens_C.shape[0]
        row = jax.tree.map(lambda c: jax.lax.dynamic_slice_in_dim(c, slot, 1, axis=1), cache)
        dt = params["embed_tokens"].dtype
        view = dequantize(row, dt)
        positions_1C = (start + jnp.arange(C, dtype=jnp.int32))[None]
        kv_valid_1S = (jnp.arange(S) < length)[None]
        logits_1CV, view = model.apply({"params": params}, tokens_C[None], positions_1C, kv_valid_1S, view, start,
                                       method=K2Model.decode)
        if _quantized(row):
            def put(g, k):
                q, s = quantize(jax.lax.dynamic_slice_in_dim(view[g][k], start, C, axis=2))
                return {k: jax.lax.dynamic_update_slice_in_dim(row[g][k], q, start, axis=2),
                        f"{k}_scale": jax.lax.dynamic_update_slice_in_dim(row[g][f"{k}_scale"], s, start, axis=2)}
            row = {g: put(g, "ckv") | put(g, "k_pe") for g in row}
        else:
            row = view
        cache = jax.tree.map(lambda c, r: jax.lax.dynamic_update_slice_in_dim(c, r, slot, axis=1), cache, row)
        logits_V = jax.lax.dynamic_index_in_dim(logits_1CV[0], length - 1 - start, axis=0, keepdims=False)
        token = _sample_rows(logits_V[None], *(jnp.asarray(samp[k])[None] for k in _SAMP))[0]
        return cache, token

    def decode(params, cache, tokens_B, pos_B, live_B, samp_B):
        B = tokens_B.shape[0]
        dt = params["embed_tokens"].dtype
        s_S = jnp.arange(S)
        kv_valid_BS = (s_S[None] < pos_B[:, None]) | (s_S == scratch)[None]
        logits_B1V, view = model.apply({"params": params}, tokens_B[:, None], pos_B[:, None], kv_valid_BS,
                                       dequantize(cache, dt), scratch, method=K2Model.decode)
        target_B = jnp.where(live_B, pos_B, scratch)
        rows_B = jnp.arange(B)

        def move(c_LBSX, new_LBX):  # each row's new latent from the scratch column to its own position
            return c_LBSX.at[:, rows_B, target_B].set(new_LBX.astype(c_LBSX.dtype))

        out = {}
        for g, v in cache.items():
            out[g] = {}
            for k in ("ckv", "k_pe"):
                new_LBX = view[g][k][:, :, scratch]
                if _quantized(cache):
                    q, s = quantize(new_LBX)
                    out[g][k] = move(v[k], q)
                    out[g][f"{k}_scale"] = v[f"{k}_scale"].at[:, rows_B, target_B].set(s)
                else:
                    out[g][k] = move(view[g][k], new_LBX)
        tokens = _sample_rows(logits_B1V[:, 0], *(samp_B[k] for k in _SAMP))
        return out, tokens

    return prefill_chunk, decode


_SAMP = ("seed", "step", "temperature", "top_k", "top_p")


def samp_arrays(B: int) -> dict:
    """Host-side per-slot sampling settings, all greedy."""
    return {"seed": np.zeros(B, np.uint32), "step": np.zeros(B, np.int32), "temperature": np.zeros(B, np.float32),
            "top_k": np.zeros(B, np.int32), "top_p": np.ones(B, np.float32)}


@functools.cache
def chunk_sizes(prefill_chunk: int) -> tuple[int, ...]:
    """The prefill chunk lengths compiled up front: powers of two from 16 below prefill_chunk, and it."""
    sizes = [c for c in (16 << i for i in range(20)) if c < prefill_chunk]
    return tuple(sizes + [prefill_chunk])
