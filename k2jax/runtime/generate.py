"""Batched generation: a loop over the runtime's steps (k2jax.runtime.runner), the same jitted steps and
paged cache the server runs.

Each row gets its own contiguous pages for max_len tokens. The steps are ragged (k2jax.ops.ragged): the
prompts are prefilled in one step (each in whole blocks of a flat batch, its size a power of two; on a mesh
one segment per data-parallel shard), then one token per row per step in one program whatever the rows
hold. Each program compiles once per set-up. The
loop stays on the device: the host fetches tokens only to stream them (`on_token`) or, every 8 steps, to
see whether every row has stopped.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from k2jax.runtime import sampling
from k2jax.runtime.cache import DEFAULT_PAGE_SIZE, data_shards
from k2jax.runtime.layout import DEFAULT_BLOCK, Feed, RaggedShape, blocks_for, lay_out
from k2jax.runtime.runner import Runner, ragged_host_batch
from k2jax.nn.model import K2Model
from k2jax.sharding import use_mesh

MIN_BUCKET = 16
PAD_ID = 0  # written after a sequence's end; `lengths` says where each sequence ends
_RUNNERS: dict = {}  # set-up -> Runner (its compiled steps are reused by later calls)


def bucket_length(n: int) -> int:
    """Prompt length bucket: the next power of two, at least MIN_BUCKET."""
    return max(MIN_BUCKET, 1 << (n - 1).bit_length())


def generate(model: K2Model, params, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None, seed: int = 0,
             stop_tokens: Sequence[int] = (), mesh: jax.sharding.Mesh | None = None, max_len: int | None = None,
             kv_cache_dtype: str | None = None, page_size: int = DEFAULT_PAGE_SIZE,
             on_token: Callable[[np.ndarray, np.ndarray], None] | None = None, timings: dict | None = None,
             prompt_logprobs: int | None = None, speculative: str | None = None, num_speculative_tokens: int = 4):
    """Continue each prompt (a list of token ids; lengths may differ) by up to max_new_tokens tokens.

    Greedy when temperature == 0 (deterministic); otherwise sampling, reproducible from `seed` (row b draws
    with seed + b). A sequence stops after emitting one of `stop_tokens` (kept in its output) or after
    max_new_tokens. `max_len`: tokens of cache per row (default: the prompt bucket + max_new_tokens).
    kv_cache_dtype: "bfloat16", "float32" or "float8" (default: the params' dtype). With `mesh`, the rows
    and their pages split over the batch's mesh axes where they divide the batch (else replicated) and the
    model runs under k2jax.sharding.use_mesh; params already on the mesh keep their shardings
    (k2jax.param_shardings), others are replicated. `on_token(tokens [B], active [B])` is called as each
    token is produced (streaming); `timings`, if a dict, receives compile_s, prefill_s, decode_s and
    decode_steps. Under jax.distributed every process calls it with the same arguments and gets the result.

    Returns (tokens int32 [B, max_new_tokens], padded with PAD_ID after each end; lengths int32 [B]), numpy.
    With prompt_logprobs k (0..sampling.MAX_TOP_LOGPROBS), also the prompts' own scores as a third element,
    computed in the prefill step from the model's log-softmax (no sampling settings), P the longest prompt:
    {"logprob" float32 [B, P] (prompt token p's logprob given the tokens before it; NaN at p = 0 and past
    a prompt's end), "rank" int32 [B, P] (1 = the likeliest id; 0 where no logprob), "top_ids" int32
    [B, P, k], "top_logprobs" float32 [B, P, k] (the k likeliest ids at each position, best first)}.
    speculative="ngram": each row drafts up to num_speculative_tokens tokens a step by prompt
    lookup and the step verifies them (k2jax.runtime.engine's speculative decoding): the same tokens when
    greedy, the same distribution when sampling. It runs through the serving engine's steps; on_token and
    prompt_logprobs are not taken with it, and `timings` receives steps, total_s, drafted, accepted and
    verified (rows whose drafts a step verified).
    Raises ValueError for an empty batch or prompt, an id outside the vocabulary, a prompt that does not fit
    the cache, or a bad sampling setting.
    """
    cfg = model.cfg
    stop_tokens = tuple(int(t) for t in stop_tokens)
    _check(cfg, prompts, max_new_tokens, temperature, top_k, top_p, max_len, stop_tokens)
    if speculative is not None:
        if on_token is not None or prompt_logprobs is not None:
            raise ValueError("speculative: runs without on_token or prompt_logprobs")
        return _speculative(model, params, prompts, max_new_tokens, temperature, top_k, top_p, seed, stop_tokens,
                            max_len, kv_cache_dtype, page_size, speculative, num_speculative_tokens, timings, mesh)
    if prompt_logprobs is not None and (not isinstance(prompt_logprobs, (int, np.integer))
                                        or not 0 <= prompt_logprobs <= sampling.MAX_TOP_LOGPROBS):
        raise ValueError(f"prompt_logprobs must be an integer in [0, {sampling.MAX_TOP_LOGPROBS}] or None, "
                         f"got {prompt_logprobs!r}")
    B = len(prompts)
    lens = np.array([len(p) for p in prompts], np.int32)
    T = bucket_length(int(lens.max()))
    if max_len is None:
        max_len = T + max_new_tokens
    elif lens.max() + max_new_tokens - 1 > max_len:
        raise ValueError(f"prompt of {lens.max()} tokens + {max_new_tokens} new tokens does not fit the cache "
                         f"of max_len={max_len} tokens")
    W = -(-max(max_len, T) // page_size)
    if mesh is not None:
        params = jax.tree.map(lambda x: _on_mesh(x, mesh), params)
    shards = data_shards(mesh, B)
    per = B // shards
    layout = tuple((x.shape, x.dtype) for x in jax.tree.leaves(params))
    key = (model, B, W, page_size, kv_cache_dtype, mesh, jax.tree.structure(params), layout)
    runner = _RUNNERS.get(key)
    if runner is None:  # each row: its shard's trash page, then W pages of its own
        runner = _RUNNERS[key] = Runner(model, params, slots=B, num_pages=shards * (1 + per * W),
                                        page_size=page_size, kv_dtype=kv_cache_dtype, mesh=mesh)
    runner.set_params(params)
    row = np.arange(B)[:, None]
    table = ((row // per) * (1 + per * W) + 1 + (row % per) * W + np.arange(W)[None, :]).astype(np.int32)

    # One segment of the flat batch per data-parallel shard (k2jax.runtime.layout): each prompt in whole
    # blocks of its shard's segment, the fullest segment's blocks a power of two.
    G = DEFAULT_BLOCK
    blocks = max(sum(blocks_for(int(n), G) for n in lens[s * per:(s + 1) * per]) for s in range(shards))
    prefill = RaggedShape(0, bucket_length(blocks * G) // G, G, B, W, shards=shards)
    batch = ragged_host_batch(prefill, cfg.vocab_size)
    feeds = {b: Feed(tuple(p), 0, tuple(table[b])) for b, p in enumerate(prompts)}
    batch = batch.replace(**lay_out(prefill, feeds))
    starts = batch.last - lens + 1
    if prompt_logprobs is not None:  # each prompt token's successor
        for b, p in enumerate(prompts):
            batch.targets[starts[b]:starts[b] + len(p) - 1] = p[1:]
    batch = batch.replace(prompt_len=lens, reset=np.ones(B, bool))
    settings = {b: dict(temperature=temperature, top_k=top_k or 0, top_p=1.0 if top_p is None else top_p,
                        seed=(seed + b) % 2**32) for b in range(B)}  # row b is slot b
    sampling.set_row(sampling.default_rows(1), 0, **settings[0])  # a bad setting raises before any compile
    stop = np.asarray(stop_tokens or (-1,), np.int32)
    shapes = [prefill, RaggedShape(per, 0, G, B, W, shards=shards)]  # one token per row: the decode regions
    t0 = time.perf_counter()
    runner.compile(shapes)
    runner.set_sampling(settings)
    t1 = time.perf_counter()
    out = runner.step(prefill, batch)
    scores = None if prompt_logprobs is None else _prompt_scores(out, lens, prompt_logprobs, starts)
    tokens = [out["tokens"]]
    done = jnp.isin(out["tokens"], stop)
    if on_token is not None or max_new_tokens == 1:
        jax.block_until_ready(out["tokens"])
    t2 = time.perf_counter()
    if on_token is not None:
        on_token(_host(out["tokens"]), np.ones(B, bool))
    steps, active = 0, np.ones(B, bool)
    # Row b's token is flat token b: segment b // per holds its shard's rows' tokens in order.
    decode = ragged_host_batch(shapes[1], cfg.vocab_size).replace(
        prompt_len=lens, table=table, row=np.arange(B, dtype=np.int32), valid=np.ones(B, bool),
        last=np.arange(B, dtype=np.int32), count=np.ones(B, np.int32))
    for step in range(1, max_new_tokens):
        if on_token is not None or (stop_tokens and step % 8 == 0):
            active = ~_host(done)
            if not active.any():
                break
        decode = decode.replace(lengths=lens + step - 1, step=np.full(B, step, np.int32))
        decode = decode.replace(pos=decode.lengths, tokens=out["tokens"])
        out = runner.step(shapes[1], decode)
        token = jnp.where(done, PAD_ID, out["tokens"])
        tokens.append(token)
        done = done | jnp.isin(token, stop)
        steps += 1
        if on_token is not None:
            on_token(_host(token), active)
    tokens_BN = np.array(_host(jnp.stack(tokens, 1)))  # a writable copy
    lengths = np.full(B, tokens_BN.shape[1], np.int32)
    for b in range(B):
        hit = np.flatnonzero(np.isin(tokens_BN[b], stop_tokens)) if stop_tokens else []
        if len(hit):
            lengths[b] = hit[0] + 1
            tokens_BN[b, hit[0] + 1:] = PAD_ID
    result = np.full((B, max_new_tokens), PAD_ID, np.int32)
    result[:, :tokens_BN.shape[1]] = tokens_BN
    if timings is not None:
        timings.update(compile_s=t1 - t0, prefill_s=t2 - t1, decode_s=time.perf_counter() - t2, decode_steps=steps)
    return (result, lengths) if scores is None else (result, lengths, scores)


def _speculative(model, params, prompts, max_new_tokens, temperature, top_k, top_p, seed, stop_tokens, max_len,
                 kv_cache_dtype, page_size, method, k, timings, mesh=None):
    """generate through the serving engine with speculative decoding (see generate); on `mesh`, its slots
    (the prompts', rounded up to whole data-parallel shards) and pool split over the shards."""
    from k2jax.runtime.engine import Engine, Request, SamplingParams, round_up_slots

    longest = max(len(p) for p in prompts)
    max_len = max_len or longest + max_new_tokens
    B = len(prompts)
    slots = B if mesh is None else round_up_slots(B, mesh)
    if mesh is not None:
        params = jax.tree.map(lambda x: _on_mesh(x, mesh), params)
    eng = Engine(model, params, max_batch=slots, max_len=max_len + 1, prefill_chunk=max_len,
                 kv_tokens=slots * (max_len + 1), kv_cache_dtype=kv_cache_dtype or "auto", page_size=page_size,
                 prefix_cache=False, speculative=method, num_speculative_tokens=k, mesh=mesh)
    events = [[] for _ in prompts]
    eng.submit(*[Request(list(map(int, p)), SamplingParams(
        max_tokens=max_new_tokens, temperature=temperature, top_k=top_k or 0, top_p=1.0 if top_p is None else top_p,
        seed=(seed + b) % 2**32, stop_ids=stop_tokens), events[b].append) for b, p in enumerate(prompts)])
    t0, steps = time.perf_counter(), 0
    with contextlib.nullcontext() if mesh is None else use_mesh(mesh):
        while not all(e and e[-1].finish_reason for e in events):
            eng.step()
            steps += 1
    result = np.full((B, max_new_tokens), PAD_ID, np.int32)
    lengths = np.zeros(B, np.int32)
    for b, ev in enumerate(events):
        ids = [t for e in ev for t in e.token_ids]
        result[b, :len(ids)], lengths[b] = ids, len(ids)
    if timings is not None:
        m = eng.metrics
        timings.update(steps=steps, total_s=time.perf_counter() - t0, drafted=m.spec_drafted,
                       accepted=m.spec_accepted, verified=m.spec_verified)
    return result, lengths


def _prompt_scores(out: dict, lens: np.ndarray, k: int, starts=None) -> dict:
    """The prefill step's prompt_* outputs as generate returns them: shifted so that entry p scores prompt
    token p (position p - 1 predicts it), NaN / 0 where there is none. starts: a ragged step's, each row's
    first flat token (its scores are per flat token), else None ([B, T] scores)."""
    B, P = len(lens), int(lens.max())
    res = {"logprob": np.full((B, P), np.nan, np.float32), "rank": np.zeros((B, P), np.int32),
           "top_ids": np.full((B, P, k), -1, np.int32), "top_logprobs": np.full((B, P, k), np.nan, np.float32)}
    got = {name: _host(out["prompt_" + name]) for name in res}
    if starts is not None:  # rows out of the flat batch, [B, P]
        at_BP = np.minimum(starts[:, None] + np.arange(P)[None, :], len(got["logprob"]) - 1)
        got = {name: v[at_BP] for name, v in got.items()}
    for b, n in enumerate(lens):
        res["logprob"][b, 1:n] = got["logprob"][b, :n - 1]
        res["rank"][b, 1:n] = got["rank"][b, :n - 1]
        res["top_ids"][b, 1:n] = got["top_ids"][b, :n - 1, :k]
        res["top_logprobs"][b, 1:n] = got["top_logprobs"][b, :n - 1, :k]
    return res


def _host(x) -> np.ndarray:
    """The whole of `x` as numpy on every process: under jax.distributed a batch split over processes is
    gathered (all processes call this at the same points, so they also stop at the same step)."""
    if x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _on_mesh(x, mesh):
    from jax.sharding import NamedSharding, PartitionSpec

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
    if any(not 0 <= t < cfg.vocab_size for t in stop_tokens):
        raise ValueError(f"stop_tokens must be token ids in [0, {cfg.vocab_size}), got {list(stop_tokens)}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and not 1 <= top_k <= cfg.vocab_size:
        raise ValueError(f"top_k must be in 1..vocab_size ({cfg.vocab_size}), got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
