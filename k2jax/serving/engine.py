"""Continuous batching: requests join and leave a fixed set of decode slots between engine steps.

One engine step = prefill chunks + one decode token for every live slot. While slots decode, a step
prefills at most `prefill_chunk` prompt tokens in all, so a long prompt never stalls the running decodes;
while none does, every prefilling request gets a chunk in one batch. The decode runs over the smallest
bucket of rows that holds the live slots. Everything on the device has static shapes
(k2jax.serving.device): nothing compiles after `warm_up`, however requests come and go.

The engine is driven by one thread (`run`); other threads call `submit` and `cancel`, which only touch a
lock-protected inbox. Each request reports through its `on_event(Event)` callback, called on the engine
thread: keep it short (the HTTP layer hands the event to its event loop).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import threading
import time
from typing import Callable, Sequence

import jax
import numpy as np

from k2jax.serving import device as dev
from k2jax.serving.detok import NoText, TokenText
from k2jax.serving.metrics import Metrics


class QueueFull(Exception):
    """The waiting queue is at its limit: try again later."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request settings. temperature 0 = greedy; top_k 0 = all; stop_ids end the output (not included in
    the text); stop strings are matched on the detokenized text and cut from it (neither before min_tokens).
    The penalties count the request's own generated tokens (repetition_penalty the prompt's too);
    logit_bias: (token id, bias in [-100, 100]) pairs, at most 300; logprobs None = none, k >= 0 = the
    sampled token's logprob and the top k (k <= 20), from the distribution sampled from."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int = 0  # the API draws a random 63-bit seed when the request has none
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    logprobs: int | None = None
    stop_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    skip_special_tokens: bool = True


@dataclasses.dataclass
class Event:
    """What a request gets after each of its engine steps: new text and token ids; finish_reason set on the
    last one ("stop" | "length" | "cancelled" | "abort" | "error"). logprobs (when params.logprobs is not
    None): one {"token_id", "logprob", "top": [[token_id, logprob], ...]} per token of token_ids."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    logprobs: list[dict] | None = None


@dataclasses.dataclass
class Request:
    prompt: list[int]
    params: SamplingParams
    on_event: Callable[[Event], None]
    id: int = dataclasses.field(default_factory=lambda: next(_IDS))
    arrived: float = dataclasses.field(default_factory=time.perf_counter)
    # engine-side state
    slot: int = -1
    done_prompt: int = 0  # prompt tokens prefilled so far
    out: list[int] = dataclasses.field(default_factory=list)  # generated ids (stop id included)
    detok: object = None  # its k2jax.serving.detok.Detokenizer, made at its first token
    finished: bool = False


_IDS = itertools.count()


class Engine:
    """max_batch slots over one [max_batch, max_len] latent cache. `detok` (a detok.TokenText) turns each
    request's tokens into text incrementally (for stop strings and streamed text); `mesh` splits the slots
    over 'data' (params already placed on it); `batch_wait_s`: how long `run` lets a burst arriving at an
    idle engine gather (see _gather_burst)."""

    # SamplingParams fields the device step does not apply yet: the API refuses a request that sets one
    # rather than ignore it. Empty once the device-side sampler honours them all.
    PENDING_FIELDS = frozenset({"min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                                "logit_bias", "min_tokens", "logprobs"})

    def __init__(self, model, params, *, max_batch: int = 8, max_len: int = 4096, prefill_chunk: int = 512,
                 detok: TokenText | None = None, kv_cache_dtype: str = "auto",
                 mesh=None, max_queue: int = 256, metrics: Metrics | None = None, sync=None,
                 batch_wait_s: float = 0.0):
        if max_batch < 1 or max_len < 2 or prefill_chunk < 1:
            raise ValueError(f"need max_batch >= 1, max_len >= 2 and prefill_chunk >= 1, got {max_batch}, "
                             f"{max_len}, {prefill_chunk}")
        self.model, self.params, self.mesh = model, params, mesh
        self.max_batch, self.max_len, self.max_queue = max_batch, max_len, max_queue
        self.batch_wait_s = batch_wait_s
        self.prefill_chunk = min(prefill_chunk, max_len)
        self.detok = detok
        self.metrics = metrics or Metrics(max_batch)
        self.sync = sync  # multi-host: agrees on each step's admissions and cancellations (k2jax.serving.multihost)
        dt = params["embed_tokens"].dtype
        self._rep = None if mesh is None else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        self.cache = dev.slot_cache(model.cfg, max_batch, max_len, dt, kv_cache_dtype, mesh)
        steps = dev.make_steps(model, max_len)
        # The cache comes back laid out as it went in: one executable per step kind and shape, however often
        # it runs.
        out = None if mesh is None else (jax.tree.map(lambda x: x.sharding, self.cache), self._rep)
        self._prefill_first, self._prefill_next, self._decode_rows, self._decode = (
            jax.jit(f, donate_argnums=(1,), out_shardings=out) for f in steps)
        self.row_buckets = dev.row_buckets(max_batch)
        self.chunk_sizes = dev.chunk_sizes(self.prefill_chunk)
        self.slots: list[Request | None] = [None] * max_batch
        self.tokens = np.zeros(max_batch, np.int32)  # each live slot's next input token
        self.pos = np.zeros(max_batch, np.int32)  # and its position
        self.samp = dev.samp_arrays(max_batch)
        self.waiting: collections.deque[Request] = collections.deque()
        self.prefilling: collections.deque[Request] = collections.deque()
        self._inbox: list[Request] = []
        self._cancels: set[int] = set()
        self._aborting = False  # abort_all: every request, and any submitted later, ends with "abort"
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._stop = False

    # --- other threads -----------------------------------------------------------------------------
    def check(self, prompt: Sequence[int], params: SamplingParams) -> None:
        """Raise ValueError (naming the field) for a request that can never run."""
        vocab = self.model.cfg.vocab_size
        if len(prompt) == 0:
            raise ValueError("prompt: empty; give at least one token")
        if any(not 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt: token ids must be in [0, {vocab})")
        if params.max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {params.max_tokens}")
        if len(prompt) + params.max_tokens > self.max_len:
            raise ValueError(f"max_tokens: prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) "
                             f"exceeds the server's max_len of {self.max_len} tokens")

    def submit(self, *reqs: Request) -> None:
        """Queue requests, all or none (each checked first). Raises ValueError for a bad one, QueueFull when
        they would put more than max_queue requests in the queue. The queue is what waits beyond the free
        slots: requests about to take a free slot are not counted."""
        for req in reqs:
            self.check(req.prompt, req.params)
        with self._lock:
            if self._queued() + len(reqs) > self.max_queue:
                self.metrics.rejected += len(reqs)
                raise QueueFull(f"{self.max_queue} requests already waiting for a slot")
            self._inbox.extend(reqs)
            self.metrics.requests += len(reqs)
            self._wake.notify()

    def _queued(self) -> int:
        """Requests waiting beyond the free slots (called with the lock held: _admit takes it too)."""
        free = sum(s is None for s in self.slots)
        return max(0, len(self._inbox) + len(self.waiting) - free)

    def cancel(self, req: Request) -> None:
        """Drop a request (client gone): its slot is freed at the next step."""
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

    # --- the engine thread ------------------------------------------------------------------------
    def _context(self):
        """The mesh context the steps are traced under. Thread-local: entered on the thread that steps, or
        the engine thread would trace (and compile) other programs than warm_up did."""
        if self.mesh is None:
            return contextlib.nullcontext()
        from k2jax.sharding import use_mesh

        return use_mesh(self.mesh)

    def warm_up(self, progress: Callable[[int, int, str], None] | None = None) -> float:
        """Compile every step (each prefill chunk size and the decode step) on dummy inputs; -> seconds.
        progress(k, n, what) is called before the k-th of n programs compiles."""
        with self._context():
            return self._warm_up(progress or (lambda k, n, what: None))

    def _warm_up(self, progress) -> float:
        t0 = time.perf_counter()
        outs = []
        n = len(self._prefill_shapes()) + len(self.row_buckets)
        for k, (first, rows, c) in enumerate(self._prefill_shapes(), 1):
            progress(k, n, f"prefill {'first' if first else 'later'} chunk, {rows} x {c} tokens")
            zeros = np.zeros(rows, np.int32)  # length 0: writes nothing
            step, args = ((self._prefill_first, (zeros, np.zeros((rows, c), np.int32), zeros)) if first else
                          (self._prefill_next, (zeros, np.zeros((rows, c), np.int32), zeros, zeros)))
            self.cache, tok = step(self.params, self.cache, *self._put(*args, dev.samp_arrays(rows)))
            outs.append(tok)
        for i, k in enumerate(self.row_buckets[:-1]):
            progress(n - len(self.row_buckets) + 1 + i, n, f"decode over {k} of {self.max_batch} slots")
            self.cache, toks = self._decode_rows(self.params, self.cache, *self._put(
                np.arange(k, dtype=np.int32), np.zeros(k, np.int32), np.zeros(k, np.int32), np.zeros(k, bool),
                dev.samp_arrays(k)))
            outs.append(toks)
        progress(n, n, f"decode over all {self.max_batch} slots")
        self.cache, toks = self._decode(self.params, self.cache, *self._put(
            self.tokens, self.pos, np.zeros(self.max_batch, bool), self.samp))
        jax.block_until_ready(outs + [toks])
        return time.perf_counter() - t0

    def _prefill_shapes(self) -> list[tuple[bool, int, int]]:
        """(first chunk?, rows, chunk) of every prefill program: one slot's first chunk at each chunk size, a
        bucket of slots' first chunks at the full chunk (the batch when nothing decodes), and one slot's later
        chunk at the full chunk."""
        return ([(True, 1, c) for c in self.chunk_sizes] + [(True, b, self.prefill_chunk) for b in self.row_buckets[1:]]
                + [(False, 1, self.prefill_chunk)])

    def _put(self, *host):
        """Host inputs of a step, replicated over the mesh (under jax.distributed every process passes the
        same values)."""
        if self._rep is None:
            return host
        return jax.device_put(host, self._rep)

    def run_follower(self) -> None:
        """A process other than 0 under jax.distributed: step whenever process 0 does, until it stops."""
        with self._context():
            while not self.sync.stopped:
                self.step()

    def run(self) -> None:
        """Step until stop(); sleeps while there is nothing to do."""
        with self._context():
            self._run()

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._stop and not self._busy():
                    self._wake.wait(0.5)
                self._gather_burst()
                if self._stop:
                    if self.sync is not None:
                        self.sync.close()
                    return
            self.step()

    def _gather_burst(self) -> None:
        """Called with the lock held. When the slots are empty, wait up to batch_wait_s for requests arriving
        with the first (over HTTP a burst comes in over milliseconds), so that the first step prefills them
        in one batch instead of one now and the rest behind its decodes. Ends when a quarter of the wait
        passes with no new arrival, or when the requests fill the slots."""
        if self.batch_wait_s <= 0 or any(self.slots) or self.waiting:
            return
        end = time.perf_counter() + self.batch_wait_s
        seen = len(self._inbox)
        while not self._stop and seen < self.max_batch and (now := time.perf_counter()) < end:
            self._wake.wait(min(end - now, self.batch_wait_s / 4))
            if len(self._inbox) == seen:
                return
            seen = len(self._inbox)

    def _busy(self) -> bool:
        return bool(self._inbox or self._cancels or self.waiting or self.prefilling or any(self.slots))

    def step(self) -> None:
        """One engine step: take in new requests and cancellations, prefill, decode."""
        with self._lock:
            new, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, set()
            aborted = (set() if not self._aborting else
                       {r.id for r in [*new, *self.waiting, *self.slots] if r is not None and not r.finished})
        cancels |= aborted
        if self.sync is not None:
            new, cancels = self.sync(new, cancels)
            if self.sync.stopped:
                return
        self.waiting.extend(new)
        if cancels:
            self._drop(cancels, aborted)
        self._admit()
        t0 = time.perf_counter()
        self._prefill_some()
        self._decode_live()
        self.metrics.observe_step(time.perf_counter() - t0)
        self._gauges()

    def _gauges(self) -> None:
        # Set whenever a slot is taken or freed, not only at the end of a step: a client that has its
        # first token (emitted mid-step) must already see its slot counted.
        self.metrics.queue_depth = self.queue_depth()
        live = [r for r in self.slots if r is not None]
        self.metrics.slots_in_use = len(live)
        self.metrics.cache_usage = sum(r.done_prompt + len(r.out) for r in live) / (self.max_batch * self.max_len)

    def _drop(self, ids: set[int], aborted: set[int] = frozenset()) -> None:
        for r in [r for r in self.waiting if r.id in ids]:
            self.waiting.remove(r)
            self._finish(r, "abort" if r.id in aborted else "cancelled")
        for r in [r for r in self.slots if r is not None and r.id in ids]:
            self._finish(r, "abort" if r.id in aborted else "cancelled")

    def _admit(self) -> None:
        now = time.perf_counter()
        with self._lock:  # submit counts the free slots: a request is in `waiting` or in a slot, never neither
            for b in range(self.max_batch):
                if self.slots[b] is None and self.waiting:
                    r = self.waiting.popleft()
                    r.slot = b
                    self.slots[b] = r
                    self.prefilling.append(r)
                    self.metrics.observe_queue(now - r.arrived)
        self._gauges()

    def _live(self) -> list[int]:
        """The slots that decode this step."""
        return [b for b, r in enumerate(self.slots) if r is not None and r.done_prompt == len(r.prompt)
                and not r.finished]

    def _prefill_some(self) -> None:
        """While slots decode, at most prefill_chunk prompt tokens per step, in whole chunks, first come first
        served (a long prompt stalls the decodes by at most one chunk). While none decodes nothing waits on
        the step, so every waiting first chunk is prefilled in one batch: a burst of requests is prefilled
        as static `generate` would, not one after another."""
        if not self.prefilling:
            return
        fresh = [r for r in self.prefilling if r.done_prompt == 0]
        if len(fresh) > 1 and not self._live():
            self._prefill_rows(fresh, self.prefill_chunk)
            return
        budget = self.prefill_chunk
        for r in list(self.prefilling):
            n = min(len(r.prompt) - r.done_prompt, self.prefill_chunk)
            if n > budget:
                break
            # A later chunk always runs at the full size (one program): only a prompt's last one is shorter.
            self._prefill_rows([r], dev.bucket(n, self.chunk_sizes) if r.done_prompt == 0 else self.prefill_chunk)
            budget -= n

    def _prefill_rows(self, reqs: list[Request], c: int) -> None:
        """One prefill program: the next chunk (at most c tokens, c computed) of each request; several
        requests only at their first chunks."""
        rows = dev.bucket(len(reqs), self.row_buckets) if len(reqs) > 1 else 1
        slot, start, length = (np.zeros(rows, np.int32) for _ in range(3))  # spare rows: length 0
        chunk = np.zeros((rows, c), np.int32)
        samp = dev.samp_arrays(rows)
        for i, r in enumerate(reqs):
            n = min(len(r.prompt) - r.done_prompt, c)
            part = r.prompt[r.done_prompt:r.done_prompt + n]
            if r.done_prompt == 0:
                chunk[i, c - n:] = part  # left-padded, as prefill_first takes it
            else:
                chunk[i, :n] = part
            slot[i], start[i], length[i] = r.slot, r.done_prompt, r.done_prompt + n
            p = r.params
            samp["seed"][i], samp["temperature"][i] = p.seed % 2**32, p.temperature
            samp["top_k"][i], samp["top_p"][i] = p.top_k, p.top_p
        if reqs[0].done_prompt == 0:
            step, args = self._prefill_first, (slot, chunk, length)
        else:
            step, args = self._prefill_next, (slot, chunk, start, length)
        self.cache, toks_dev = step(self.params, self.cache, *self._put(*args, samp))
        toks = None
        for i, r in enumerate(reqs):
            r.done_prompt = int(length[i])
            if r.done_prompt < len(r.prompt):
                continue
            self.prefilling.remove(r)
            b = r.slot
            for k in ("seed", "temperature", "top_k", "top_p"):
                self.samp[k][b] = samp[k][i]
            self.pos[b] = len(r.prompt)
            self.metrics.prompt_tokens += len(r.prompt)
            if toks is None:
                toks = _host(toks_dev)  # waits for the prefill: the steps are dispatched asynchronously
            self.metrics.observe_ttft(time.perf_counter() - r.arrived)
            self._emit_token(r, int(toks[i]))

    def _decode_live(self) -> None:
        """One token for each live slot, over the smallest bucket of rows that holds them."""
        live = self._live()
        if not live:
            return
        k = dev.bucket(len(live), self.row_buckets)
        self.samp["step"] = np.array([len(r.out) if r is not None else 0 for r in self.slots], np.int32)
        if k == self.max_batch:
            mask = np.zeros(self.max_batch, bool)
            mask[live] = True
            self.cache, toks = self._decode(self.params, self.cache, *self._put(self.tokens, self.pos, mask,
                                                                                 self.samp))
            rows = np.arange(self.max_batch)
        else:
            spare = [b for b in range(self.max_batch) if b not in live][:k - len(live)]  # distinct, not live
            rows = np.array(live + spare, np.int32)
            mask = np.arange(k) < len(live)
            self.cache, toks = self._decode_rows(self.params, self.cache, *self._put(
                rows, self.tokens[rows], self.pos[rows], mask, {n: v[rows] for n, v in self.samp.items()}))
        toks = _host(toks)
        for i in np.flatnonzero(mask):
            b = int(rows[i])
            self.pos[b] += 1
            self._emit_token(self.slots[b], int(toks[i]))

    def _emit_token(self, r: Request, tok: int) -> None:
        """Record a new token of `r`: report the text that is final, finish on a stop or the limit. The text
        comes from r.detok, which costs the same per token however long the output is."""
        r.out.append(tok)
        self.tokens[r.slot] = tok
        self.metrics.generation_tokens += 1
        p = r.params
        if r.detok is None:
            r.detok = self.detok.stream(p.skip_special_tokens, p.stop) if self.detok is not None else NoText()
        stops = len(r.out) >= p.min_tokens  # no stop before min_tokens (the device keeps stop ids out)
        reason = None
        if stops and tok in p.stop_ids:
            reason, text = "stop", r.detok.flush()
        else:
            text = r.detok.add(tok, check_stop=stops)
            if r.detok.stopped:
                reason = "stop"
        if reason is None and len(r.out) >= p.max_tokens:
            reason, text = "length", text + r.detok.flush()
        if reason is None:
            r.on_event(Event(text, [tok], None, len(r.prompt), len(r.out)))
            return
        r.finished = True
        r.on_event(Event(text, [tok], reason, len(r.prompt), len(r.out)))
        self._free(r)

    def _finish(self, r: Request, reason: str) -> None:
        if not r.finished:
            r.finished = True
            r.on_event(Event(r.detok.flush() if r.detok is not None else "", [], reason, len(r.prompt),
                             len(r.out)))
        self._free(r)

    def _free(self, r: Request) -> None:
        if r in self.prefilling:
            self.prefilling.remove(r)
        if 0 <= r.slot < self.max_batch and self.slots[r.slot] is r:
            self.slots[r.slot] = None
            self.pos[r.slot] = 0
            self.tokens[r.slot] = 0
            self.samp["temperature"][r.slot] = 0
        self.metrics.finished += 1
        self._gauges()


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
