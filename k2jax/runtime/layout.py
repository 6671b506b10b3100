"""The runner's step shapes, and laying out a ragged step (k2jax.ops.ragged): which flat token belongs to
which row, at which position. Plain numpy, no jax: the scheduler plans with these.

A rectangular step's static shape is StepShape (k2jax.runtime.runner). A ragged step's is RaggedShape:
`decode` tokens in the decode region (one per decoding row; in a step with no chunk blocks a row may feed a
few consecutive ones there: its last sampled token and the tokens drafted after it, which the step verifies),
then `blocks` blocks of `block` tokens (each block one row's consecutive tokens), for `rows` rows with page
tables `table_pages` wide. `verify`: the step returns every decode-region token's sample (the verifying step
of speculative decoding), not only each row's last. Whatever the mix of decoding rows and prompt
chunks, a step takes the smallest shape that holds it, so a server compiles one program per shape, not per
(rows, tokens, cache length).

On a mesh whose data-parallel shards split the slots and the pool (k2jax.ops.paged), a ragged step has
`shards` segments of the flat batch, one per shard, each laid out as above over that shard's rows (rows
[s * B/S, (s + 1) * B/S)) with `decode` and `blocks` per segment: segment s is what shard s attends over, its
own rows and its own part of the pool. The metadata stays global (rows, flat indices).

A lone long prompt would fill one segment while the others idle at the same static size (every shard
computes its segment's tokens, padding or not). A shape with `spread` blocks instead gives each segment a
spread region after its chunk blocks, and one row's chunk (its Feed marked `spread`) is cut into pieces of
that region's size, one per segment, the last piece in the row's own shard's segment (where its logits are
read). Every segment attends to that row's cached prefix and to all its pieces (k2jax.ops.ragged brings
them), so its tokens are no longer consecutive in the flat batch: `place` gives the first.
"""

from __future__ import annotations

import dataclasses

import numpy as np

TRASH_PAGE = 0  # k2jax.ops.paged.TRASH_PAGE
DEFAULT_BLOCK = 16  # tokens per chunk block: a prompt chunk's padding is less than this
# A ragged step's fed token that is its row's last sampled one, read on the device from the step before's
# output (k2jax.runtime.runner): the host does not know it yet when it plans the step.
FROM_LAST = -1


@dataclasses.dataclass(frozen=True, order=True)
class StepShape:
    """The static shape of a rectangular step: rows, tokens per row, pages read per row, page-table width."""

    rows: int
    tokens: int
    read_pages: int
    table_pages: int

    @property
    def total_tokens(self) -> int:
        """Token positions the step computes (rows x tokens)."""
        return self.rows * self.tokens


@dataclasses.dataclass(frozen=True, order=True)
class RaggedShape:
    """The static shape of a ragged step: D decode tokens, M blocks of G tokens, B rows, W pages per row;
    verify: samples at every decode token (speculative decoding's verifying step; no chunk blocks); shards:
    the flat batch's segments, one per data-parallel shard, D and M being each segment's; spread: blocks of
    each segment's spread region, which holds a piece of one row's chunk (see the module docstring)."""

    decode: int
    blocks: int
    block: int
    rows: int
    table_pages: int
    verify: bool = False
    shards: int = 1
    spread: int = 0

    def __post_init__(self):
        if self.verify and (self.blocks or self.spread):
            raise ValueError("a verifying step has no chunk blocks")
        if self.shards < 1 or self.rows % self.shards:
            raise ValueError(f"{self.rows} rows do not split over {self.shards} shards")

    @property
    def segment(self) -> int:
        """Tokens in one shard's segment of the flat batch."""
        return self.decode + (self.blocks + self.spread) * self.block

    @property
    def spread_tokens(self) -> int:
        """Tokens in one segment's spread region (its last ones)."""
        return self.spread * self.block

    @property
    def tokens(self) -> int:
        """Tokens in the flat batch (every segment)."""
        return self.shards * self.segment

    @property
    def total_tokens(self) -> int:
        """Token positions the step computes (the flat batch)."""
        return self.tokens

    def one_shard(self) -> "RaggedShape":
        """The shape of one segment: its decode tokens and blocks over one shard's rows."""
        return dataclasses.replace(self, rows=self.rows // self.shards, shards=1)


class _Input:
    """What StepInput and RaggedInput share: fields replaced by name (numpy arrays here, device arrays once
    the runner has them), and `fields()` for the runner's pytree registration."""

    def replace(self, **changes):
        """A copy with `changes` (field -> new value); a name that is not a field raises TypeError."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))


@dataclasses.dataclass
class StepInput(_Input):
    """A rectangular step's inputs (k2jax.runtime.runner.Runner.step), per row b of B: its slot (the row of
    the per-slot sampling state), its next tokens [B, T] (a prefix of count[b] real ones), its page table
    [B, W] and the tokens it holds (lengths), its prompt's length (tokens past it are the row's own output:
    the penalties count them), whether its slot starts afresh (reset: a new request), the grammar's allowed
    tokens (bitmask [B, V / 32] int32, -1 = all), the tokens it has generated (step [B]: its draw's key and
    min_tokens; the rest of its sampling settings the runner keeps per slot on the device,
    Runner.set_sampling), and the token each fed token predicts, to be scored (targets [B, T], -1 = none)."""

    slot: np.ndarray
    tokens: np.ndarray
    count: np.ndarray
    table: np.ndarray
    lengths: np.ndarray
    prompt_len: np.ndarray
    reset: np.ndarray
    bitmask: np.ndarray
    step: np.ndarray
    targets: np.ndarray


@dataclasses.dataclass
class RaggedInput(_Input):
    """A ragged step's inputs: per flat token of T (`lay_out`'s) tokens, row, pos, valid and targets; per row
    b of B (= slot b) table [B, W], lengths, count, last (the flat index of its last fed token), prompt_len
    and reset; bitmask and step as StepInput's."""

    tokens: np.ndarray
    row: np.ndarray
    pos: np.ndarray
    valid: np.ndarray
    targets: np.ndarray
    table: np.ndarray
    lengths: np.ndarray
    count: np.ndarray
    last: np.ndarray
    prompt_len: np.ndarray
    reset: np.ndarray
    bitmask: np.ndarray
    step: np.ndarray


@dataclasses.dataclass(frozen=True)
class Feed:
    """One row's part of a step: the new tokens it feeds, how many tokens its pages already hold, its pages;
    spread: its tokens go in pieces to every segment's spread region (at most one row a step)."""

    tokens: tuple[int, ...]
    cached: int
    pages: tuple[int, ...]
    spread: bool = False


def blocks_for(n: int, block: int) -> int:
    """Blocks a chunk of n tokens takes."""
    return -(-n // block)


def _segments(shape: RaggedShape, feeds: dict[int, Feed]):
    """(shard, its first row, its first flat token, its rows' feeds with rows local) for each shard."""
    Bs, Ts = shape.rows // shape.shards, shape.segment
    for b in feeds:
        if not 0 <= b < shape.rows:
            raise ValueError(f"row {b} is outside the step's {shape.rows} rows")
    for s in range(shape.shards):
        yield s, s * Bs, s * Ts, {b - s * Bs: f for b, f in feeds.items() if b // Bs == s and not f.spread}


def _spread_row(shape: RaggedShape, feeds: dict[int, Feed]) -> int | None:
    """The row whose chunk is spread over the segments (None: none), checked to fit."""
    rows = [b for b, f in feeds.items() if f.spread]
    if not rows:
        return None
    if len(rows) > 1:
        raise ValueError(f"rows {rows[0]} and {rows[1]} are both spread: a step spreads at most one row")
    b, n = rows[0], len(feeds[rows[0]].tokens)
    if not 0 <= b < shape.rows:
        raise ValueError(f"row {b} is outside the step's {shape.rows} rows")
    if not shape.spread:
        raise ValueError(f"row {b} is spread, but the step's shape has no spread region")
    if n > shape.shards * shape.spread_tokens:
        raise ValueError(f"row {b}'s {n} tokens do not fit the spread regions: {shape.shards} of "
                         f"{shape.spread_tokens} tokens")
    return b


def spread_pieces(shape: RaggedShape, row: int, n: int) -> list[tuple[int, int, int]]:
    """Where the spread row's n tokens go: (flat index, index of its first token in the chunk, tokens) per
    piece, in the chunk's order; the last piece is in the row's own shard's segment."""
    X, S, Ts = shape.spread_tokens, shape.shards, shape.segment
    p = -(-n // X)
    owner = row // (shape.rows // S)
    return [((owner - p + 1 + j) % S * Ts + Ts - X, j * X, min(X, n - j * X)) for j in range(p)]


def place(shape: RaggedShape, feeds: dict[int, Feed]) -> dict[int, tuple[str, int]]:
    """Where each fed row's tokens go: {row: ("decode", first flat index) or ("chunk", first flat index)}.
    Rows of one token take their segment's decode region while it has room, the others whole blocks in row
    order; a shape with no blocks takes every row in its decode region (a row's tokens consecutive). Raises
    ValueError naming what does not fit. The spread row: ("spread", its first token's flat index)."""
    spread = _spread_row(shape, feeds)
    where = {}
    if spread is not None:
        where[spread] = ("spread", spread_pieces(shape, spread, len(feeds[spread].tokens))[0][0])
    if shape.shards > 1:
        one = shape.one_shard()
        return where | {b0 + b: (kind, t0 + i) for _, b0, t0, local in _segments(shape, feeds)
                        for b, (kind, i) in _place(one, local, b0).items()}
    return where | _place(shape, {b: f for b, f in feeds.items() if not f.spread}, 0)


def _place(shape: RaggedShape, feeds: dict[int, Feed], first_row: int) -> dict[int, tuple[str, int]]:
    where, d, m = {}, 0, 0
    for b in sorted(feeds):
        n = len(feeds[b].tokens)
        if not 0 <= b < shape.rows:
            raise ValueError(f"row {b} is outside the step's {shape.rows} rows")
        if n == 0:
            continue
        if (n == 1 or shape.blocks == 0) and d + n <= shape.decode:
            where[b] = ("decode", d)
            d += n
            continue
        if shape.blocks == 0:
            raise ValueError(f"row {first_row + b}'s {n} tokens do not fit: {shape.decode - d} of the "
                             f"{shape.decode} decode tokens left")
        k = blocks_for(n, shape.block)
        if m + k > shape.blocks:
            raise ValueError(f"row {first_row + b}'s {n} tokens do not fit: {shape.blocks - m} of {shape.blocks} "
                             f"blocks of {shape.block} left")
        where[b] = ("chunk", shape.decode + m * shape.block)
        m += k
    return where


def flat_indices(shape: RaggedShape, feeds: dict[int, Feed]) -> dict[int, np.ndarray]:
    """{row: the flat indices of its fed tokens, in order} (consecutive from `place`'s, but a spread row's)."""
    out = {}
    for b, (kind, first) in place(shape, feeds).items():
        n = len(feeds[b].tokens)
        if kind == "spread":
            out[b] = np.concatenate([t + np.arange(k) for t, _, k in spread_pieces(shape, b, n)])
        else:
            out[b] = first + np.arange(n)
    return out


def lay_out(shape: RaggedShape, feeds: dict[int, Feed]) -> dict[str, np.ndarray]:
    """The step's metadata for k2jax.ops.ragged.RaggedCache and the model call: tokens, row, pos [T] int32,
    valid [T] bool; table [B, W] int32 (unfed rows: the trash page), lengths [B] int32 (tokens held before
    the step), count [B] int32 (tokens fed) and last [B] int32 (the flat index of each fed row's last token:
    where its logits are read; its segment's first token for an unfed row). Padding tokens belong to their
    segment's first row and are not valid, but in the spread regions, whose tokens all belong to the spread
    row (row 0 without one). Rows and flat indices are global (over every segment)."""
    spread = _spread_row(shape, feeds)
    if shape.shards == 1:
        out = _lay_out(shape, {b: f for b, f in feeds.items() if not f.spread})
    else:
        one = shape.one_shard()
        parts = []
        for _, b0, t0, local in _segments(shape, feeds):
            part = _lay_out(one, local, b0)
            part["row"] += b0
            part["last"] += t0
            parts.append(part)
        out = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    X = shape.spread_tokens
    if X:
        region = (np.arange(shape.tokens) % shape.segment) >= shape.segment - X
        out["row"][region] = 0 if spread is None else spread
    if spread is not None:
        f = feeds[spread]
        n = len(f.tokens)
        if len(f.pages) > shape.table_pages:
            raise ValueError(f"row {spread} holds {len(f.pages)} pages; the step's tables are "
                             f"{shape.table_pages} wide")
        for t, i, k in spread_pieces(shape, spread, n):
            out["tokens"][t:t + k] = f.tokens[i:i + k]
            out["pos"][t:t + k] = f.cached + i + np.arange(k)
            out["valid"][t:t + k] = True
            out["last"][spread] = t + k - 1
        out["count"][spread] = n
        out["table"][spread, :len(f.pages)] = f.pages  # the rest: the trash page (no part placed the row)
        out["lengths"][spread] = f.cached
    return out


def _lay_out(shape: RaggedShape, feeds: dict[int, Feed], first_row: int = 0) -> dict[str, np.ndarray]:
    T, B, W = shape.tokens, shape.rows, shape.table_pages
    out = {"tokens": np.zeros(T, np.int32), "row": np.zeros(T, np.int32), "pos": np.zeros(T, np.int32),
           "valid": np.zeros(T, bool), "table": np.full((B, W), TRASH_PAGE, np.int32),
           "lengths": np.zeros(B, np.int32), "count": np.zeros(B, np.int32), "last": np.zeros(B, np.int32)}
    for b, (_, start) in _place(shape, feeds, first_row).items():
        f = feeds[b]
        n = len(f.tokens)
        if len(f.pages) > W:
            raise ValueError(f"row {first_row + b} holds {len(f.pages)} pages; the step's tables are {W} wide")
        span = slice(start, start + n)
        out["tokens"][span] = f.tokens
        out["row"][span] = b
        out["pos"][span] = f.cached + np.arange(n)
        out["valid"][span] = True
        if n % shape.block and start >= shape.decode:  # the rest of its last block: padding of its row
            out["row"][start + n:start + blocks_for(n, shape.block) * shape.block] = b
        out["count"][b], out["last"][b] = n, start + n - 1
    for b, f in feeds.items():
        out["table"][b, :len(f.pages)] = f.pages
        out["lengths"][b] = f.cached
    return out
