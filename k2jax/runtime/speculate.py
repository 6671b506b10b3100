"""Speculative decoding's proposers: what a decoding row feeds after its last sampled token, for the next
step to verify (k2jax.runtime.runner: a verifying ragged step samples at each fed token and keeps the drafts
up to the first one the model does not agree with). Plain Python and numpy, no jax.

A proposer is anything with `propose(tokens, k) -> list[int]` (at most k ids following `tokens`, the row's
prompt and output so far): the step does not change with where drafts come from, so a draft model fits the
same interface.

`NgramProposer` is prompt lookup (vLLM's "ngram" method): the row's last n tokens (n from `max_n` down to
`min_n`) are looked up earlier in its own prompt and output; the k tokens that followed their latest earlier
occurrence are the draft. Agents' outputs repeat their inputs (code edits, quotes, JSON of tool results), and
so do cycles of a greedy model.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

METHODS = ("ngram",)


class Proposer(Protocol):
    def propose(self, tokens: Sequence[int], k: int) -> list[int]: ...


class NgramProposer:
    """Prompt lookup over the last `window` tokens of a row (a bound on the host's work per step)."""

    def __init__(self, max_n: int = 3, min_n: int = 2, window: int = 8192):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes must satisfy 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        if window <= max_n:
            raise ValueError(f"the lookup window ({window} tokens) must be longer than max_n ({max_n})")
        self.max_n, self.min_n, self.window = max_n, min_n, window

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k ids that followed the latest earlier occurrence of the longest suffix of `tokens` (of
        max_n down to min_n ids) that occurs earlier; [] when none does (or k <= 0)."""
        if k <= 0 or len(tokens) < self.min_n + 1:
            return []
        ids = np.asarray(tokens[-self.window:], np.int64)
        L = len(ids)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            # Starts i < L - n of an earlier occurrence of the last n ids (the suffix itself excluded).
            hit = ids[:L - n] == ids[L - n]
            for j in range(1, n):
                hit &= ids[j:L - n + j] == ids[L - n + j]
            starts = np.flatnonzero(hit)
            if len(starts):
                i = int(starts[-1]) + n  # the latest: what follows it
                return ids[i:i + k].tolist()
        return []


def make(method: str | None, **kw) -> Proposer | None:
    """The proposer of `method` (None: no speculation). Raises ValueError naming an unknown method."""
    if method is None:
        return None
    if method == "ngram":
        return NgramProposer(**kw)
    raise ValueError(f"speculative method {method!r} is not known; choose from {', '.join(METHODS)}")
