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
"""

from __future__ import annotations

import dataclasses

import numpy as np

TRASH_PAGE = 0  # k2jax.ops.paged.TRASH_PAGE
DEFAULT_BLOCK = 16  # tokens per chunk block: a prompt chunk's padding is less than this


@dataclasses.dataclass(frozen=True, order=True)
class StepShape:
    """The static shape of a rectangular step: rows, tokens per row, pages read per row, page-table width."""

    rows: int
    tokens: int
    read_pages: int
    table_pages: int


@dataclasses.dataclass(frozen=True, order=True)
class RaggedShape:
    """The static shape of a ragged step: D decode tokens, M blocks of G tokens, B rows, W pages per row;
    verify: samples at every decode token (speculative decoding's verifying step; no chunk blocks)."""

    decode: int
    blocks: int
    block: int
    rows: int
    table_pages: int
    verify: bool = False

    def __post_init__(self):
        if self.verify and self.blocks:
            raise ValueError("a verifying step has no chunk blocks")

    @property
    def tokens(self) -> int:
        return self.decode + self.blocks * self.block


@dataclasses.dataclass(frozen=True)
class Feed:
    """One row's part of a step: the new tokens it feeds, how many tokens its pages already hold, its pages."""

    tokens: tuple[int, ...]
    cached: int
    pages: tuple[int, ...]


def blocks_for(n: int, block: int) -> int:
    """Blocks a chunk of n tokens takes."""
    return -(-n // block)


def place(shape: RaggedShape, feeds: dict[int, Feed]) -> dict[int, tuple[str, int]]:
    """Where each fed row's tokens go: {row: ("decode", first flat index) or ("chunk", first flat index)}.
    Rows of one token take the decode region while it has room, the others whole blocks in row order; a
    shape with no blocks takes every row in its decode region (a row's tokens consecutive). Raises
    ValueError naming what does not fit."""
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
            raise ValueError(f"row {b}'s {n} tokens do not fit: {shape.decode - d} of the {shape.decode} decode "
                             f"tokens left")
        k = blocks_for(n, shape.block)
        if m + k > shape.blocks:
            raise ValueError(f"row {b}'s {n} tokens do not fit: {shape.blocks - m} of {shape.blocks} blocks of "
                             f"{shape.block} left")
        where[b] = ("chunk", shape.decode + m * shape.block)
        m += k
    return where


def lay_out(shape: RaggedShape, feeds: dict[int, Feed]) -> dict[str, np.ndarray]:
    """The step's metadata for k2jax.ops.ragged.RaggedCache and the model call: tokens, row, pos [T] int32,
    valid [T] bool; table [B, W] int32 (unfed rows: the trash page), lengths [B] int32 (tokens held before
    the step), count [B] int32 (tokens fed) and last [B] int32 (the flat index of each fed row's last token:
    where its logits are read; 0 for an unfed row). Padding tokens belong to row 0 and are not valid."""
    T, B, W = shape.tokens, shape.rows, shape.table_pages
    out = {"tokens": np.zeros(T, np.int32), "row": np.zeros(T, np.int32), "pos": np.zeros(T, np.int32),
           "valid": np.zeros(T, bool), "table": np.full((B, W), TRASH_PAGE, np.int32),
           "lengths": np.zeros(B, np.int32), "count": np.zeros(B, np.int32), "last": np.zeros(B, np.int32)}
    for b, (_, start) in place(shape, feeds).items():
        f = feeds[b]
        n = len(f.tokens)
        if len(f.pages) > W:
            raise ValueError(f"row {b} holds {len(f.pages)} pages; the step's tables are {W} wide")
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
