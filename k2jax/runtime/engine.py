"""Continuous batching over the paged latent cache: requests join and leave between engine steps.

The engine ties the scheduler (k2jax.runtime.scheduler: which rows run, their pages, the prefix cache,
preemption; plain Python) to the runner (k2jax.runtime.runner: the jitted steps, the same ones
`k2jax.generate` runs). One engine step = the scheduler's calls, dispatched to the device (one ragged call
over every decoding row and the prompt chunks that fit, k2jax.ops.ragged; with rectangular steps, prompt
chunks, then one decode over every decoding row), then each row's sampled token turned into an Event (text
made incrementally by k2jax.runtime.detok, stop ids and strings, max_tokens, logprobs). With overlap (see
Engine) the tokens turned into Events are the step before's, read while this step runs. Everything on the
device has static shapes (the scheduler's `shapes`, all compiled by `warm_up`): nothing compiles afterwards,
however requests come and go.

The engine is driven by one thread (`run`); other threads call `submit`, `cancel`, `abort_all` and `stop`,
which only touch a lock-protected inbox. Each request reports through its `on_event(Event)` callback, called
on the engine thread: keep it short (the HTTP layer hands the event to its event loop).
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from typing import Callable, Sequence

import jax
import numpy as np

from k2jax.runtime import sampling, speculate
from k2jax.runtime.cache import data_shards, pool_tokens
from k2jax.runtime.layout import (DEFAULT_BLOCK, FROM_LAST, TRASH_PAGE, Feed, RaggedInput, RaggedShape, StepInput,
                                  StepShape, lay_out)
from k2jax.runtime.runner import Runner, all_allowed, neutral_batch
from k2jax.runtime.detok import NoText, TokenText
from k2jax.runtime.metrics import Metrics
from k2jax.runtime.pages import PagePool
from k2jax.runtime.requests import EngineStopped, Event, QueueFull, Request, SamplingParams
from k2jax.runtime.scheduler import Call, RaggedCall, Scheduler, Seq
from k2jax.runtime.settings import EngineConfig
from k2jax.sharding import use_mesh

log = logging.getLogger("k2jax.engine")

SPEC_MARGIN = 1.1  # drafts are fed where their step's expected tokens per second beat a decode's by this


def default_kv_tokens(model, max_batch: int, max_len: int, kv_cache_dtype: str, mesh=None) -> int:
    """The pool's size when neither --kv-tokens nor --kv-memory is given: 90% of the devices' free memory
    (after the weights) in tokens, where the devices report it; on a host without that figure (XLA:CPU),
    max_batch x max_len tokens. Under jax.distributed every process takes process 0's figure."""
    devices = list(mesh.devices.flat) if mesh is not None else jax.local_devices()[:1]
    stats = [d.memory_stats() or {} for d in devices if d.process_index == jax.process_index()]
    tokens = max_batch * max_len
    if stats and all("bytes_limit" in s for s in stats):
        free = min(s["bytes_limit"] - s.get("bytes_in_use", 0) for s in stats)
        tokens = max(max_len, pool_tokens(model.cfg, kv_cache_dtype, 0.9 * free, mesh, max_batch))
    if jax.process_count() > 1:  # every process must make the same pool
        from jax.experimental import multihost_utils

        tokens = int(multihost_utils.broadcast_one_to_all(np.int64(tokens)))
    return tokens


class Engine:
    """The serving engine: requests in, events out, one step at a time over the paged cache, as `config` (an
    EngineConfig) says: its slots, pool, chunks, step layout and speculative decoding. `detok` (a
    detok.TokenText) turns each request's tokens into text incrementally; `mesh` splits the slots and the pool
    over the batch's mesh axes (params already placed on it); `grammars`: a
    k2jax.serving.grammar.GrammarCompiler for structured output; `metrics`, `sync` (k2jax.serving.multihost's
    StepSync under jax.distributed). Keyword settings not given in `config` make or amend it:
    Engine(model, params, max_batch=4) is Engine(model, params, EngineConfig(max_batch=4)).

    Ragged steps (config.ragged, the default): each engine step is one ragged step over every
    decoding row and the prompt chunks that fit prefill_chunk (idle_chunk while none decodes) tokens, in a
    handful of programs whatever the cache lengths; with the stall bound, warm_up times each chunk region
    with and without a cached prefix, and the chunks beside decoding rows are cut by that model of a step's
    time (Scheduler.ragged_s). On a mesh whose data-parallel shards split the slots, the step has one segment
    per shard with the same bounds (k2jax.runtime.layout). Otherwise the rectangular steps: one per chunk,
    and one decode.

    Overlap (config.overlap, ragged steps): a step is planned and sent before the step before's tokens are
    read. Each row that step sampled feeds FROM_LAST, and the runner takes that token from its slot's last
    sampled one on the device. The host then reads the step before's tokens, for output, while the device
    runs the new step. A row whose read token ends it (a stop) was fed once more for nothing, and that output
    is dropped; a row that reaches its max_tokens is not fed again (Seq.final). A row with a grammar needs
    its last token for its mask: a step where one samples is sent as its model pass alone (Runner.send), and
    its sampler follows once the step before's tokens are read and the masks made, while the pass runs.

    Speculative decoding (config.speculative, ragged steps only): each step where no prompt chunk runs, every
    decoding row feeds up to num_speculative_tokens drafted tokens after its last one, and the step verifies
    them (k2jax.runtime.runner): a row outputs its drafts up to the first the model does not sample, then the
    model's own token there. The output is what it would be without (greedy: the same tokens; sampling: the
    same distribution). Rows with a grammar or penalties get no drafts and ride in a verifying step as plain
    rows (their masks and penalty state apply to their one token). Once warm_up has timed the decode and
    verifying steps, a step speculates only where it is expected to output tokens faster: each row's drafts
    are weighed by its own acceptance so far (see _worth). A step where no row drafts keeps overlap."""

    def __init__(self, model, params, config: EngineConfig | None = None, *, detok: TokenText | None = None,
                 mesh=None, metrics: Metrics | None = None, sync=None, grammars=None, **settings):
        c = self.config = EngineConfig(**settings) if config is None else config.replace(**settings)
        self.model, self.params, self.mesh = model, params, mesh
        self.max_len, self.max_queue, self.batch_wait_s = c.max_len, c.max_queue, c.batch_wait_s
        self.prefill_chunk = min(c.prefill_chunk, c.max_len)
        self.idle_chunk = min(max(4 * c.prefill_chunk if c.idle_chunk is None else c.idle_chunk, c.prefill_chunk),
                              c.max_len)
        self.detok, self.grammars, self.sync = detok, grammars, sync
        kv_dtype = "auto" if c.kv_cache_dtype in (None, "auto") else c.kv_cache_dtype
        slots = round_up_slots(c.max_batch, mesh)  # every data-parallel shard holds as many slots as the others
        shards = data_shards(mesh, slots)
        self.max_batch = slots
        kv_tokens = c.kv_tokens
        if kv_tokens is None:
            kv_tokens = default_kv_tokens(model, slots, c.max_len, kv_dtype if kv_dtype != "auto" else
                                          str(params["embed_tokens"].dtype), mesh)
        per_shard = -(-kv_tokens // (shards * c.page_size))  # pages per shard, its trash page apart
        if per_shard * c.page_size < min(c.max_len, c.page_size):
            raise ValueError(f"a KV pool of {kv_tokens} tokens cannot hold one page per shard")
        self.pool = PagePool(shards * (1 + per_shard), shards, c.page_size, c.prefix_cache)
        self.kv_tokens = shards * per_shard * c.page_size
        self.runner = Runner(model, params, slots=slots, num_pages=self.pool.num_pages, page_size=c.page_size,
                             kv_dtype=None if kv_dtype == "auto" else kv_dtype, mesh=mesh)
        self.kv_cache_dtype = self.runner.kv_dtype
        self.ragged = c.ragged
        if c.speculative is not None and not self.ragged:
            raise ValueError("speculative decoding verifies drafts in a ragged step: it needs ragged steps")
        self.proposer = speculate.make(c.speculative, min_n=c.prompt_lookup[0], max_n=c.prompt_lookup[1])
        self.spec_step_s: dict = {}  # {RaggedShape: seconds} of the decode and verifying steps (warm_up)
        self.spec_tokens = c.num_speculative_tokens if c.speculative is not None else 0
        self.sched = Scheduler(slots, self.pool, c.max_len, self.prefill_chunk, idle_chunk=self.idle_chunk,
                               stall_bound=c.stall_bound, min_chunk=c.min_chunk,
                               ragged_block=DEFAULT_BLOCK if self.ragged else None,
                               speculative_tokens=self.spec_tokens)
        self.metrics = metrics or Metrics(slots)
        self.metrics.pages_total = self.pool.num_pages - shards
        self._inbox: list[Request] = []
        self._cancels: set[int] = set()
        self._aborting = False  # abort_all: every request, and any submitted later, ends with "abort"
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._stop = False
        self.overlap = c.overlap
        self.failed: str | None = None  # why a step failed: the engine thread then ends every request and stops
        self.on_fail: Callable[[str], None] | None = None  # told why, on the engine thread (the server stops)
        self._pending: list[tuple] = []  # the sent step whose tokens are not read yet: [(call, outputs, scored)]

    # --- other threads -----------------------------------------------------------------------------
    def check(self, prompt: Sequence[int], params: SamplingParams) -> None:
        """Raise ValueError (naming the field) for a request that can never run."""
        vocab = self.model.cfg.vocab_size
        if len(prompt) == 0:
            raise ValueError("prompt: empty; give at least one token")
        if any(not 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt: token ids must be in [0, {vocab})")
        if params.max_tokens < (0 if params.prompt_logprobs is not None else 1):
            raise ValueError(f"max_tokens: must be >= 1 (0 only with prompt_logprobs), got {params.max_tokens}")
        if params.prompt_logprobs is not None and not 0 <= params.prompt_logprobs <= sampling.MAX_TOP_LOGPROBS:
            raise ValueError(f"prompt_logprobs: must be in [0, {sampling.MAX_TOP_LOGPROBS}], "
                             f"got {params.prompt_logprobs}")
        if len(prompt) + params.max_tokens > self.max_len:
            raise ValueError(f"max_tokens: prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) "
                             f"exceeds the server's max_len of {self.max_len} tokens")
        if not self.sched.fits(len(prompt) + params.max_tokens):
            raise ValueError(f"max_tokens: prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) "
                             f"exceeds the KV cache pool ({self.pool.capacity() * self.pool.page_size} tokens "
                             f"per data-parallel shard; --kv-tokens / --kv-memory set it)")
        sampling.set_row(sampling.default_rows(1), 0, **self._row_settings(params))  # raises on bad values

    def submit(self, *reqs: Request) -> None:
        """Queue requests, all or none (each checked first). Raises ValueError for a bad one, QueueFull when
        they would put more than max_queue requests in the queue. The queue is what waits beyond the free
        slots: requests about to take a free slot are not counted."""
        for req in reqs:
            self.check(req.prompt, req.params)
            if req.params.grammar is not None and req.matcher is None:
                if self.grammars is None:
                    raise ValueError("response_format: structured output needs a tokenizer (--tokenizer DIR)")
                req.matcher = self.grammars.for_request(**req.params.grammar).matcher()
        with self._lock:
            if self.failed is not None:
                raise EngineStopped(f"the engine stopped after a step failed ({self.failed})")
            if self._queued() + len(reqs) > self.max_queue:
                self.metrics.rejected += len(reqs)
                raise QueueFull(f"{self.max_queue} requests already waiting for a slot")
            self._inbox.extend(reqs)
            self.metrics.requests += len(reqs)
            self._wake.notify()

    def _queued(self) -> int:
        """Requests waiting beyond the free slots (called with the lock held)."""
        free = sum(s is None for s in self.sched.slot_seq)
        return max(0, len(self._inbox) + len(self.sched.waiting) - free)

    def cancel(self, req: Request) -> None:
        """Drop a request (client gone): its slot and pages are freed at the next step."""
        with self._lock:
            self._cancels.add(req.id)
            self._wake.notify()

    def abort_all(self) -> None:
        """End every request at the next step, and any submitted later at the step after it arrives, with
        finish_reason "abort" (the server is shutting down)."""
        with self._lock:
            self._aborting = True
            self._wake.notify()

    def stop(self) -> None:
        with self._lock:
            self._stop = True
            self._wake.notify()

    def queue_depth(self) -> int:
        with self._lock:
            return self._queued()

    def busy(self) -> bool:
        """Whether any request is queued or running."""
        with self._lock:
            return self._busy()

    # --- the engine thread ------------------------------------------------------------------------
    def _context(self):
        """The mesh context the steps are traced under. Thread-local: entered on the thread that steps."""
        return contextlib.nullcontext() if self.mesh is None else use_mesh(self.mesh)

    def programs_cause(self) -> str:
        """Why the engine compiles the programs it does, in words (the start-up log)."""
        s = self.sched
        if self.ragged:
            spec = (f", and {len(s.verify_sizes)} verifying sizes up to {s.verify_sizes[-1]} tokens (speculative "
                    f"decoding)" if s.verify_sizes else "")
            each = f", each in one segment per data-parallel shard ({s.shards})" if s.shards > 1 else ""
            spread = (f", and {len(s.spread_sizes)} sizes of a lone chunk spread over the shards"
                      if s.spread_sizes else "")
            return (f"ragged steps: {len(s.decode_sizes)} decode-only sizes up to the {s.per_shard} slots of a "
                    f"shard and {len(s.region_sizes)} prompt-chunk sizes up to {s.region_sizes[-1]} tokens"
                    f"{spec}{each}{spread}")
        return (f"rectangular steps: decodes over {len(s.row_buckets)} row buckets x {len(s.read_buckets) - 1} cache "
                f"reads, first chunks of {len(s.chunk_sizes)} sizes, and later chunks of {len(s.later_sizes)} sizes x "
                f"{len(s.read_buckets) - 1} cache reads")

    def warm_up(self, progress: Callable[[int, int, str], None] | None = None,
                note: Callable[[str], None] | None = None) -> float:
        """Compile every step the scheduler can ask for, then (stall_bound) time the steps it weighs;
        -> seconds. progress(k, n, what) as the k-th of n programs begins compiling (on a compiling thread);
        note(what) when the compiling is done and the timing begins."""
        shapes, begun, lock = self.sched.shapes(), [0], threading.Lock()

        def report(shape):
            if progress is not None:
                with lock:
                    begun[0] += 1
                    progress(begun[0], len(set(shapes)), describe(shape, self.pool.page_size))

        t0 = time.perf_counter()
        with self._context():
            self.runner.compile(shapes, on_start=report)
            timed = self.sched.timed_shapes()
            if note is not None and timed:
                note(f"compiled in {time.perf_counter() - t0:.1f} s; timing {len(set(timed))} of the steps")
            if self.ragged:
                self.sched.ragged_s = self.time_regions(timed)
            else:
                self.sched.step_s = self.time_steps(timed)
            if self.proposer is not None:  # what a verifying step costs against a plain decode
                self.spec_step_s = self.time_steps([sh for sh in self.sched.shapes()
                                                    if sh.blocks == 0 and not sh.spread])
        return time.perf_counter() - t0

    def time_regions(self, shapes) -> dict:
        """Scheduler.ragged_s for the chunk-region shapes: {shape: (seconds with no cached prefix, seconds
        per cached token)}, the second from a step whose one chunk fills the region over
        Scheduler.timing_prefix(shape) cached tokens (the trash pages, read as a real prefix would be)."""
        base = self.time_steps(shapes)
        longer = self.time_steps(shapes, prefix=True)
        out = {}
        for shape in base:
            n = self.sched.timing_prefix(shape)
            out[shape] = (base[shape], max(0.0, longer[shape] - base[shape]) / n if n else 0.0)
        return out

    def time_steps(self, shapes, repeats: int = 2, prefix: bool = False) -> dict:
        """{shape: seconds} of one step of each shape (the fastest of `repeats` after a first run) on a batch
        that writes nothing, or only into the trash page: a decode-only or verifying step's rows feed real
        tokens (_decoding_rows); prefix (chunk-region ragged shapes): one row's chunk fills the region over
        Scheduler.timing_prefix(shape) cached tokens, all in the trash page. Call before any request
        runs (the steps overwrite the trash pages). Under jax.distributed every process takes process 0's
        times: their schedulers must decide alike."""
        shapes = sorted(shapes)
        times, rng = [], np.random.default_rng(0)
        for shape in shapes:
            batch = neutral_batch(shape, self.model.cfg.vocab_size)
            if prefix:
                n, cached = shape.blocks * shape.block, self.sched.timing_prefix(shape)
                pages = (TRASH_PAGE,) * -(-(cached + n) // self.pool.page_size)
                for k, v in lay_out(shape, {0: Feed((0,) * n, cached, pages)}).items():
                    getattr(batch, k)[...] = v
            else:
                self._decoding_rows(shape, batch)
            # Tokens spread over the vocabulary, so the router spreads them over the experts as real text
            # does (one id repeated would send every token to the same few). A neutral batch writes nothing;
            # the others write only into the trash page, which no request reads.
            batch.tokens[:] = rng.integers(0, self.model.cfg.vocab_size, batch.tokens.shape)
            best = float("inf")
            for i in range(repeats + 1):
                t = time.perf_counter()
                jax.block_until_ready(self.runner.step(shape, batch))
                best = best if i == 0 else min(best, time.perf_counter() - t)
            times.append(best)
        if jax.process_count() > 1 and shapes:
            from jax.experimental import multihost_utils

            times = multihost_utils.broadcast_one_to_all(np.array(times, np.float64)).tolist()
        return dict(zip(shapes, times))

    def _decoding_rows(self, shape, batch) -> None:
        """Fill a decode-only or verifying step's timing batch as serving does, its tokens real ones written
        into the trash page: one token per decoding row, or (verifying) each row's token and its drafts, up to
        1 + num_speculative_tokens a row, until each segment's decode region is full. A padding token reads no
        routed expert (k2jax.ops.moe's decode loop reads only the experts chosen), so a step of padding alone
        would time as if its rows chose none. Other shapes stay neutral."""
        if isinstance(shape, StepShape):
            if shape.tokens == 1:
                batch.count[:] = 1  # every row real; the pages of its table (all 0) are the trash page
            return
        if shape.blocks or shape.spread:
            return
        each = 1 + self.spec_tokens if shape.verify else 1
        per, feeds = self.sched.per_shard, {}
        for segment in range(shape.shards):
            for r in range(min(per, -(-shape.decode // each))):
                n = min(each, shape.decode - r * each)
                feeds[segment * per + r] = Feed((0,) * n, 0, (TRASH_PAGE,) * -(-n // self.pool.page_size))
        for k, v in lay_out(shape, feeds).items():
            getattr(batch, k)[...] = v

    def run_follower(self) -> None:
        """A process other than 0 under jax.distributed: step whenever process 0 does, until it stops."""
        with self._context():
            while not self.sync.stopped:
                self.step()

    def run(self) -> None:
        """Step until stop(); sleeps while there is nothing to do. A step that raises (the device, the compiler,
        a bug) stops the engine: every request ends with "abort", submit raises EngineStopped from then on, and
        on_fail is told why (the server shuts down, so that its supervisor starts it afresh)."""
        with self._context():
            try:
                self._run()
            except Exception as e:
                self._fail(e)

    def _fail(self, e: Exception) -> None:
        log.exception("a step failed: the engine stops and ends every request")
        with self._lock:
            self.failed = f"{type(e).__name__}: {e}"
            reqs = [*self._inbox, *(s.req for s in [*self.sched.waiting, *self.sched.live()])]
            self._inbox = []
        for r in reqs:
            if not r.finished:
                r.finished = True
                with contextlib.suppress(Exception):  # its detokenizer may be what failed
                    r.on_event(Event("", [], "abort", len(r.prompt), len(r.out), cached_tokens=r.cached_tokens))
        if self.on_fail is not None:
            self.on_fail(self.failed)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._stop and not self._busy():
                    self._wake.wait(0.5)
                self._gather_burst()
                if self._stop:
                    self._flush()
                    if self.sync is not None:
                        self.sync.close()
                    return
            self.step()

    def _gather_burst(self) -> None:
        """Called with the lock held. When nothing runs, wait up to batch_wait_s for requests arriving with
        the first (over HTTP a burst comes in over milliseconds), so that the first step prefills them in one
        batch instead of one now and the rest behind its decodes. Ends when a quarter of the wait passes with
        no new arrival, or when the requests fill the slots."""
        if self.batch_wait_s <= 0 or self.sched.live() or self.sched.waiting:
            return
        end = time.perf_counter() + self.batch_wait_s
        seen = len(self._inbox)
        while not self._stop and seen < self.max_batch and (now := time.perf_counter()) < end:
            self._wake.wait(min(end - now, self.batch_wait_s / 4))
            if len(self._inbox) == seen:
                return
            seen = len(self._inbox)

    def _busy(self) -> bool:
        return bool(self._inbox or self._cancels or self.sched.waiting or self.sched.live() or self._pending)

    def step(self) -> None:
        """One engine step: take in new requests and cancellations, admit, run the scheduler's calls."""
        with self._lock:
            new, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, set()
            aborted = set()
            if self._aborting:
                aborted = {r.id for r in new} | {s.req.id for s in [*self.sched.waiting, *self.sched.live()]}
        cancels |= aborted
        if self.sync is not None:
            new, cancels = self.sync(new, cancels)
            if self.sync.stopped:
                return
        with self._lock:  # submit counts free slots: a request is in `waiting` or in a slot, never neither
            for r in new:
                if r.params.grammar is not None and r.matcher is None:  # a follower process builds its own
                    r.matcher = self.grammars.for_request(**r.params.grammar).matcher()
                r.seq = Seq(r, list(r.prompt), len(r.prompt),
                            reuse=not r.params.penalized and r.params.prompt_logprobs is None)
                self.sched.add(r.seq)
            if cancels:
                self._drop(cancels, aborted)
            admitted = [s for s in self.sched.waiting]
            self.sched.admit()
        now = time.perf_counter()
        for s in admitted:
            if s.slot >= 0 and s.req.cached_tokens == 0 and s.preemptions == 0:
                s.req.cached_tokens = s.cached
                self.metrics.observe_queue(now - s.req.arrived)
                self.metrics.prompt_prefilled += len(s.req.prompt) - s.cached
                self.metrics.cached_prompt_tokens += s.cached
        self._gauges()
        done = []
        overlap = self._overlaps()
        proposed = False  # the drafts already looked up in every row's whole tokens
        if overlap and self.proposer is not None:
            # Would any row draft, its last token read? Looked up in the tokens known (a row sent but not read
            # lacks its last): if so, read them and look again; if not, overlap this step, without drafts.
            # With no step unread, those lookups were of the whole tokens.
            proposed = not self._pending
            self._propose(lagged=True)
            overlap = not any(seq.draft for seq in self.sched.live() if seq.decoding)
        if not overlap:
            self._flush()
            if self.proposer is not None and not proposed:
                self._propose()
        t0 = time.perf_counter()  # (after reading a step sent before: the step times below are this one's)
        calls = [c for c in [self.sched.plan_ragged()] if c is not None] if self.ragged else self.sched.plan()
        for call in calls:
            batch = neutral_batch(call.shape, self.model.cfg.vocab_size)
            if isinstance(call, RaggedCall):
                self.sched.ragged_inputs(call, batch)
            else:
                self.sched.inputs(call, batch)
            late = self._late_masks(call)
            self._sampling(call, batch, masks=not late)
            scored = self._targets(call, batch)
            sent = self.runner.send(call.shape, batch) if late else self.runner.step(call.shape, batch)
            done.append((call, sent, scored, late))
        # This step is sent. With overlap, read the step before's tokens while it runs: they finish rows this
        # step fed again (advance skips them), and the pages advance indexes hold them.
        self._flush()
        # The grammar masks of a step sent without them, made while its model pass runs: each matcher has now
        # taken its row's last token (read just above, with overlap).
        done = [(call, self._sample_late(call, sent) if late else sent, scored) for call, sent, scored, late in done]
        for call, _, _ in done:
            self.sched.advance(call)
            if overlap:
                self._in_flight(call)
        self._pending = done
        if not overlap:
            self._flush()
        if done:
            took = time.perf_counter() - t0
            self.metrics.observe_step(took)
            shape = done[-1][0].shape
            # What such a step takes when serving, host work too. Not under jax.distributed: each process
            # would follow its own times, and their drafts (so their steps) must be alike.
            if len(done) == 1 and shape in self.spec_step_s and self.sync is None:
                self.spec_step_s[shape] += 0.2 * (took - self.spec_step_s[shape])
        self._gauges()

    def _overlaps(self) -> bool:
        """Whether this step may be sent before the step before's tokens are read (config.overlap): ragged
        steps. With speculative decoding, only while no row's drafts are worth feeding (drafts follow the
        last token; see step)."""
        return self.overlap and self.ragged

    @staticmethod
    def _late_masks(call) -> bool:
        """Whether `call` is sent before its grammar masks are made (Runner.send, then `_sample_late`): a plain
        ragged step where a row with a grammar samples. Its mask follows the row's last token, which with
        overlap is read only after this step is sent; without, the masks are still made while the pass runs."""
        return (isinstance(call, RaggedCall) and not call.shape.verify
                and any(samples and seq is not None and seq.req.matcher is not None
                        for (seq, _), samples in zip(call.rows, call.samples)))

    def _sample_late(self, call: RaggedCall, sent) -> dict:
        """Sample a sent pass (Runner.send's) with its rows' grammar masks, made now (see _late_masks)."""
        bitmask = all_allowed(call.shape.rows, self.model.cfg.vocab_size)
        self._masks(call, bitmask)
        return self.runner.sample(sent, bitmask)

    def _in_flight(self, call: RaggedCall) -> None:
        """The call was sent and its tokens not read: each sampling row's next token is FROM_LAST until
        `_flush` reads it (the next step feeds it as that, and takes it on the device); a row whose token is
        its max_tokens-th is `final`."""
        for (seq, _), samples in zip(call.rows, call.samples):
            if samples and not seq.finished and not seq.req.finished:
                seq.tokens.append(FROM_LAST)
                seq.final = seq.generated >= max(1, seq.req.params.max_tokens)

    def _flush(self) -> None:
        """Read the sent step whose tokens were not read yet (if any): its scores and tokens to its requests."""
        done, self._pending = self._pending, []
        for call, out, scored in done:
            self._take_scores(out, scored)
            self._emit(call, out)

    def _propose(self, lagged: bool = False) -> None:
        """Each decoding row's drafts for the next step: up to num_speculative_tokens, none past its
        max_tokens; none for a row with a grammar or penalties (each draft's mask or counts would follow the
        draft before it), which rides in a verifying step as a plain row. lagged (overlap, the step before's
        tokens not read): a row whose last token is not read is looked up without it, the first draft then
        standing for that token; such drafts only tell whether drafting would pay (step), and those not fed
        teach the rows' acceptance as `shadow` drafts do (their first is checked against that token)."""
        for seq in self.sched.live():
            if not seq.decoding:
                continue
            p = seq.req.params
            if seq.req.matcher is not None or p.penalized:
                seq.draft = []
                continue
            known = seq.tokens[:-1] if lagged and seq.tokens[-1] == FROM_LAST else seq.tokens
            k = min(self.spec_tokens, p.max_tokens - seq.generated - 1)
            seq.draft = self.proposer.propose(known, k) if k > 0 else []
        if self.spec_step_s:
            self._worth()

    def _worth(self) -> None:
        """Trim the drafts to what pays: each row's expected output from k drafts is 1 + a + a^2 + ... + a^k
        for its acceptance rate a so far (every draft accepted with probability a after the one before it);
        of the steps with drafts cut to at most k (k = 0: none), the one with most tokens per second of its
        timed step (warm_up's time, then, on one process, a moving average of the engine steps of that shape
        as they run, host work included) is taken, drafts only if they beat no drafts by SPEC_MARGIN. (A
        verifying step's cost grows with its tokens: each may choose experts the others do not.) Drafts cut
        away are kept as the row's `shadow`: the next token tells whether the first would have been
        accepted, so a row that does not speculate still learns its rate."""
        s = self.sched
        rows = [q for q in s.live() if q.decoding]
        if not rows or any(q.draft is None for q in rows):
            return
        best, best_k = None, 0
        for k in range(self.spec_tokens + 1):
            n = [min(len(q.draft), k) for q in rows]
            if k and not any(n):
                break
            D = s.fullest_segment((q.slot, 1 + m) for q, m in zip(rows, n))
            shape = s.decode_shape(D, verify=bool(k))
            gain = sum(sum(q.accept_rate ** (i + 1) for i in range(m)) for q, m in zip(rows, n))
            # Drafts must beat a plain decode by SPEC_MARGIN: the estimates are rough, and a loss costs every row.
            rate = (len(rows) + gain) / (self.spec_step_s[shape] * (SPEC_MARGIN if k else 1.0))
            if best is None or rate > best:
                best, best_k = rate, k
        for q in rows:
            q.draft, q.shadow = q.draft[:best_k], (q.draft if not best_k else [])

    def _sampling(self, call: Call, batch: StepInput | RaggedInput, masks: bool = True) -> None:
        """Each row's generated count and (masks) grammar mask; a sequence's settings go to its slot on the
        device (Runner.set_sampling) before its first step there, the only time they are sent. A step with no
        grammar row, or whose masks are made later (masks=False), takes the runner's all-allowed mask already
        on the device."""
        fresh = {}
        for i, (seq, _) in enumerate(call.rows):
            if seq is None:
                continue
            batch.step[i] = seq.generated
            if seq.new_slot:
                fresh[seq.slot] = self._row_settings(seq.req.params)
        self.runner.set_sampling(fresh)
        if not (masks and self._masks(call, batch.bitmask)):
            batch.bitmask = self.runner.neutral_mask(call.shape)

    def _masks(self, call: Call, bitmask_BW: np.ndarray) -> bool:
        """Fill the mask row of each sampling row with a grammar (a finished one's stays all-allowed: its token
        is not output), all at once on the grammar library's threads -> whether any was."""
        rows = [(seq.req.matcher, i) for i, ((seq, _), samples) in enumerate(zip(call.rows, call.samples))
                if samples and seq is not None and seq.req.matcher is not None and not seq.req.finished]
        if rows:
            self.grammars.fill_bitmasks(rows, bitmask_BW)
        return bool(rows)

    def _targets(self, call: Call, batch: StepInput | RaggedInput) -> list[tuple]:
        """Set the targets of the rows that score their prompt (each fed prompt token's successor, for the
        positions not scored yet: a preempted request's are kept); -> [(row, request, first position, end,
        the row's first fed position)]."""
        scored = []
        for i, (seq, n) in enumerate(call.rows):
            if seq is None or seq.req.params.prompt_logprobs is None:
                continue
            lo, hi = max(seq.cached, len(seq.req.prompt_lp)), min(seq.cached + n, seq.prompt_len - 1)
            if hi > lo:
                # (row, 0): a rectangular step's targets are [B, T]; (None, the row's flat indices): a ragged
                # one's are flat [T]
                at = (i, 0) if isinstance(call, Call) else (None, call.flat[i])
                if at[0] is None:
                    batch.targets[at[1][lo - seq.cached:hi - seq.cached]] = seq.tokens[lo + 1:hi + 1]
                else:
                    batch.targets[i, lo - seq.cached:hi - seq.cached] = seq.tokens[lo + 1:hi + 1]
                scored.append((at, seq.req, lo, hi, seq.cached))
        return scored

    def _take_scores(self, out: dict, scored: list[tuple]) -> None:
        """Append the step's prompt scores to their requests (see _targets)."""
        if not scored:
            return
        got = {k: _host(out["prompt_" + k]) for k in ("logprob", "rank", "top_ids", "top_logprobs")}
        for (i, offset), r, lo, hi, start in scored:
            k = r.params.prompt_logprobs
            for p in range(lo, hi):
                t = (offset[p - start],) if i is None else (i, p - start)
                r.prompt_lp.append({"token_id": int(r.prompt[p + 1]), "logprob": float(got["logprob"][t]),
                                    "rank": int(got["rank"][t]),
                                    "top": [[int(a), float(b)] for a, b in zip(got["top_ids"][t][:k],
                                                                              got["top_logprobs"][t][:k])]})

    def _prompt_logprobs(self, r: Request) -> list[dict] | None:
        """r's prompt scores, on the first event after its prompt (None on the others, or when not asked)."""
        if r.params.prompt_logprobs is None or r.prompt_lp_sent:
            return None
        r.prompt_lp_sent = True
        return r.prompt_lp

    def _row_settings(self, p: SamplingParams) -> dict:
        return dict(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p, seed=p.seed % 2**32,
                    presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                    repetition_penalty=p.repetition_penalty, min_tokens=p.min_tokens,
                    stop_ids=p.stop_ids[:sampling.MAX_STOP_IDS] if p.min_tokens else (),
                    logit_bias=p.logit_bias, top_logprobs=p.logprobs or 0, vocab_size=self.model.cfg.vocab_size)

    def _emit(self, call: Call | RaggedCall, out: dict) -> None:
        """Hand each sampling row's new tokens to its request: its sampled token, or after a verifying step
        its accepted drafts, then the model's own next token."""
        if not any(call.samples):
            return
        tokens = _host(out["tokens"])
        want_lp = any(s is not None and s.req.params.logprobs is not None for s, _ in call.rows)
        lp = {k: _host(out[k]) for k in ("logprob", "top_ids", "top_logprobs")} if want_lp else None
        masked = _host(out["all_masked"]) if "all_masked" in out else np.zeros(len(tokens), bool)
        verify = isinstance(call, RaggedCall) and call.shape.verify
        emitted = _host(out["emitted"]) if verify else None
        m = self.metrics
        for i, ((seq, _), samples) in enumerate(zip(call.rows, call.samples)):
            if not samples or seq.finished or seq.req.finished:
                continue
            # Its outputs: flat tokens [first, first + n) of a verifying step, else its row's one token.
            first, n = (call.starts[i], int(emitted[i])) if verify else (i, 1)
            drafted = len(call.drafts.get(i, ())) if verify else 0
            if drafted:
                m.spec_verified += 1
                m.spec_drafted += drafted
                m.spec_accepted += n - 1
                seq.record_drafts(drafted, n - 1)
            elif seq.shadow:  # drafts not fed: the row's acceptance record learns from them anyway
                seq.record_drafts(1, int(seq.shadow[0] == int(tokens[first])))
            seq.shadow = []
            for t in range(first, first + n):
                tok = int(tokens[t])
                if seq.tokens[-1] == FROM_LAST:  # sent before it was read (overlap)
                    seq.tokens[-1] = tok
                else:
                    seq.tokens.append(tok)
                lps = None if lp is None or seq.req.params.logprobs is None else \
                    _logprobs(lp, t, tok, seq.req.params.logprobs)
                self._emit_token(seq.req, tok, lps, bool(masked[t]))
                if seq.req.finished:
                    break
            else:
                self.sched.verified(seq, n - 1)

    def _emit_token(self, r: Request, tok: int, logprobs, masked: bool) -> None:
        """Record a new token of `r`: report the text that is final, finish on a stop or the limit. The text
        comes from r.detok, which costs the same per token however long the output is."""
        if r.params.max_tokens == 0:  # the prompt's scores alone were asked for: the sampled token is not output
            self._finish(r, "length")
            return
        if not r.out:
            r.first_token_at = time.perf_counter()
            self.metrics.observe_ttft(r.first_token_at - r.arrived)
        r.out.append(tok)
        self.metrics.generation_tokens += 1
        if r.matcher is not None:
            r.matcher.accept(tok)
        p = r.params
        if r.detok is None:
            r.detok = self.detok.stream(p.skip_special_tokens, p.stop) if self.detok is not None else NoText()
        stops = len(r.out) >= p.min_tokens  # no stop before min_tokens (the device keeps stop ids out)
        reason = None
        if masked:  # nothing was allowed (a grammar with no way on): end here
            reason, text = "stop", r.detok.flush()
        elif stops and tok in p.stop_ids:
            reason, text = "stop", r.detok.flush()
        else:
            text = r.detok.add(tok, check_stop=stops)
            if r.detok.stopped:
                reason = "stop"
        if reason is None and len(r.out) >= p.max_tokens:
            reason, text = "length", text + r.detok.flush()
        lps = None if logprobs is None else [logprobs]
        if reason is None:
            r.on_event(Event(text, [tok], None, len(r.prompt), len(r.out), logprobs=lps,
                             cached_tokens=r.cached_tokens, prompt_logprobs=self._prompt_logprobs(r)))
            return
        self._finish(r, reason, text, [tok], lps)

    def _drop(self, ids: set[int], aborted: set[int] = frozenset()) -> None:
        for seq in [*self.sched.waiting, *self.sched.live()]:
            if seq.req.id in ids:
                self._finish(seq.req, "abort" if seq.req.id in aborted else "cancelled")

    def _finish(self, r: Request, reason: str, text: str = "", ids=(), logprobs=None) -> None:
        if not r.finished:
            r.finished = True
            if not text and r.detok is not None and reason not in ("stop", "length"):
                text = r.detok.flush()
            r.on_event(Event(text, list(ids), reason, len(r.prompt), len(r.out), logprobs=logprobs,
                             cached_tokens=r.cached_tokens, prompt_logprobs=self._prompt_logprobs(r)))
            self.metrics.finished += 1
        if r.seq is not None:
            self.sched.finish(r.seq)
        self._gauges()

    def _gauges(self) -> None:
        # Set whenever a slot is taken or freed, not only at the end of a step: a client that has its
        # first token (emitted mid-step) must already see its slot counted.
        m, pool = self.metrics, self.pool
        live = self.sched.live()
        m.queue_depth = max(0, len(self.sched.waiting) - sum(s is None for s in self.sched.slot_seq))
        m.running, m.waiting = len(live), len(self.sched.waiting)
        m.slots_in_use = len(live)
        m.pages_in_use, m.pages_free, m.pages_cached = pool.in_use_count(), pool.free_count(), pool.cached_count()
        m.cache_usage = m.pages_in_use / max(m.pages_total, 1)
        m.preemptions = self.sched.preemptions


def describe(shape, page_size: int) -> str:
    """A step program in words, for the start-up log."""
    if isinstance(shape, RaggedShape):
        if shape.verify:
            return f"ragged step: verifying up to {shape.decode} decoding and drafted tokens"
        each = f" in each of {shape.shards} data-parallel shards" if shape.shards > 1 else ""
        if shape.spread:
            return (f"ragged step: {shape.decode} decoding rows{each} and a lone prompt chunk of up to "
                    f"{shape.shards * shape.spread_tokens} tokens spread over them")
        if shape.blocks == 0:
            return f"ragged step: {shape.decode} decoding rows{each}"
        return (f"ragged step: {shape.decode} decoding rows and {shape.blocks * shape.block} prompt-chunk tokens "
                f"(blocks of {shape.block}){each}")
    what = (f"decode over {shape.rows} rows" if shape.tokens == 1 else
            f"prompt chunk, {shape.rows} x {shape.tokens} tokens")
    return f"{what}, reading {shape.read_pages * page_size} cached tokens"


def round_up_slots(max_batch: int, mesh) -> int:
    """max_batch rounded up to a multiple of the data-parallel shards (the product of the mesh's batch axes:
    data, fsdp, expert), so that the slots and the pool split over all of them."""
    if mesh is None:
        return max_batch
    n = math.prod(mesh.shape.get(a, 1) for a in ("data", "fsdp", "expert"))
    return -(-max_batch // n) * n


def _logprobs(lp: dict, i: int, tok: int, k: int | None) -> dict:
    """Row i's logprob entry (Event.logprobs): the sampled token's and its row's top k."""
    top = [[int(t), float(v)] for t, v in zip(lp["top_ids"][i][:k or 0], lp["top_logprobs"][i][:k or 0]) if t >= 0]
    return {"token_id": tok, "logprob": float(lp["logprob"][i]), "top": top}


def _host(x) -> np.ndarray:
    """The whole of x on this host (gathered when split over processes)."""
    if x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def generate_one(engine: Engine, prompt: Sequence[int], params: SamplingParams) -> tuple[list[int], str, str]:
    """Run one request through an engine on this thread (no server): -> (token ids, text, finish_reason)."""
    events: list[Event] = []
    engine.submit(Request(list(prompt), params, events.append))
    while not (events and events[-1].finish_reason):
        engine.step()
    return [t for e in events for t in e.token_ids], "".join(e.text for e in events), events[-1].finish_reason
