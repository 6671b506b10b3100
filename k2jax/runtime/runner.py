"""The one inference runtime's step: a batch of rows through the model over the paged cache, and each row's
next token sampled. `k2jax.generate` and `k2jax serve` run the same step on the same cache.

A step takes a k2jax.runtime.layout.StepInput, per row b: its slot (the row of the per-slot sampling state),
its next tokens (a prefix of count[b] real ones, right-padded to T), its page table and how many tokens it
already holds (lengths[b]), how long its prompt is (tokens before that are prompt, the rest the row's own
output: the penalties count them), whether its slot starts afresh (reset: a new request), and how many tokens
it has generated (its draw's key; the slot's other sampling settings, k2jax.runtime.sampling, stay on the
device from `set_sampling`, sent when a request takes the slot). It returns the token sampled from the logits
at each row's last real token, its logprob and the top logprobs, and, for rows given targets (the next token
of each fed prompt token), those tokens' logprobs under the model's own log-softmax (a prompt's logprobs:
scoring, lm-eval's loglikelihood). What the step computes follows from its shapes: rows B, tokens per row T
(1 = decode, more = a prompt chunk), pages read per row (0 = a first chunk: no cache to read) and table
width. `Runner.compile` builds the program of each shape once (XLA compiles nothing later).

A ragged step (a k2jax.runtime.layout.RaggedShape) takes instead a RaggedInput: one flat batch of every
row's new tokens (k2jax.ops.ragged), row b being slot b: its shape is only the decode tokens, the chunk
blocks and the rows, and one program serves every cache length. On a mesh the flat batch has one segment per
data-parallel shard (RaggedShape.shards, the runner's shard count), split over the chips like the slots,
each shard attending over its own rows and pages. A verifying ragged step (speculative decoding:
RaggedShape.verify) samples at every decode token, each verifying the draft fed after it in its
row, and says how many tokens each row outputs (`_verify`). Any other ragged step runs as two programs: the
model's pass (`send`), then the sampler over every row's logits (`sample`; one program for every ragged
shape), so the host can make grammar masks that wait on the step before's tokens while the pass runs.

Per-slot state beside the pool, split over the mesh like the slots: output counts [slots, V] int32 and a
prompt-token mask [slots, V] bool for the penalties, each slot's sampling settings, and the last token each
slot's row sampled [slots] int32: a ragged step fed FROM_LAST for a row's token takes it from there, so
a decoding row's tokens go from one step to the next on the device.

Rows of a step split over the data-parallel shards when their count is a multiple of the shard count (row b
then belongs to shard b // (B / shards), and its slot and pages must lie in that shard); any other batch
(one lone request) is replicated on every chip.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import math
import os
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from k2jax.runtime import sampling
from k2jax.runtime.cache import empty_pool, lane, pool_shapes, pool_sharding, rows_sharding, token_width
from k2jax.nn.model import HIDDEN, K2Model, copied_expert_bytes, expert_views, head_major_bytes, head_major_kv
from k2jax.ops.logprobs import token_logprobs
from k2jax.ops.paged import PagedCache, batch_axes
from k2jax.ops.ragged import RaggedCache
from k2jax.runtime.layout import FROM_LAST, RaggedInput, RaggedShape, StepInput, StepShape, lay_out
from k2jax.sharding import per_shard, split_axes, use_mesh


def all_allowed(rows: int, vocab_size: int) -> np.ndarray:
    """A grammar mask that allows every id: [rows, ceil(V / 32)] int32, every bit set."""
    return np.full((rows, -(-vocab_size // 32)), -1, np.int32)


def host_batch(shape: StepShape, vocab_size: int) -> StepInput:
    """A step's host inputs for `shape`, all neutral: no real tokens (nothing is written), greedy rows."""
    B = shape.rows
    return StepInput(slot=np.zeros(B, np.int32), tokens=np.zeros((B, shape.tokens), np.int32),
                     count=np.zeros(B, np.int32), table=np.zeros((B, shape.table_pages), np.int32),
                     lengths=np.zeros(B, np.int32), prompt_len=np.zeros(B, np.int32), reset=np.zeros(B, bool),
                     bitmask=all_allowed(B, vocab_size), step=np.zeros(B, np.int32),
                     targets=np.full((B, shape.tokens), -1, np.int32))


def ragged_host_batch(shape: RaggedShape, vocab_size: int) -> RaggedInput:
    """A ragged step's host inputs for `shape`, all neutral (nothing fed, nothing written, greedy rows): the
    layout of no feeds (k2jax.runtime.layout.lay_out: each token belongs to its segment's first row, or in a
    spread region to row 0)."""
    B = shape.rows
    return RaggedInput(**lay_out(shape, {}), targets=np.full(shape.tokens, -1, np.int32),
                       prompt_len=np.zeros(B, np.int32), reset=np.zeros(B, bool),
                       bitmask=all_allowed(B, vocab_size), step=np.zeros(B, np.int32))


def neutral_batch(shape, vocab_size: int) -> StepInput | RaggedInput:
    """host_batch or ragged_host_batch, as the shape's kind says."""
    return (ragged_host_batch if isinstance(shape, RaggedShape) else host_batch)(shape, vocab_size)


class Sent(NamedTuple):
    """A plain ragged step whose model pass is dispatched and whose rows are not sampled yet (Runner.send)."""

    shape: RaggedShape
    batch: RaggedInput  # as the pass took it (on the device, on a mesh)
    logits: jax.Array  # [B, V]
    scores: dict  # the prompt scores (see Runner.step)


for _cls in (StepInput, RaggedInput):  # jit takes them as pytrees of their fields
    jax.tree_util.register_dataclass(_cls, data_fields=list(_cls.fields()), meta_fields=[])


class Runner:
    """The pool of `num_pages` pages of `page_size` tokens ({group: [L, A, Y, R + P]}, kv_dtype as
    k2jax.runtime.cache.KV_DTYPES; None = the params' dtype) and the per-slot state for `slots` slots,
    on `mesh` (slots and pages split over the batch's mesh axes) or one device; `step(shape, batch)` runs
    one step. The params stay the caller's (placed on the mesh already, or on one device; on one CPU device
    the steps also take k2jax.nn.model.expert_views of them: views of the down projections' stacks and
    output-major copies of the gate and up ones; and the ragged steps a head-major copy of kv_b_proj,
    k2jax.nn.model.head_major_kv; `extra_bytes` in all).

    abstract=True: nothing is allocated; the state is jax.ShapeDtypeStructs with their shardings
    (`state_shapes`) and the params may be too, for `lower(shape).compile()` ahead of time, e.g. for a TPU
    topology from a CPU host (k2jax.aot). Such a runner cannot `step`."""

    def __init__(self, model: K2Model, params, *, slots: int, num_pages: int, page_size: int, kv_dtype=None,
                 mesh=None, abstract: bool = False):
        self.model, self.mesh = model, mesh
        self._given = None
        self.set_params(params)
        self.cfg = model.cfg
        self.slots, self.page_size = slots, page_size
        self.kv_dtype = jnp.dtype(model.param_dtype).name if kv_dtype in (None, "auto") else kv_dtype
        self.shard_axes = () if mesh is None else batch_axes(slots, mesh)
        self.shards = 1 if mesh is None else math.prod(mesh.shape[a] for a in self.shard_axes)
        if num_pages % self.shards:
            raise ValueError(f"num_pages {num_pages} must be a multiple of the {self.shards} data-parallel shards")
        self.num_pages = num_pages
        self.pad = token_width(self.cfg, lane(mesh)) - token_width(self.cfg)  # a TPU pool's (k2jax.ops.paged)
        self._compiled: dict[StepShape, object] = {}
        self._set_samp = None  # set_sampling's program (compiled with the first steps)
        self._sampler = None  # the plain ragged steps' sampler (compiled with the first of them)
        self._masks: dict = {}  # {shape: neutral_mask(shape)}
        self._batch_sh: dict = {}  # {shape: _shardings(shape)}
        if abstract:
            self.state = state_shapes(self.cfg, slots, num_pages, page_size, self.kv_dtype, mesh)
            return
        with self._context():
            pages, scales = empty_pool(self.cfg, num_pages, page_size, self.kv_dtype, mesh, slots)
            sh = rows_sharding(mesh, slots)
            V = self.cfg.vocab_size
            self.state = {"pages": pages, "scales": scales,
                          "counts": jnp.zeros((slots, V), jnp.int32, device=sh),
                          "seen": jnp.zeros((slots, V), bool, device=sh),
                          "last": jnp.zeros(slots, jnp.int32, device=sh),
                          "samp": {k: jnp.asarray(v, device=sh) for k, v in sampling.slot_settings(slots).items()}}

    def _context(self):
        return contextlib.nullcontext() if self.mesh is None else use_mesh(self.mesh)

    # --- the step function (traced once per shape) ----------------------------------------------------
    def _step(self, params, state, batch, read_pages: int):
        B, T = batch.tokens.shape
        count_B = batch.count
        cache = PagedCache(state["pages"], state["scales"], batch.table, batch.lengths,
                           self.cfg.qk_rope_head_dim, self.shard_axes, read_pages, self.pad)
        valid_BT = jnp.arange(T)[None, :] < count_B[:, None]
        (logits_BV, cache), sown = self.model.apply({"params": params}, batch.tokens, None, valid_BT, cache,
                                                    jnp.maximum(count_B - 1, 0), mutable=[HIDDEN])
        scores = self._prompt_scores(params, sown[HIDDEN]["final_BTD"][0], batch.targets)
        counts_BV, seen_BV = self._rows(state, batch.slot, batch.reset)
        pos_BT = batch.lengths[:, None] + jnp.arange(T)[None, :]
        in_prompt_BT = valid_BT & (pos_BT < batch.prompt_len[:, None])
        seen_BV = sampling.mark_prompt(seen_BV, batch.tokens, in_prompt_BT)
        counts_BV = _add_counts(counts_BV, batch.tokens, valid_BT & ~in_prompt_BT)
        out = sampling.sample_rows(logits_BV, self._settings(state, batch.slot) | {"step": batch.step}, counts_BV,
                                   seen_BV, batch.bitmask)
        write_B = (count_B > 0) | batch.reset
        counts, seen = self._write_rows(state, batch.slot, write_B, counts_BV, seen_BV)
        return {"pages": cache.pages, "scales": cache.scales, "counts": counts, "seen": seen,
                "last": state["last"], "samp": state["samp"]}, out | scores

    def _ragged(self, params, state, batch, shape: RaggedShape):
        """One ragged step (k2jax.ops.ragged): row b is slot b; the same outputs as _step, per row, and the
        prompt scores per flat token [T]. The plain form of the runtime's two programs: the model's pass
        (`_pass`), then the sampler (`_sample`); a verifying step is one program."""
        state, logits_XV, scores, batch = self._pass(params, state, batch, shape)
        if shape.verify:  # (no step after it is fed FROM_LAST: the engine's overlap stops while it drafts)
            samp = state["samp"] | {"step": batch.step}
            return state, _verify(logits_XV, batch, samp, state["counts"], state["seen"]) | scores
        last_B, out = _sample(state, logits_XV, batch.count, batch.step, batch.bitmask)
        return state | {"last": last_B}, out | scores

    def _pass(self, params, state, batch, shape: RaggedShape):
        """A ragged step's model pass: the pool written, the penalties' counts and prompt mask updated ->
        (state, logits at each row's last fed token [B, V] (a verifying step: at every decode token [D, V]),
        the prompt scores per flat token, the batch with its FROM_LAST tokens taken from the device). The model
        takes the flat batch as its S segments [S, T / S]."""
        row_T, valid_T = batch.row, batch.valid
        # A fed token of -1 (FROM_LAST) is its row's last sampled token, still on the device: the host planned
        # this step before it read the step before's tokens (the engine's overlap).
        tok_T = jnp.where(batch.tokens == FROM_LAST, state["last"][row_T], batch.tokens)
        batch = dataclasses.replace(batch, tokens=tok_T)
        S, Ts, B = shape.shards, shape.segment, shape.rows
        cache = RaggedCache(state["pages"], state["scales"], batch.table, batch.lengths, row_T, batch.pos,
                            valid_T, self.cfg.qk_rope_head_dim, shape.decode, shape.block, self.pad, S,
                            self.shard_axes, shape.spread_tokens)
        # A verifying step samples at every decode token (each verifies the draft after it), others at each
        # row's last fed token (its index within its row's segment).
        if shape.verify:  # every token: the flat batch is the segments' decode regions, in order
            at = jnp.broadcast_to(jnp.arange(shape.decode), (S, shape.decode))
        else:
            at = (batch.last - jnp.arange(B) // (B // S) * Ts).reshape(S, B // S)
        (logits_SXV, cache), sown = self.model.apply({"params": params}, tok_T.reshape(S, Ts), None,
                                                     valid_T.reshape(S, Ts), cache, at, mutable=[HIDDEN])
        logits_XV = logits_SXV.reshape(-1, logits_SXV.shape[-1])
        scores = self._prompt_scores(params, sown[HIDDEN]["final_BTD"][0], batch.targets.reshape(S, Ts))
        scores = {k: v.reshape((S * Ts,) + v.shape[2:]) for k, v in scores.items()}
        keep_B1 = ~batch.reset[:, None]
        counts_BV, seen_BV = state["counts"] * keep_B1, state["seen"] & keep_B1
        in_prompt_T = valid_T & (batch.pos < batch.prompt_len[row_T])
        seen_BV = seen_BV.at[row_T, tok_T].max(in_prompt_T)
        counts_BV = counts_BV.at[row_T, tok_T].add((valid_T & ~in_prompt_T).astype(counts_BV.dtype))
        state = dict(state, pages=cache.pages, scales=cache.scales, counts=counts_BV, seen=seen_BV)
        return state, logits_XV, scores, batch

    def _prompt_scores(self, params, h_BTD, targets_BT) -> dict:
        """The prompt_* outputs (see `step`): computed only when some row has a target."""
        head_DV = params["embed_tokens"].T if self.cfg.tie_word_embeddings else params["lm_head"]
        J = sampling.MAX_TOP_LOGPROBS

        def score():
            return token_logprobs(h_BTD, head_DV, targets_BT, J)

        def skip():
            B, T = targets_BT.shape
            return {"logprob": jnp.zeros((B, T), jnp.float32), "rank": jnp.zeros((B, T), jnp.int32),
                    "top_ids": jnp.zeros((B, T, J), jnp.int32), "top_logprobs": jnp.zeros((B, T, J), jnp.float32)}

        out = jax.lax.cond(jnp.any(targets_BT >= 0), score, skip)
        return {"prompt_" + k: v for k, v in out.items()}

    def _slot_split(self, rows: int) -> tuple[tuple[str, ...], int]:
        """(the mesh axes a step of `rows` rows splits over, the slots each of their shards holds)."""
        axes = split_axes(self.shard_axes, rows)
        return axes, self.slots // (math.prod(jax.sharding.get_abstract_mesh().shape[a] for a in axes) if axes else 1)

    def _rows(self, state, slot_B, reset_B):
        """The per-slot state of the step's rows ([B, V] each), zero where reset."""
        axes, per = self._slot_split(slot_B.shape[0])

        def local(shard, slot_B, reset_B, counts, seen):
            i_B = slot_B - shard * per
            keep_B1 = ~reset_B[:, None]
            return counts[i_B] * keep_B1, seen[i_B] & keep_B1

        return per_shard(local, (slot_B, reset_B, state["counts"], state["seen"]), (0, 0, 0, 0), (0, 0), axes)

    def _settings(self, state, slot_B) -> dict:
        """The sampling settings of the step's rows, read from their slots' (set_sampling's), step apart."""
        axes, per = self._slot_split(slot_B.shape[0])
        names = sorted(state["samp"])

        def local(shard, slot_B, *fields):
            return tuple(f[slot_B - shard * per] for f in fields)

        got = per_shard(local, (slot_B, *(state["samp"][k] for k in names)), (0,) * (1 + len(names)),
                        (0,) * len(names), axes)
        return dict(zip(names, got))

    def _write_rows(self, state, slot_B, write_B, counts_BV, seen_BV):
        axes, per = self._slot_split(slot_B.shape[0])

        def local(shard, slot_B, write_B, counts_BV, seen_BV, counts, seen):
            i_B = jnp.where(write_B, slot_B - shard * per, counts.shape[0])  # rows not written: dropped
            return counts.at[i_B].set(counts_BV, mode="drop"), seen.at[i_B].set(seen_BV, mode="drop")

        return per_shard(local, (slot_B, write_B, counts_BV, seen_BV, state["counts"], state["seen"]),
                         (0, 0, 0, 0, 0, 0), (0, 0), axes)

    # --- compiling and running ------------------------------------------------------------------------
    def _shardings(self, shape: StepShape | RaggedShape):
        """The batch's input shardings: per-row arrays split like the rows (or replicated); a ragged step's
        flat arrays split by segment like its rows."""
        if self.mesh is None:
            return None
        if shape not in self._batch_sh:  # made once per shape: `step` asks on every call
            self._batch_sh[shape] = self._make_shardings(shape)
        return self._batch_sh[shape]

    def _make_shardings(self, shape: StepShape | RaggedShape):
        if isinstance(shape, RaggedShape):
            if shape.shards != self.shards:
                raise ValueError(f"a ragged step of {shape.shards} segments on a mesh of {self.shards} "
                                 f"data-parallel shards")
            split = shape.shards > 1
        else:
            split = shape.rows % self.shards == 0
        row = NamedSharding(self.mesh, PartitionSpec((self.shard_axes if split else ()) or None))
        return jax.tree.map(lambda _: row, neutral_batch(shape, self.cfg.vocab_size))

    def batch_shapes(self, shape: StepShape):
        """The step's inputs for `shape` (host_batch's tree) as jax.ShapeDtypeStructs, with the shardings the
        step takes them in on a mesh."""
        batch = neutral_batch(shape, self.cfg.vocab_size)
        sh = self._shardings(shape)
        if sh is None:
            return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), batch, sh)

    def lower(self, shape: StepShape, params=None, state=None, whole: bool = False):
        """The program the runtime runs for `shape`, lowered (not compiled) on abstract or concrete arguments.
        A plain (not verifying) ragged step runs as two programs: this one, the model's pass -> (state, logits
        [B, V], prompt scores), then the sampler (`_lower_sampler`), so the sampler can take grammar masks the
        host makes while the pass runs (`send`, `sample`). whole=True: any step as one program, sampling
        included (`_ragged`: the same computation; the TPU compile's figures are a whole step's)."""
        params = self._params_for(shape) if params is None else params
        state = self.state if state is None else state
        batch = self.batch_shapes(shape)
        # On a mesh the state comes back placed as it went in (else the compiler may choose another
        # placement, which the next step's executable would not accept) and the sampled outputs replicated.
        placed = None if self.mesh is None else jax.tree.map(lambda x: x.sharding, state)
        replicated = None if self.mesh is None else NamedSharding(self.mesh, PartitionSpec())
        out = {} if self.mesh is None else {"out_shardings": (placed, replicated)}
        if isinstance(shape, RaggedShape):
            if shape.rows != self.slots:
                raise ValueError(f"a ragged step's rows are the {self.slots} slots, not {shape.rows}")
            if whole or shape.verify:
                fn = jax.jit(lambda p, s, b: self._ragged(p, s, b, shape), donate_argnums=(1,), **out)
            else:
                if self.mesh is not None:  # the logits split like the rows, as the sampler takes them
                    out = {"out_shardings": (placed, self._logits_sharding(shape), replicated)}
                fn = jax.jit(lambda p, s, b: self._pass(p, s, b, shape)[:3], donate_argnums=(1,), **out)
        else:
            fn = jax.jit(lambda p, s, b: self._step(p, s, b, shape.read_pages), donate_argnums=(1,), **out)
        with self._context():
            return fn.lower(params, state, batch)

    def _logits_sharding(self, shape: RaggedShape):
        """A plain ragged step's logits [B, V]: rows split like the step's per-row inputs, the vocabulary whole."""
        return NamedSharding(self.mesh, PartitionSpec(self._shardings(shape).count.spec[0], None))

    def _lower_sampler(self, shape: RaggedShape, logits):
        """The sampler of plain ragged steps (`_sample`), lowered for `shape`'s rows and `logits` (the pass's
        jax.ShapeDtypeStruct): one program serves every ragged shape (their rows are the slots). It reads the
        penalty state and settings and gives each slot's last token back (donated)."""
        def struct(x, sharding):  # one device: no sharding given
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding if self.mesh is not None else None)

        keep = {k: jax.tree.map(lambda x: struct(x, x.sharding), self.state[k]) for k in ("counts", "seen", "samp")}
        last = struct(self.state["last"], self.state["last"].sharding)
        b = self.batch_shapes(shape)
        logits = struct(logits, self._logits_sharding(shape) if self.mesh is not None else None)
        out = {} if self.mesh is None else {"out_shardings": (last.sharding,
                                                              NamedSharding(self.mesh, PartitionSpec()))}
        fn = jax.jit(lambda k, l, x, c, s, m: _sample(k | {"last": l}, x, c, s, m), donate_argnums=(1,), **out)
        with self._context():
            return fn.lower(keep, last, logits, b.count, b.step, b.bitmask)

    def compile(self, shapes, on_progress=None, threads: int | None = None, on_start=None) -> float:
        """Compile the step of each shape (each once); -> seconds. on_progress(done, total, shape) after each;
        on_start(shape) as each begins compiling (on a compiling thread). Programs are traced here and compiled
        on `threads` threads at once (default: the CPU count, at most 4): XLA compiles one program on one core."""
        t0 = time.perf_counter()
        todo = [s for s in dict.fromkeys(shapes) if s not in self._compiled]
        if not isinstance(self.state["counts"], jax.ShapeDtypeStruct):  # abstract: nothing runs
            self._set_program()
        if not todo:
            return time.perf_counter() - t0
        threads = threads or min(4, os.cpu_count() or 1)
        lowered = {}
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            futures = {}
            for shape in todo:  # tracing is quick, and not thread-safe with the mesh context: here
                lowered[shape] = self.lower(shape)
                futures[pool.submit(_compile, lowered[shape], shape, on_start)] = shape
                if self._sampler is None and isinstance(shape, RaggedShape) and not shape.verify:
                    self._sampler = pool.submit(lambda x: x.compile(),
                                                self._lower_sampler(shape, lowered[shape].out_info[1]))
            for i, f in enumerate(concurrent.futures.as_completed(futures), 1):
                self._compiled[futures[f]] = f.result()
                if on_progress is not None:
                    on_progress(i, len(todo), futures[f])
            if isinstance(self._sampler, concurrent.futures.Future):
                self._sampler = self._sampler.result()
        return time.perf_counter() - t0

    def set_params(self, params) -> None:
        """The params the steps take from now on (the same tree structure as before). On one CPU device the
        steps read the routed experts through per-layer arrays, made here once per params object: views of
        down_proj and output-major copies of gate and up (k2jax.nn.model.expert_views); and the ragged steps
        take kv_b_proj head-major (k2jax.nn.model.head_major_kv): `extra_bytes` of copies in all."""
        if params is self._given:
            return
        self._given = params
        if self.mesh is not None:
            self.params = self._ragged_params = params
            self.extra_bytes = 0
            return
        self.params = expert_views(params, output_major=True)
        self._ragged_params = head_major_kv(self.params, self.model.cfg.qk_nope_head_dim)
        self.extra_bytes = copied_expert_bytes(self.params) + head_major_bytes(self._ragged_params)

    def _params_for(self, shape):
        return self._ragged_params if isinstance(shape, RaggedShape) else self.params

    def step(self, shape: StepShape | RaggedShape, batch: StepInput | RaggedInput) -> dict:
        """Run one step of `shape` on host inputs (a StepInput, see host_batch; a RaggedInput for a RaggedShape,
        whose prompt scores are per flat token [T]) -> device outputs {"tokens" [B], "logprob"
        [B], "top_ids", "top_logprobs" [B, sampling.MAX_TOP_LOGPROBS]} and the scores of the batch's
        `targets` [B, T] (the token each fed token predicts: a prompt's next one; -1 = none): "prompt_logprob"
        [B, T], "prompt_rank" [B, T], "prompt_top_ids", "prompt_top_logprobs" [B, T, MAX_TOP_LOGPROBS], from
        the model's own log-softmax (no sampling settings), zeros where there is no target
        (k2jax.ops.logprobs.token_logprobs); dispatched asynchronously."""
        if isinstance(shape, RaggedShape) and not shape.verify:
            return self.sample(self.send(shape, batch))
        self.state, out = self._run(shape, self._placed(shape, batch))
        return out

    def send(self, shape: RaggedShape, batch: RaggedInput) -> "Sent":
        """Dispatch a plain ragged step's model pass (the pool written); `sample(sent)` then samples its rows.
        Between the two the host may fill grammar masks the batch did not have yet: `step` is sample(send)."""
        batch = self._placed(shape, batch)
        self.state, logits, scores = self._run(shape, batch)
        return Sent(shape, batch, logits, scores)

    def _placed(self, shape, batch):
        """The batch as the program of `shape` takes it: on a mesh, put on it."""
        sh = self._shardings(shape)
        return batch if sh is None else jax.device_put(batch, sh)

    def _run(self, shape, batch):
        """The program of `shape` (compiled now if it was not) on the params, the state and the placed batch."""
        if shape not in self._compiled:
            self.compile([shape])
        return self._compiled[shape](self._params_for(shape), self.state, batch)

    def sample(self, sent: "Sent", bitmask=None) -> dict:
        """Sample the rows of a sent pass -> `step`'s outputs. bitmask [B, V / 32] int32 (host or device):
        the grammar masks, if not the batch's own."""
        mask = sent.batch.bitmask
        if bitmask is not None:
            sh = self._shardings(sent.shape)
            mask = jax.device_put(bitmask, sh.bitmask) if sh is not None else bitmask
        keep = {k: self.state[k] for k in ("counts", "seen", "samp")}
        last, out = self._sampler(keep, self.state["last"], sent.logits, sent.batch.count, sent.batch.step, mask)
        self.state = dict(self.state, last=last)
        return out | sent.scores


    def neutral_mask(self, shape):
        """An all-allowed grammar mask for `shape`'s rows ([B, V / 32] int32, -1), made once on the device (placed
        as the step takes it): a step with no grammar row passes it, so its [B, V / 32] words are not sent."""
        if shape not in self._masks:
            mask = neutral_batch(shape, self.cfg.vocab_size).bitmask
            sh = self._shardings(shape)
            self._masks[shape] = jax.device_put(mask, sh.bitmask if sh is not None else None)
        return self._masks[shape]

    def set_sampling(self, settings: dict[int, dict]) -> None:
        """Write slots' sampling settings into the per-slot state on the device: {slot: set_row's keyword
        arguments (step apart)}. The steps read each row's settings from its slot, so a slot's are sent once,
        when a request takes it, not with every step."""
        if not settings:
            return
        rows, idx = sampling.default_rows(self.slots), np.full(self.slots, self.slots, np.int32)  # slots: dropped
        for i, (slot, kw) in enumerate(sorted(settings.items())):
            if not 0 <= slot < self.slots:
                raise ValueError(f"slot must be in [0, {self.slots}), got {slot}")
            sampling.set_row(rows, i, **kw)
            idx[i] = slot
        del rows["step"]
        self.state = dict(self.state, samp=self._set_program()(self.state["samp"], idx, rows))

    def _set_program(self):
        """set_sampling's program, compiled once: rows [slots, ...] scattered to the slots `idx` [slots]
        (= slots: dropped)."""
        if self._set_samp is None:
            self._set_samp = self._lower_set_sampling().compile()
        return self._set_samp

    def _lower_set_sampling(self):
        def put(samp, idx, rows):
            return {k: v.at[idx].set(rows[k], mode="drop") for k, v in samp.items()}

        out = {} if self.mesh is None else {"out_shardings": jax.tree.map(lambda x: x.sharding, self.state["samp"])}
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), sampling.slot_settings(self.slots))
        with self._context():
            return jax.jit(put, donate_argnums=(0,), **out).lower(
                self.state["samp"], jax.ShapeDtypeStruct((self.slots,), jnp.int32), shapes)


def _sample(state, logits_BV, count_B, step_B, bitmask_BW):
    """A ragged step's sampler: each row's token from its logits [B, V] with its slot's settings and penalty
    state (row b is slot b) and its grammar mask [B, V / 32] -> (each slot's last token [B]: the sampled one
    where the row was fed, else as it was; sampling.sample_rows' outputs)."""
    out = sampling.sample_rows(logits_BV, state["samp"] | {"step": step_B}, state["counts"], state["seen"],
                               bitmask_BW)
    return jnp.where(count_B > 0, out["tokens"], state["last"]), out


def _verify(logits_DV, batch, samp: dict, counts_BV, seen_BV) -> dict:
    """A verifying step's samples (speculative decoding): each decode token t of row b samples the token after
    it, with b's settings at its own output index, and verifies the draft fed after it in the row (if any;
    sampling.sample_rows' draft_B); D: every segment's decode tokens, in flat order (a row's tokens never
    cross a segment's end). -> sample_rows' outputs per decode token [D, ...] with `accepted` [D],
    and `emitted` [B]: how many tokens each row outputs (its accepted drafts, then the first token sampled
    where a draft was not accepted, or after the last draft). Each token takes its row's penalty state
    (counts_BV, seen_BV, with this step's tokens) and grammar mask: right for a row fed no draft, as in a
    plain step; a row with drafts has neither penalties nor a grammar (the engine drafts for no such row:
    each draft would need the state after the one before)."""
    D = logits_DV.shape[0]
    row_D, pos_D, valid_D, tok_D = (x[:D] for x in (batch.row, batch.pos, batch.valid, batch.tokens))
    lengths_B = batch.lengths
    samp_D = {k: v[row_D] for k, v in samp.items()}
    samp_D["step"] = samp_D["step"] + pos_D - lengths_B[row_D]
    nxt = jnp.arange(1, D + 1).clip(max=D - 1)
    follows_D = (jnp.arange(D) < D - 1) & valid_D[nxt] & (row_D[nxt] == row_D)
    out = sampling.sample_rows(logits_DV, samp_D, counts_BV[row_D], seen_BV[row_D], batch.bitmask[row_D],
                               draft_B=jnp.where(valid_D & follows_D, tok_D[nxt], -1))
    # A row's output ends at its first token that did not accept the draft after it (its last token has none).
    big = jnp.iinfo(jnp.int32).max
    end_B = jnp.full_like(lengths_B, big).at[row_D].min(jnp.where(valid_D & ~out["accepted"], pos_D, big))
    return out | {"emitted": jnp.where(end_B < big, end_B - lengths_B + 1, 0)}


def _compile(lowered, shape: StepShape, on_start):
    if on_start is not None:
        on_start(shape)
    return lowered.compile()


def state_shapes(cfg, slots: int, num_pages: int, page_size: int, kv_dtype, mesh=None) -> dict:
    """A Runner's state as jax.ShapeDtypeStructs placed as the Runner places it (nothing allocated):
    {"pages", "scales": the pool (k2jax.runtime.cache.pool_shapes), "counts" [slots, V] int32, "seen"
    [slots, V] bool, "last" [slots] int32 (each slot's last sampled token), "samp": each slot's sampling
    settings (sampling.slot_settings)}."""
    pages, scales = pool_shapes(cfg, num_pages, page_size, kv_dtype, lane(mesh))
    pool, rows = pool_sharding(mesh, slots), rows_sharding(mesh, slots)

    def placed(s, sharding):
        return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding)

    V = cfg.vocab_size
    return {"pages": jax.tree.map(lambda s: placed(s, pool), pages),
            "scales": jax.tree.map(lambda s: placed(s, pool), scales),
            "counts": jax.ShapeDtypeStruct((slots, V), jnp.int32, sharding=rows),
            "seen": jax.ShapeDtypeStruct((slots, V), jnp.bool_, sharding=rows),
            "last": jax.ShapeDtypeStruct((slots,), jnp.int32, sharding=rows),
            "samp": {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=rows)
                     for k, v in sampling.slot_settings(slots).items()}}



def _add_counts(counts_BV, tokens_BT, add_BT):
    """counts + how often each id occurs among the tokens where add_BT."""
    B, T = tokens_BT.shape
    return counts_BV.at[jnp.arange(B)[:, None], tokens_BT].add(add_BT.astype(counts_BV.dtype))
