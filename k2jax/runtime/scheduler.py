"""Which rows run in the next engine step: admission to slots, prompt chunks, decodes, pages, preemption.

Plain Python, no jax: it hands the engine `Call`s (the rows of one runner step and its shape), or with
ragged steps one `RaggedCall` per engine step (`plan_ragged`: every decoding row and the prompt chunks that
fit the step's token budget), and takes back what each row sampled.

- A sequence is a request's tokens (prompt, then what it generated) and how many of them its pages hold
  (`cached`). Each step a row feeds the tokens its pages do not hold yet: its last sampled token (a decode
  row), or up to a chunk of its prompt (a prefill row, which samples when the chunk reaches the end).
- Slots: `slots` rows of per-slot sampling state, split evenly over the data-parallel shards; a sequence
  takes a free slot on the shard whose prefix cache holds most of its prompt (then the one with most room),
  and pages from that shard only.
- A step prefills at most `prefill_chunk` prompt tokens while rows decode (so a long prompt stalls the
  decodes by at most one chunk), first come first served. Given the steps' times (`step_s`, which the engine
  measures at warm-up), a step's chunks are also cut so that they and the decode step take no longer than a
  first chunk of `prefill_chunk` tokens alone (planned to STALL_FILL of it: a step's time varies around its
  timed one). A later chunk re-reads its whole cached prefix and attends over it, so at the same token count
  it takes up to 2.5x a first chunk's time (bench config, 512 tokens over 3584 cached), and the decoding rows
  would wait that long. A step that fits nothing still takes the quickest chunk of the first prompt waiting
  (it goes on). While none decodes, the first chunks of all waiting prompts run in one batch, and a lone
  prompt takes chunks of up to `idle_chunk` tokens (nobody waits on it, and a longer chunk runs at a better
  rate: its experts see more tokens each, and fewer later chunks re-read the prefix).
- Ragged steps are bounded the same way by a model of their time (`ragged_s`, which the engine measures at
  warm-up): a chunk-region shape's time with no cached prefix, plus its time per token of the longest cached
  prefix a chunk in it re-reads (the chunk region's online softmax visits every block for as many visits as
  that row needs, k2jax.ops.ragged). Beside decoding rows, a step's chunks are cut so that the model puts it
  within RAGGED_FILL of one first chunk of `prefill_chunk` tokens (the same decoding rows ride in both).
  With data-parallel shards a ragged step has one segment per shard, which runs on that shard's chips
  (k2jax.runtime.layout): each shard's chunks are chosen from its own rows within the same bounds (the
  shards run side by side), and the fullest segment sizes the step. A step with a single chunk spreads it
  over every segment instead (a lone long prompt then runs on every shard, not on its own while the others
  compute padding), in the smallest spread size that holds it.
- Pages are taken as a row grows. When a shard has none left for a row (after evicting idle cached
  pages), the newest sequence on that shard is preempted: its pages freed, it goes back to the front of the
  queue keeping what it generated, and is recomputed later from its tokens (its output is the same as if it
  had never been preempted: the sampler's key depends only on the seed and the token's index).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import itertools
from typing import TYPE_CHECKING

import numpy as np

from k2jax.runtime.layout import (Feed, RaggedInput, RaggedShape, StepInput, StepShape, blocks_for,
                                  flat_indices, lay_out, place)
from k2jax.runtime.pages import PagePool

if TYPE_CHECKING:
    from k2jax.runtime.requests import Request

_ORDER = itertools.count()

# The share of the stall budget (a first chunk's timed step) that chunks beside decoding rows are planned to
# fill. A step's time varies around its warm-up time: measured on the bench config, a 4000-token prompt
# prefilled beside a decoding stream, each step's wall time was 0.82-1.17x the sum of its calls' timed steps.
STALL_FILL = 0.85
# The same for a ragged step, whose chunks are cut by its modeled time (`ragged_s`). Measured with
# bench/runtime.py (a stream decoding while a 4000-token prompt prefills, its inter-token gaps' p99 against a
# first 512-token chunk alone): 0.85 -> 0.77x, 0.9 -> 0.86x, 1.0 -> 1.11x.
RAGGED_FILL = 0.9


@dataclasses.dataclass(eq=False)
class Seq:
    """A request's state in the engine: `req` (the engine's Request), its tokens (prompt + generated), the
    pages holding them and how many they hold, its slot."""

    req: Request | None  # None: a sequence of the scheduler's own tests
    tokens: list[int]
    prompt_len: int
    slot: int = -1
    pages: list[int] = dataclasses.field(default_factory=list)
    keys: list[bytes] = dataclasses.field(default_factory=list)  # the prefix chain of its indexed pages
    cached: int = 0
    order: int = 0  # admission order: the newest is preempted first
    new_slot: bool = True  # no step has run for it in its slot yet
    reuse: bool = True  # may take pages from the prefix cache (not with penalties: they count fed tokens)
    preemptions: int = 0
    finished: bool = False
    # Tokens proposed after its last one (speculative decoding), for the next step to verify (none for a row
    # with a grammar or penalties: it samples once, with its mask and counts); None = not proposed, and a step
    # with such a row verifies nothing. Set by the engine.
    draft: list[int] | None = None
    # Its drafts' record, decayed (speculative decoding): accepted ones, and trials (each accepted draft, and
    # the first rejected one).
    spec_hits: float = 0.0
    spec_trials: float = 0.0
    shadow: list[int] = dataclasses.field(default_factory=list)  # drafts proposed but not fed (the engine's)
    # Its last token is still being sampled on the device and is its last (its max_tokens): it feeds nothing
    # more (the engine's overlap, which also marks that token FROM_LAST in `tokens` until it is read).
    final: bool = False

    @property
    def accept_rate(self) -> float:
        """The chance its next draft is accepted, as its record says (1/2 before any: Laplace's rule)."""
        return (self.spec_hits + 1) / (self.spec_trials + 2)

    def record_drafts(self, drafted: int, accepted: int, decay: float = 0.9) -> None:
        """Record a verification: `accepted` of its `drafted` drafts accepted (older ones count less)."""
        self.spec_hits = decay * self.spec_hits + accepted
        self.spec_trials = decay * self.spec_trials + accepted + (accepted < drafted)

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def pending(self) -> int:
        """Tokens to feed: its last sampled token, or what is left of its prompt (and of its output, after
        a preemption)."""
        return len(self.tokens) - self.cached

    @property
    def decoding(self) -> bool:
        return self.pending == 1 and self.generated > 0


@dataclasses.dataclass
class Call:
    """One runner step: its shape and, per row, (sequence or None for a filler row, tokens fed)."""

    shape: StepShape
    rows: list[tuple[Seq | None, int]]
    shard_of_row: list[int]
    samples: list[bool] = dataclasses.field(init=False)  # whether a row's sampled token is its next token

    def __post_init__(self):
        # Decided when the call is made (before the step advances the rows): the feed reaches the end.
        self.samples = [s is not None and s.cached + n == len(s.tokens) for s, n in self.rows]


@dataclasses.dataclass
class RaggedCall:
    """One ragged step (k2jax.runtime.layout): its shape and, per slot (row b is slot b), (sequence or None,
    tokens fed); `starts` and `flat` (set by Scheduler.ragged_inputs) give each fed row's first flat token and
    all of them (a spread row's are not consecutive)."""

    shape: RaggedShape
    rows: list[tuple[Seq | None, int]]
    drafts: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)  # slot -> the drafts it feeds
    spread: int | None = None  # the row whose chunk the step spreads over its segments
    samples: list[bool] = dataclasses.field(init=False)
    starts: dict[int, int] = dataclasses.field(default_factory=dict)
    flat: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)  # slot -> its fed tokens' flat indices

    def __post_init__(self):
        self.samples = [s is not None and n > 0 and s.cached + n - len(self.drafts.get(b, ())) == len(s.tokens)
                        for b, (s, n) in enumerate(self.rows)]


def pow2_upto(n: int, lo: int = 1) -> list[int]:
    """Powers of two from lo below n, and n."""
    return sorted({min(n, 1 << i) for i in range(max(lo, 1).bit_length() - 1, n.bit_length() + 1)} | {n})


def bucket(n: int, sizes) -> int:
    """The smallest of `sizes` that holds n."""
    return next(s for s in sorted(sizes) if s >= n)


class Scheduler:
    """slots: rows of per-slot state (a multiple of shards); pool: the pages; max_len: tokens per sequence;
    prefill_chunk: most prompt tokens per step while rows decode; idle_chunk (>= prefill_chunk, default
    prefill_chunk): most prompt tokens per step while none decodes; min_read_tokens: the smallest cache read
    a step makes (fewer programs: reading a few more tokens costs little). stall_bound: later chunks also come
    in powers of two below prefill_chunk (down to min_chunk or an eighth of it, whichever is more), and once
    `step_s` holds the steps' times ({StepShape: seconds}, see `timed_shapes`) the chunks beside decoding rows
    are cut to STALL_FILL of one first chunk's time (see the module docstring); False: chunks of
    prefill_chunk tokens whatever they cost."""

    def __init__(self, slots: int, pool: PagePool, max_len: int, prefill_chunk: int, min_read_tokens: int = 256,
                 idle_chunk: int | None = None, stall_bound: bool = True, min_chunk: int = 64,
                 ragged_block: int | None = None, speculative_tokens: int = 0):
        self.pool, self.max_len, self.chunk = pool, max_len, prefill_chunk
        self.idle = max(prefill_chunk, idle_chunk or prefill_chunk)
        self.shards = pool.shards
        if slots % self.shards:
            raise ValueError(f"{slots} slots do not split over {self.shards} data-parallel shards")
        self.slots, self.per_shard = slots, slots // self.shards
        self.page_size = pool.page_size
        self.slot_seq: list[Seq | None] = [None] * slots
        self.waiting: collections.deque[Seq] = collections.deque()
        self.preemptions = 0
        # The shapes a step can take (Engine.warm_up compiles them all).
        self.max_pages = -(-max_len // self.page_size)
        self.read_buckets = [0] + pow2_upto(self.max_pages, lo=-(-min_read_tokens // self.page_size))
        self.row_buckets = sorted({1} | {self.shards * k for k in pow2_upto(self.per_shard)})
        self.chunk_sizes = pow2_upto(self.idle, lo=min(64, prefill_chunk))  # a first chunk's tokens
        # Cut later chunks: powers of two from min_chunk (or an eighth of prefill_chunk, if more: a step that
        # cannot fit one chunk's time at the smallest size takes the quickest anyway; smaller ones would only
        # add programs and steps).
        lo = min(prefill_chunk, max(min_chunk, prefill_chunk // 8))
        small = pow2_upto(prefill_chunk, lo=lo) if stall_bound else [prefill_chunk]
        self.later_sizes = sorted(set(small) | {self.idle})  # a later chunk's tokens
        self.stall_bound = stall_bound
        self.step_s: dict[StepShape, float] = {}
        # Ragged steps (ragged_block = G tokens per chunk block): one step per engine step, its shape from
        # decode sizes (powers of two from an eighth of the slots up to them) and chunk-region sizes (powers
        # of two from 64 tokens up to idle_chunk, whole blocks), whatever the cache lengths.
        # With data-parallel shards, a step has one segment per shard (k2jax.runtime.layout): the sizes are
        # each segment's, and each shard's chunks are chosen from its own rows.
        self.block = ragged_block
        per = self.per_shard  # the sizes below are each segment's
        if ragged_block is not None:
            G = ragged_block
            self.decode_sizes = pow2_upto(per, lo=max(1, per // 8))  # at most 4: a spare row costs little
            top = -(-self.idle // G) * G
            self.region_sizes = sorted({-(-t // G) * G for t in pow2_upto(top, lo=min(top, max(64, G)))})
            self.spread_sizes = []
            if self.shards > 1:
                # A lone chunk is spread over the segments (blocks per segment for each size up to idle_chunk);
                # several shards' chunks side by side take regions of up to prefill_chunk each.
                self.spread_sizes = sorted({-(-t // G // self.shards) for t in self.region_sizes})
                self.region_sizes = self.region_sizes[:bisect.bisect_left(self.region_sizes, self.chunk) + 1]
        # Speculative decoding: a step with no prompt chunk where some row feeds drafts verifies them all, in a
        # decode region of up to every slot's token and its speculative_tokens drafts.
        self.spec = speculative_tokens
        self.verify_sizes = pow2_upto(per * (1 + self.spec), lo=max(2, per // 8)) if self.spec else []
        # {chunk-region RaggedShape: (seconds with no cached prefix, seconds per token of the longest cached
        # prefix a chunk in it reads)}, see `timed_shapes`; empty: chunks of prefill_chunk tokens whatever
        # they cost.
        self.ragged_s: dict[RaggedShape, tuple[float, float]] = {}

    # --- shapes ----------------------------------------------------------------------------------------
    def table_pages(self, read: int, tokens: int) -> int:
        return min(self.max_pages, read + -(-tokens // self.page_size)) + 1

    def shapes(self) -> list:
        """Every shape `plan` (or `plan_ragged`) can return."""
        if self.block is not None:
            W, G, S = self.max_pages, self.block, self.shards
            return ([RaggedShape(d, 0, G, self.slots, W, shards=S) for d in self.decode_sizes]
                    + [self._region_shape(t) for t in self.region_sizes]
                    + [self._spread_shape(k) for k in self.spread_sizes]
                    + [RaggedShape(d, 0, G, self.slots, W, verify=True, shards=S) for d in self.verify_sizes])
        out = [StepShape(b, 1, r, self.table_pages(r, 1)) for b in self.row_buckets for r in self.read_buckets[1:]]
        out += [StepShape(1, c, 0, self.table_pages(0, c)) for c in self.chunk_sizes]  # a lone first chunk
        out += [StepShape(b, self.chunk, 0, self.table_pages(0, self.chunk)) for b in self.row_buckets[1:]]
        out += [StepShape(1, T, r, self.table_pages(r, T)) for r in self.read_buckets[1:]
                for T in self.later_sizes]  # a later chunk
        return sorted(set(out))

    def timed_shapes(self) -> list:
        """The shapes whose times the stall bound weighs: for rectangular steps (`step_s`) every decode and one
        row's chunks of up to prefill_chunk tokens; for ragged steps (`ragged_s`, timed with no prefix and
        with `timing_prefix(shape)` cached tokens) the chunk regions of up to prefill_chunk tokens."""
        if not self.stall_bound:
            return []
        if self.block is not None:
            return [self._region_shape(t) for t in self.region_sizes if t <= self._first_region()]
        return [s for s in self.shapes() if s.tokens == 1 or (s.rows == 1 and s.tokens <= self._first_size())]

    def timing_prefix(self, shape: RaggedShape) -> int:
        """The cached tokens a chunk-region shape is timed over for its per-token cost: the most a row can
        hold before a chunk of the region's size, in whole pages (0: too short a max_len to tell)."""
        n = self.max_pages * self.page_size - shape.blocks * shape.block
        return max(0, n // self.page_size * self.page_size)

    def ragged_time(self, tokens: int, cached: int) -> float:
        """Modeled seconds of a ragged step whose chunks take `tokens` tokens (whole blocks) and whose longest
        chunk's cached prefix is `cached` tokens (`ragged_s`)."""
        base, per_token = self.ragged_s[self._region_shape(bucket(tokens, self.region_sizes))]
        return base + per_token * cached

    def _region_shape(self, tokens: int) -> RaggedShape:
        return RaggedShape(self.per_shard, tokens // self.block, self.block, self.slots, self.max_pages,
                           shards=self.shards)

    def _spread_shape(self, blocks: int) -> RaggedShape:
        return RaggedShape(self.per_shard, 0, self.block, self.slots, self.max_pages, shards=self.shards,
                           spread=blocks)

    def _first_region(self) -> int:
        """The chunk region of one first chunk of prefill_chunk tokens."""
        return bucket(blocks_for(self.chunk, self.block) * self.block, self.region_sizes)

    def stall_budget_s(self) -> float | None:
        """What a step beside decoding rows may take: a first chunk of prefill_chunk tokens' time (None until
        the steps are timed, or without the stall bound)."""
        if not (self.stall_bound and self.step_s):
            return None
        return self.step_s[StepShape(1, self._first_size(), 0, self.table_pages(0, self._first_size()))]

    def _first_size(self) -> int:
        return bucket(self.chunk, self.chunk_sizes)

    def _chunk_shape(self, seq: Seq, n: int) -> StepShape:
        """The step shape of seq's next n prompt tokens: a first chunk at the smallest size that holds it, a
        later one at the smallest later size, reading the pages that hold its cached tokens."""
        read = self._read_pages(seq.cached)
        T = bucket(n, self.chunk_sizes if read == 0 else self.later_sizes)
        return StepShape(1, T, read, self.table_pages(read, T))

    def _read_pages(self, cached: int) -> int:
        """The pages a step reads for a row holding `cached` tokens: none, or the bucket that holds them."""
        return 0 if cached == 0 else bucket(self._pages_for(cached), self.read_buckets[1:])

    # --- admission -------------------------------------------------------------------------------------
    def fits(self, n_tokens: int) -> bool:
        """Whether a sequence of n_tokens can ever be held (the whole shard's pages at most)."""
        return -(-n_tokens // self.page_size) <= self.pool.capacity()

    def add(self, seq: Seq) -> None:
        self.waiting.append(seq)

    def live(self) -> list[Seq]:
        return [s for s in self.slot_seq if s is not None]

    def admit(self) -> None:
        """Give waiting sequences free slots, first come first served, each on the shard whose prefix cache
        holds most of it (then the one with most room); reused pages count as its cached tokens."""
        while self.waiting:
            seq = self.waiting[0]
            free = [b for b, s in enumerate(self.slot_seq) if s is None]
            if not free:
                return
            shards = sorted({b // self.per_shard for b in free},
                            key=lambda sh: (-len(self.pool.match(sh, seq.tokens, take=False)[0]) * seq.reuse,
                                            -self.pool.available(sh), sh))
            shard = shards[0]
            pages, keys = self.pool.match(shard, seq.tokens) if seq.reuse else ([], [])
            first = min(len(seq.tokens) - len(pages) * self.page_size, self.chunk)
            more = self.pool.take(shard, self._pages_for(len(pages) * self.page_size + first) - len(pages))
            if more is None:  # no room for its first chunk yet: wait (the running rows will finish)
                self.pool.release(pages)
                self.pool.hits -= len(pages) * self.page_size
                return
            self.waiting.popleft()
            seq.slot = next(b for b in free if b // self.per_shard == shard)
            seq.pages, seq.keys, seq.cached, seq.order = pages + more, keys, len(pages) * self.page_size, next(_ORDER)
            seq.new_slot = True
            self.slot_seq[seq.slot] = seq

    def _pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_size)

    # --- the next step ---------------------------------------------------------------------------------
    def plan(self) -> list[Call]:
        """The runner steps of one engine step: prompt chunks, then one decode over every decoding row.
        Pages for all of them are taken first (preempting where a shard runs out), then the calls are laid
        out from the rows still running."""
        live = self.live()
        decoding = [s for s in live if s.decoding]
        prefilling = sorted((s for s in live if not s.decoding and s.pending > 0), key=lambda s: s.order)
        fresh = [s for s in prefilling if s.cached == 0]
        batched = len(fresh) > 1 and not decoding  # nothing waits on this step: every first chunk in one batch
        # chunks: (seq, tokens, the step shape, or None for the smallest that holds them)
        if batched:
            chunks = [(s, min(s.pending, self.chunk), None) for s in fresh]
        elif decoding and self.stall_budget_s() is not None:
            chunks = self._timed_chunks(prefilling, decoding)
        else:
            limit = self.chunk if decoding else self.idle
            chunks, budget = [], limit
            for s in prefilling:
                n = min(s.pending, limit)
                if n > budget:
                    break
                chunks.append((s, n, None))
                budget -= n
        for s, n, _ in chunks + [(s, 1, None) for s in decoding]:
            if s.slot >= 0:
                self._grow(s, n)
        chunks = [c for c in chunks if c[0].slot >= 0]
        decoding = [s for s in decoding if s.slot >= 0]
        calls = []
        if batched and chunks:
            calls.append(self._call([(s, n) for s, n, _ in chunks], self.chunk, 0))
        else:
            for s, n, shape in chunks:
                shape = shape or self._chunk_shape(s, n)
                calls.append(self._call([(s, n)], shape.tokens, shape.read_pages))
        if decoding:
            calls.append(self._decode_call(decoding))
        return calls

    def plan_ragged(self) -> RaggedCall | None:
        """The one ragged step of this engine step (None when nothing runs): every decoding row, and prompt
        chunks first come first served, at most prefill_chunk tokens of them (idle_chunk while none decodes),
        each chunk counted in whole blocks. Pages are taken first (preempting where none are left).
        Speculative decoding: a step with no chunk, where every decoding row can be verified (its `draft` is
        not None) and some row has a draft, verifies the drafts (a verifying shape); a draft whose pages
        are not free is dropped (it never preempts)."""
        G = self.block
        live = self.live()
        decoding = [s for s in live if s.decoding and not s.final]
        prefilling = sorted((s for s in live if not s.decoding and s.pending > 0), key=lambda s: s.order)

        def each_shard(most=None):
            return [c for sh in range(self.shards) for c in self._ragged_chunks(
                [s for s in prefilling if s.slot // self.per_shard == sh], bool(decoding), most)]

        chunks = each_shard()
        if len(chunks) > 1 and self.spread_sizes:  # not one to spread: each shard's within the largest region
            chunks = each_shard(self.region_sizes[-1])
        verify = (self.spec and not chunks and all(s.draft is not None for s in decoding)
                  and any(s.draft for s in decoding))
        for s, n in chunks + [(s, 1) for s in decoding]:
            if s.slot >= 0:
                self._grow(s, n)
        drafts = {}
        if verify:
            for s in decoding:
                d = tuple(s.draft[:self.spec]) if s.slot >= 0 else ()
                if d and self._grow(s, 1 + len(d), preempt=False):
                    drafts[s.slot] = d
        fed = [(s, n) for s, n in chunks + [(s, 1 + len(drafts.get(s.slot, ()))) for s in decoding]
               if s.slot >= 0]
        if not fed:
            return None
        rows: list[tuple[Seq | None, int]] = [(None, 0)] * self.slots
        for s, n in fed:
            rows[s.slot] = (s, n)
        chunk_tokens = self.fullest_segment((s.slot, blocks_for(n, G) * G) for s, n in fed if n > 1)
        spread = None
        if self.spread_sizes and not drafts and sum(n > 1 for _, n in fed) == 1:  # a lone chunk: spread it
            spread, n = next((s.slot, n) for s, n in fed if n > 1)
            shape = self._spread_shape(bucket(-(-blocks_for(n, G) // self.shards), self.spread_sizes))
        elif drafts or chunk_tokens == 0:
            shape = self.decode_shape(self.fullest_segment((s.slot, n) for s, n in fed), verify=bool(drafts))
        else:
            shape = self._region_shape(bucket(chunk_tokens, self.region_sizes))
        return RaggedCall(shape, rows, drafts, spread)

    def _ragged_chunks(self, prefilling: list[Seq], decoding: bool, most: int | None = None
                       ) -> list[tuple[Seq, int]]:
        """A ragged step's chunks, (seq, tokens) each, first come first served: at most prefill_chunk tokens
        in whole blocks (idle_chunk while none decodes; at most `most` if given). Beside decoding rows, once
        `ragged_s` holds the steps' times, each chunk is the most tokens whose step, with the chunks before
        it, the model puts within RAGGED_FILL of a first chunk of prefill_chunk tokens (a later chunk re-reads
        its cached prefix); at least the smallest chunk of the first prompt waiting (it goes on)."""
        G = self.block
        left = max(G, min(self.chunk if decoding else self.idle, most or self.idle) // G * G)
        timed = decoding and bool(self.ragged_s)
        if timed:
            budget = RAGGED_FILL * self.ragged_time(self._first_region(), 0)
        chunks, used, reread = [], 0, 0
        for s in prefilling:
            n = min(s.pending, left)
            if n <= 0:
                break
            if timed:
                # The sizes that end on a region size, and the whole rest of the prompt.
                sizes = sorted({min(n, t - used) for t in self.region_sizes if t > used})
                fits = [m for m in sizes if self.ragged_time(used + blocks_for(m, G) * G,
                                                             max(reread, s.cached)) <= budget]
                if fits:
                    n = fits[-1]
                elif not chunks:
                    n = sizes[0]
                else:
                    break
            chunks.append((s, n))
            left -= blocks_for(n, G) * G
            used += blocks_for(n, G) * G
            reread = max(reread, s.cached)
            if n < s.pending:
                break
        return chunks

    def fullest_segment(self, rows) -> int:
        """The most tokens one shard's segment of a ragged step takes (the step's size per segment): rows =
        (slot, tokens) pairs, each counted in its slot's shard."""
        per = [0] * self.shards
        for slot, n in rows:
            per[slot // self.per_shard] += n
        return max(per)

    def decode_shape(self, tokens: int, verify: bool = False) -> RaggedShape:
        """The ragged shape of a step with no prompt chunk over `tokens` decode-region tokens in each segment
        (a verifying one: the decoding rows' tokens and their drafts)."""
        sizes = self.verify_sizes if verify else self.decode_sizes
        return RaggedShape(bucket(tokens, sizes), 0, self.block, self.slots, self.max_pages, verify, self.shards)

    def ragged_inputs(self, call: RaggedCall, batch: RaggedInput) -> None:
        """Fill a ragged step's inputs (a neutral RaggedInput) with the call's rows: the layout
        (k2jax.runtime.layout.lay_out), prompt lengths and resets; sets call.starts."""
        feeds = {}
        for b, (s, n) in enumerate(call.rows):
            if s is not None:
                d = call.drafts.get(b, ())
                feeds[b] = Feed(tuple(s.tokens[s.cached:s.cached + n - len(d)]) + d, s.cached, tuple(s.pages),
                                b == call.spread)
        for k, v in lay_out(call.shape, feeds).items():
            getattr(batch, k)[...] = v
        call.starts = {b: start for b, (_, start) in place(call.shape, feeds).items()}
        call.flat = flat_indices(call.shape, feeds)
        for b, (s, _) in enumerate(call.rows):
            if s is not None:
                batch.prompt_len[b] = s.prompt_len
                batch.reset[b] = s.new_slot

    def _decode_call(self, decoding: list[Seq]) -> Call:
        read = self._read_pages(max(s.cached for s in decoding))
        return self._call([(s, 1) for s in decoding], 1, read)

    def _timed_chunks(self, prefilling: list[Seq], decoding: list[Seq]) -> list[tuple[Seq, int, StepShape]]:
        """The chunks beside the decoding rows, (seq, tokens, step shape) each: first come first served, each
        the most tokens (at most prefill_chunk in all) whose step, with the chunks before it and the decode
        step, fits STALL_FILL of one first chunk's time, in the quickest shape that holds them (not always the
        smallest: the attention form, and so the cost, follows the size; k2jax.ops.attention.attend); at
        least the quickest chunk of the first prompt waiting."""
        left = STALL_FILL * self.stall_budget_s() - self.step_s.get(self._decode_call(decoding).shape, 0.0)
        tokens, chunks = self.chunk, []
        for s in prefilling:
            read = self._read_pages(s.cached)
            options = []  # (tokens, seconds, shape) for each size it could take
            for T in (self.chunk_sizes if s.cached == 0 else self.later_sizes):
                n = min(s.pending, T, tokens)
                shape = StepShape(1, T, read, self.table_pages(read, T))
                if n > 0 and shape in self.step_s:
                    options.append((n, self.step_s[shape], shape))
            fits = [o for o in options if o[1] <= left]
            if fits:
                n, sec, shape = max(fits, key=lambda o: (o[0], -o[1]))
            elif not chunks and options:
                n, sec, shape = min(options, key=lambda o: (o[1], -o[0]))
            elif not chunks:  # no time for any of its shapes: a whole chunk, as without the bound
                n = min(s.pending, tokens)
                sec, shape = 0.0, self._chunk_shape(s, n)
            else:
                break
            chunks.append((s, n, shape))
            left, tokens = left - sec, tokens - n
            if n < s.pending or tokens == 0:
                break
        return chunks

    def _grow(self, seq: Seq, n: int, preempt: bool = True) -> bool:
        """Pages for seq's next n tokens, preempting the newest sequences of its shard if none are left;
        False if seq itself was preempted (it waits again), or if none were left and not `preempt`."""
        shard = seq.slot // self.per_shard
        need = self._pages_for(seq.cached + n) - len(seq.pages)
        while need > 0:
            got = self.pool.take(shard, need)
            if got is not None:
                seq.pages += got
                return True
            if not preempt:
                return False
            victim = max((s for s in self.live() if s.slot // self.per_shard == shard), key=lambda s: s.order)
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def preempt(self, seq: Seq) -> None:
        """Free seq's pages and slot; it waits at the front of the queue, to be recomputed from its tokens."""
        self.pool.release(seq.pages)
        self.slot_seq[seq.slot] = None
        seq.pages, seq.keys, seq.cached, seq.slot = [], [], 0, -1
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def _call(self, rows: list[tuple[Seq, int]], T: int, read: int) -> Call:
        """Lay rows out for one step: shard-major buckets when several rows split over the shards, else one
        bucket (a lone row is replicated on every shard); filler rows feed nothing."""
        if self.shards > 1 and len(rows) > 1:
            return self._call_sharded(rows, T, read)
        B = bucket(len(rows), self.row_buckets)
        laid = rows + [(None, 0)] * (B - len(rows))
        return Call(StepShape(B, T, read, self.table_pages(read, T)), laid,
                    [s.slot // self.per_shard if s else 0 for s, _ in laid])

    def _call_sharded(self, rows, T, read) -> Call:
        by_shard = [[r for r in rows if r[0].slot // self.per_shard == sh] for sh in range(self.shards)]
        k = bucket(max(len(b) for b in by_shard), [b // self.shards for b in self.row_buckets if b >= self.shards])
        laid, shard_of = [], []
        for sh, rs in enumerate(by_shard):
            laid += rs + [(None, 0)] * (k - len(rs))
            shard_of += [sh] * k
        return Call(StepShape(self.shards * k, T, read, self.table_pages(read, T)), laid, shard_of)

    def inputs(self, call: Call, batch: StepInput) -> None:
        """Fill a rectangular step's inputs (a neutral StepInput) with the call's rows: tokens, counts,
        page tables, lengths, slots, prompt lengths. (Sampling settings and masks are the engine's.)"""
        W = call.shape.table_pages
        for i, ((seq, n), shard) in enumerate(zip(call.rows, call.shard_of_row)):
            batch.table[i] = self.pool.trash(shard)
            if seq is None:
                batch.slot[i] = shard * self.per_shard
                continue
            batch.slot[i] = seq.slot
            batch.tokens[i, :n] = seq.tokens[seq.cached:seq.cached + n]
            batch.count[i] = n
            batch.table[i, :min(W, len(seq.pages))] = seq.pages[:W]
            batch.lengths[i] = seq.cached
            batch.prompt_len[i] = seq.prompt_len
            batch.reset[i] = seq.new_slot  # its first step in this slot: the slot's state starts afresh

    def advance(self, call: Call | RaggedCall) -> None:
        """The call ran: each row's pages hold its fed tokens (drafts apart: see `verified`); index the full
        pages for reuse."""
        drafts = call.drafts if isinstance(call, RaggedCall) else {}
        for b, (seq, n) in enumerate(call.rows):
            if seq is not None and not seq.finished:  # (finished since: by the step before's token)
                seq.cached += n - len(drafts.get(b, ()))
                seq.new_slot = False
                self.pool.register(seq.slot // self.per_shard, seq.tokens[:seq.cached], seq.pages, seq.keys)

    def verified(self, seq: Seq, accepted: int) -> None:
        """seq's first `accepted` drafts were accepted (and are now its tokens): its pages hold them too."""
        if accepted and seq.slot >= 0:
            seq.cached += accepted
            self.pool.register(seq.slot // self.per_shard, seq.tokens[:seq.cached], seq.pages, seq.keys)

    def finish(self, seq: Seq) -> None:
        """seq is done (or cancelled): free its slot and let go of its pages (indexed ones stay cached)."""
        seq.finished = True
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq.slot >= 0 and self.slot_seq[seq.slot] is seq:
            self.slot_seq[seq.slot] = None
            self.pool.release(seq.pages)
            seq.pages, seq.slot = [], -1

    def ids(self) -> np.ndarray:
        return np.array([s.req.id if s else -1 for s in self.slot_seq])
