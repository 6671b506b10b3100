"""The serving engine's jitted steps over one slot cache, apart from the host-side bookkeeping.

The slot cache is k2jax.inference.cache's latent cache for `max_batch` rows and `max_len + 1` positions:
row b is slot b; the extra last position is a scratch column. K2Model.decode writes a step's new latents at
one index shared by the whole batch, but each slot is at its own position: so the new latents are written
at scratch positions (which the rows may see, so causality is the kv_valid mask alone) and then moved to
each row's own positions. Cache positions are only storage: RoPE is applied from `positions`, and attention
is a softmax over a set of keys, so where a key sits in its row does not matter.

- `prefill_first`: the first chunk of C tokens of one slot's prompt, or of a bucket of slots' prompts, as
  K2Model's prefill (no cache to attend to), and the first new token sampled from each prompt's last logits.
- `prefill_next`: a later chunk of one slot's prompt, as a C-token decode against a copy of its row with C
  scratch columns appended (the chunk attends to the row's earlier chunks and causally to itself).
- `decode_rows`: one token for a bucket of the slots (the live ones), against copies of their rows: a step
  costs what its live rows cost, not what all the slots would.
- `decode`: one token for every slot, in place; rows that are not live only touch the scratch column.

The shapes are a few fixed chunk sizes and row buckets, all compiled up front.

With kv_cache_dtype float8 the cache holds e4m3 latents and a float32 scale per token (amax / 448 over the
token's latent), dequantized to the compute dtype for the step.

Letters: B rows of a step (slots), C chunk tokens, S cache positions, L layers, R latent rank, P rope dim, V vocabulary.
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
    """-> (prefill_first, prefill_next, decode_rows, decode), plain functions to jit with the cache (argument
    1) donated.

    prefill_first(params, cache, rows_B, tokens_BC, length_B, samp_B) -> (cache, tokens_B): the first chunk
    of a prompt in each of the B slots rows_B: length_B tokens at the right end of tokens_BC (left padding,
    as static generate has it), written at positions 0..length_B-1. It needs no cache, so it is K2Model's
    prefill (key-blocked attention), cheaper than attending over the rows. Samples from the last logits
    (meaningful when the chunk is the whole prompt). A row with length 0 writes nothing (fills a bucket).

    prefill_next(params, cache, rows_B, tokens_BC, start_B, length_B, samp_B) -> (cache, tokens_B): a later
    chunk: C tokens at positions start_B..start_B+C-1, attending to the row's positions < start_B; those at
    or past length_B are padding, computed but never written. Samples from the logits at length_B - 1.

    decode_rows(params, cache, rows_B, tokens_B, pos_B, live_B, samp_B) -> (cache, tokens_B): one token in
    each of B slots (a bucket of the live ones), written at pos_B in live rows.

    decode(params, cache, tokens_B, pos_B, live_B, samp_B) -> (cache, tokens_B): the same for every slot,
    in place (no copy of the cache's rows: at a full batch that copy would be the whole cache, every step).

    samp = {"seed", "step", "temperature", "top_k", "top_p"}, one value per row.
    """
    scratch = max_len  # the last of S = max_len + 1 positions
    S = max_len + 1

    def rows_step(params, cache, rows_B, tokens_BC, start_B, length_B):
        """Run C tokens in each of B slots against copies of their rows, with C scratch columns appended
        (where the model writes the new latents: they see each other causally, and the row's positions
        < start), then write the real ones at their own positions. -> (logits [B, C, V], cache)."""
        B, C = tokens_BC.shape
        dt = params["embed_tokens"].dtype
        view = dequantize(jax.tree.map(lambda c: c[:, rows_B], cache), dt)
        view = jax.tree.map(lambda v: jnp.concatenate([v, jnp.zeros(v.shape[:2] + (C,) + v.shape[3:], v.dtype)], 2),
                            view)
        s_S = jnp.arange(S + C)
        kv_valid_BS = (s_S[None] < start_B[:, None]) | (s_S >= S)[None]
        positions_BC = start_B[:, None] + jnp.arange(C, dtype=jnp.int32)[None]
        logits_BCV, view = model.apply({"params": params}, tokens_BC, positions_BC, kv_valid_BS, view, S,
                                       method=K2Model.decode)
        target_BC = jnp.where(positions_BC < length_B[:, None], positions_BC, scratch)  # padding: the scratch
        new = {g: {k: v[k][:, :, S:] for k in ("ckv", "k_pe")} for g, v in view.items()}
        return logits_BCV, _write(cache, rows_B[:, None], target_BC, new)

    def prefill_first(params, cache, rows_B, tokens_BC, length_B, samp_B):
        C = tokens_BC.shape[1]
        first_B = C - jnp.maximum(length_B, 1)  # a spare row runs one token and writes none
        t_BC = jnp.arange(C, dtype=jnp.int32)[None] - first_B[:, None]  # each token's position; < 0: padding
        logits_BV, new = model.apply({"params": params}, tokens_BC, jnp.maximum(t_BC, 0), t_BC >= 0,
                                     method=K2Model.prefill)
        target_BC = jnp.where((t_BC >= 0) & (length_B[:, None] > 0), t_BC, scratch)
        return _write(cache, rows_B[:, None], target_BC, new), _sample_rows(logits_BV, *(samp_B[k] for k in _SAMP))

    def prefill_next(params, cache, rows_B, tokens_BC, start_B, length_B, samp_B):
        logits_BCV, cache = rows_step(params, cache, rows_B, tokens_BC, start_B, length_B)
        last_B = jnp.clip(length_B - 1 - start_B, 0, tokens_BC.shape[1] - 1)
        logits_BV = jnp.take_along_axis(logits_BCV, last_B[:, None, None], axis=1)[:, 0]
        return cache, _sample_rows(logits_BV, *(samp_B[k] for k in _SAMP))

    def decode_rows(params, cache, rows_B, tokens_B, pos_B, live_B, samp_B):
        logits_B1V, cache = rows_step(params, cache, rows_B, tokens_B[:, None], pos_B, jnp.where(live_B, pos_B + 1, 0))
        return cache, _sample_rows(logits_B1V[:, 0], *(samp_B[k] for k in _SAMP))

    def decode(params, cache, tokens_B, pos_B, live_B, samp_B):
        # Every row's new latent is written at the scratch column (which every row may see, so causality is
        # kv_valid alone) and then moved to the row's own position.
        B = tokens_B.shape[0]
        dt = params["embed_tokens"].dtype
        s_S = jnp.arange(S)
        kv_valid_BS = (s_S[None] < pos_B[:, None]) | (s_S == scratch)[None]
        logits_B1V, view = model.apply({"params": params}, tokens_B[:, None], pos_B[:, None], kv_valid_BS,
                                       dequantize(cache, dt), scratch, method=K2Model.decode)
        target_B1 = jnp.where(live_B, pos_B, scratch)[:, None]
        new = {g: {k: v[k][:, :, scratch:] for k in ("ckv", "k_pe")} for g, v in view.items()}
        base = cache if _quantized(cache) else view  # unquantized, the updated view is the cache itself
        return _write(base, jnp.arange(B)[:, None], target_B1, new), _sample_rows(logits_B1V[:, 0],
                                                                                  *(samp_B[k] for k in _SAMP))

    return prefill_first, prefill_next, decode_rows, decode


def _write(cache, rows_B1, target_BC, new):
    """cache with new {group: {"ckv", "k_pe": [L, B, C, X]}} written at (rows_B1, target_BC), quantized for a
    float8 cache. Several writes to one scratch position may land in any order: none is read."""
    out = {}
    for g, v in cache.items():
        out[g] = dict(v)
        for k in ("ckv", "k_pe"):
            x_LBCX = new[g][k]
            if _quantized(cache):
                x_LBCX, scale_LBC = quantize(x_LBCX)
                out[g][f"{k}_scale"] = v[f"{k}_scale"].at[:, rows_B1, target_BC].set(scale_LBC)
            out[g][k] = v[k].at[:, rows_B1, target_BC].set(x_LBCX.astype(v[k].dtype))
    return out


_SAMP = ("seed", "step", "temperature", "top_k", "top_p")


def samp_arrays(B: int) -> dict:
    """Host-side per-slot sampling settings, all greedy."""
    return {"seed": np.zeros(B, np.uint32), "step": np.zeros(B, np.int32), "temperature": np.zeros(B, np.float32),
            "top_k": np.zeros(B, np.int32), "top_p": np.ones(B, np.float32)}


def row_buckets(max_batch: int) -> tuple[int, ...]:
    """The row counts compiled up front for a step over some of the slots: powers of two below max_batch,
    and it."""
    return tuple([b for b in (1 << i for i in range(20)) if b < max_batch] + [max_batch])


def bucket(n: int, sizes) -> int:
    """The smallest of `sizes` (ascending) that holds n."""
    return next(s for s in sizes if s >= n)


@functools.cache
def chunk_sizes(prefill_chunk: int) -> tuple[int, ...]:
    """The prefill chunk lengths compiled up front: powers of two from 64 below prefill_chunk, and it. A
    shorter chunk runs padded to the next size: below 64 tokens a chunk's cost is mostly reading the
    weights, so smaller sizes would add compiles and save little."""
    sizes = [c for c in (64 << i for i in range(20)) if c < prefill_chunk]
    return tuple(sizes + [prefill_chunk])
