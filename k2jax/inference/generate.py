"""Batched generation with the latent KV cache: one jitted prefill, then one jitted decode step per token.

Prompts are left-padded to a length bucket (a power of two), so every sequence's next token is written at
the same cache slot and the shapes depend only on (batch, bucket, max_new_tokens): no compilation per token
or per prompt length within a bucket. Padding slots are masked as keys, so a prompt's output does not depend
on the others in its batch. The decode step's state (cache included) is donated: updated in place.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from k2jax.inference.cache import batch_shards, cache_sharding, pad_to_cache
from k2jax.nn.model import K2Model
from k2jax.sharding import use_mesh

MIN_BUCKET = 16
PAD_ID = 0  # written after a sequence's end; `lengths` says where each sequence ends


def bucket_length(n: int) -> int:
    """Prompt length bucket: the next power of two, at least MIN_BUCKET."""
    return max(MIN_BUCKET, 1 << (n - 1).bit_length())


def sample(logits_BV, key, temperature=0.0, top_k=0, top_p=1.0):
    """Next token ids [B] int32 from float32 logits [B, V]: argmax when temperature == 0, else a draw from
    softmax(logits / temperature) restricted to the top_k ids (0 = all) and, among those, to the smallest set
    holding top_p of the mass (1 = all). The settings may be traced values: changing them recompiles nothing."""
    draw = lambda: jax.random.categorical(key, filter_logits(logits_BV, temperature, top_k, top_p), axis=-1)  # noqa: E731
    greedy = lambda: jnp.argmax(logits_BV, axis=-1)  # noqa: E731
    return jax.lax.cond(temperature == 0, greedy, draw).astype(jnp.int32)


def filter_logits(logits_BV, temperature, top_k=0, top_p=1.0):
    """float32 logits [B, V] / temperature, with -inf for the ids that top_k (0 = none cut) and top_p (1 = none
    cut) exclude: what `sample` draws from."""
    x_BV = logits_BV.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)
    V = x_BV.shape[-1]
    sorted_BV = -jnp.sort(-x_BV, axis=-1)
    in_top_k_V = jnp.arange(V) < jnp.where(top_k > 0, top_k, V)
    probs_BV = jax.nn.softmax(jnp.where(in_top_k_V, sorted_BV, -jnp.inf), axis=-1)
    # Keep a token while the mass before it is below top_p (the most likely one always stays). top_p = 1
    # keeps all explicitly: in float32 the running mass reaches 1.0 before the tail does and would cut it.
    keep_BV = in_top_k_V & ((jnp.cumsum(probs_BV, axis=-1) - probs_BV < top_p) | (top_p >= 1.0))
    cutoff_B1 = jnp.min(jnp.where(keep_BV, sorted_BV, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(x_BV < cutoff_B1, -jnp.inf, x_BV)


def _steps(model: K2Model, max_len: int, max_new_tokens: int, mesh):
    """The prefill and decode-step functions (not yet jitted) for one static set-up.

    `opts` = {"temperature", "top_k", "top_p", "stop" [n] (-1 = none)}: runtime values, carried in the state.
    """

    def pick(logits_BV, key, step, opts):
        return sample(logits_BV, jax.random.fold_in(key, step), opts["temperature"], opts["top_k"], opts["top_p"])

    def prefill(params, tokens_BT, start_B, seed, opts):
        B, T = tokens_BT.shape
        key = jax.random.PRNGKey(seed)
        positions_BT = jnp.maximum(jnp.arange(T)[None, :] - start_B[:, None], 0)
        kv_valid_BT = jnp.arange(T)[None, :] >= start_B[:, None]
        logits_BV, entries = model.apply({"params": params}, tokens_BT, positions_BT, kv_valid_BT,
                                         method=K2Model.prefill)
        cache = pad_to_cache(entries, max_len)
        if mesh is not None:
            cache = jax.lax.with_sharding_constraint(cache, cache_sharding(mesh))
        token_B = pick(logits_BV, key, 0, opts)
        return dict(cache=cache, token=token_B, pos=T - start_B, start=start_B, slot=jnp.int32(T),
                    step=jnp.int32(1), done=jnp.isin(token_B, opts["stop"]), length=jnp.ones(B, jnp.int32),
                    key=key, opts=opts,
                    out=jnp.full((B, max_new_tokens), PAD_ID, jnp.int32).at[:, 0].set(token_B))

    def decode(params, st):
        kv_valid_BS = jnp.arange(max_len)[None, :] >= st["start"][:, None]
        logits_B1V, cache = model.apply({"params": params}, st["token"][:, None], st["pos"][:, None],
                                        kv_valid_BS, st["cache"], st["slot"], method=K2Model.decode)
        token_B = jnp.where(st["done"], PAD_ID, pick(logits_B1V[:, 0], st["key"], st["step"], st["opts"]))
        return dict(st, cache=cache, token=token_B, pos=st["pos"] + 1, slot=st["slot"] + 1, step=st["step"] + 1,
                    out=jax.lax.dynamic_update_slice_in_dim(st["out"], token_B[:, None], st["step"], axis=1),
                    length=st["length"] + (~st["done"]).astype(jnp.int32),
                    done=st["done"] | jnp.isin(token_B, st["opts"]["stop"]))

    return prefill, decode


_COMPILED: dict = {}  # static set-up and argument layout -> compiled executable


def _compiled(kind: str, fn, static_key, args, donate=(), out_shardings=None):
    """Compile `fn` for these arguments once; later calls with the same layout reuse the executable."""
    layout = tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in jax.tree.leaves(args))
    key = (kind, static_key, jax.tree.structure(args), layout)
    if key not in _COMPILED:
        jitted = jax.jit(fn, donate_argnums=donate, out_shardings=out_shardings)
        _COMPILED[key] = jitted.lower(*args).compile()
    return _COMPILED[key]


def generate(model: K2Model, params, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None, seed: int = 0,
             stop_tokens: Sequence[int] = (), mesh: jax.sharding.Mesh | None = None, max_len: int | None = None,
             on_token: Callable[[np.ndarray, np.ndarray], None] | None = None, timings: dict | None = None):
    """Continue each prompt (a list of token ids; lengths may differ) by up to max_new_tokens tokens.

    Greedy when temperature == 0 (deterministic); otherwise sampling, reproducible from `seed`. A sequence
    stops after emitting one of `stop_tokens` (kept in its output) or after max_new_tokens. `max_len` is the
    cache length in tokens (default: the prompt bucket + max_new_tokens). With `mesh`, the batch (cache
    included) is split over its 'data' (and 'fsdp') axes and the model runs under k2jax.sharding.use_mesh;
    params already on the mesh keep their shardings (see k2jax.sharding.param_shardings), others are
    replicated. Without a mesh, params in the split experts layout (k2jax.split_experts) run faster on
    XLA:CPU: `k2jax generate` loads them so. `on_token(tokens [B], active [B])` is called as each token is
    produced (streaming); `timings`, if a dict, receives compile_s, prefill_s, decode_s and decode_steps. Under jax.distributed
    (a mesh over several processes' devices) every process calls it with the same arguments and gets the
    whole result.

    Returns (tokens int32 [B, max_new_tokens], padded with PAD_ID after each end; lengths int32 [B]), numpy.
    Raises ValueError for an empty batch or prompt, an id outside the vocabulary, a prompt that does not fit
    the cache, or a bad sampling setting.
    """
    cfg = model.cfg
    stop_tokens = tuple(stop_tokens)
    _check(cfg, prompts, max_new_tokens, temperature, top_k, top_p, max_len, stop_tokens)
    longest = max(len(p) for p in prompts)
    if max_len is None:
        T = bucket_length(longest)
        max_len = T + max_new_tokens
    else:
        if longest + max_new_tokens - 1 > max_len:
            raise ValueError(f"prompt of {longest} tokens + {max_new_tokens} new tokens does not fit the cache "
                             f"of max_len={max_len} tokens")
        T = min(bucket_length(longest), max_len - max_new_tokens + 1)

    B = len(prompts)
    if mesh is not None:
        shards = batch_shards(mesh)
        B = -(-B // shards) * shards  # filler rows (one token each) make the batch divisible
    tokens_BT = np.zeros((B, T), np.int32)
    start_B = np.full(B, T - 1, np.int32)
    for b, p in enumerate(prompts):
        tokens_BT[b, T - len(p):] = p
        start_B[b] = T - len(p)
    n_stop = -(-max(len(stop_tokens), 1) // 8) * 8  # a multiple of 8 stop slots: few distinct shapes
    opts = {"temperature": np.float32(temperature), "top_k": np.int32(top_k or 0),
            "top_p": np.float32(1.0 if top_p is None else top_p),
            "stop": np.pad(np.asarray(stop_tokens, np.int32), (0, n_stop - len(stop_tokens)), constant_values=-1)}
    args = (tokens_BT, start_B, np.uint32(seed % 2**32), opts)
    if mesh is not None:
        params = jax.tree.map(lambda x: _on_mesh(x, mesh), params)
        batch = NamedSharding(mesh, PartitionSpec(cache_sharding(mesh).spec[1]))
        rep = NamedSharding(mesh, PartitionSpec())
        args = jax.device_put(args, (batch, batch, rep, rep))

    static = (model, max_len, max_new_tokens, mesh)
    prefill_fn, decode_fn = _steps(*static)
    n = len(prompts)
    with use_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        t0 = time.perf_counter()
        prefill = _compiled("prefill", prefill_fn, static, (params, *args))
        t1 = time.perf_counter()
        state = jax.block_until_ready(prefill(params, *args))
        t2 = time.perf_counter()
        # The step's state comes back laid out as it went in: one executable serves every step.
        decode = _compiled("decode", decode_fn, static, (params, state), donate=(1,),
                           out_shardings=jax.tree.map(lambda x: x.sharding, state))
        t3 = time.perf_counter()
    if on_token is not None:
        on_token(_host(state["token"])[:n], np.ones(n, bool))
    steps = 0
    for step in range(1, max_new_tokens):
        if on_token is not None or (stop_tokens and step % 8 == 0):
            active = ~_host(state["done"])[:n]
            if not active.any():
                break
        state = decode(params, state)
        steps += 1
        if on_token is not None:
            on_token(_host(state["token"])[:n], active)
    out, lengths = _host(state["out"])[:n], _host(state["length"])[:n]
    if timings is not None:
        timings.update(compile_s=(t1 - t0) + (t3 - t2), prefill_s=t2 - t1, decode_s=time.perf_counter() - t3,
                       decode_steps=steps)
    return out, lengths


def _host(x) -> np.ndarray:
    """The whole of `x` as numpy on every process: under jax.distributed a batch split over processes is
    gathered (all processes call this at the same points, so they also stop at the same step)."""
    if x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _on_mesh(x, mesh):
    if isinstance(getattr(x, "sharding", None), NamedSharding) and x.sharding.mesh == mesh:
        return x
    return jax.device_put(x, NamedSharding(mesh, PartitionSpec()))


def _check(cfg, prompts, max_new_tokens, temperature, top_k, top_p, max_len, stop_tokens):
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if len(prompts) == 0:
        raise ValueError("prompts is empty: give at least one prompt (a list of token ids)")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        ids = np.asarray(p)
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"prompt {i} holds {ids.dtype} values, expected integer token ids")
        bad = ids[(ids < 0) | (ids >= cfg.vocab_size)]
        if bad.size:
            raise ValueError(f"prompt {i}: token id {int(bad[0])} is outside the vocabulary [0, {cfg.vocab_size})")
    if max_len is not None and max(len(p) for p in prompts) > max_len:
        raise ValueError(f"prompt of {max(len(p) for p in prompts)} tokens is longer than the cache "
                         f"(max_len={max_len})")
    if any(not isinstance(t, (int, np.integer)) or not 0 <= t < cfg.vocab_size for t in stop_tokens):
        raise ValueError(f"stop_tokens must be token ids in [0, {cfg.vocab_size}), got {list(stop_tokens)}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and not 1 <= top_k <= cfg.vocab_size:
        raise ValueError(f"top_k must be in 1..vocab_size ({cfg.vocab_size}), got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
