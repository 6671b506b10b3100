"""The pool's pages on the host: which are free, which rows hold which, and the prefix cache.

Pages have global ids; the pool is cut into `shards` equal parts (one per data-parallel shard, see
k2jax.ops.paged), the first page of each part being its trash page, never handed out. A row takes pages
from its own shard's part.

Prefix cache: every full page of a sequence is indexed by the hash chain of its tokens (page i's key =
blake2b(key of page i-1, its tokens)), per shard. A new sequence whose first pages' keys are in the index
reuses those pages instead of computing them again. Pages are reference-counted (each row holding one counts
once); a page no row holds stays cached, and is evicted least-recently-used when the shard needs room. Only
full pages are shared, so no row ever writes into a page another row reads.

Plain Python: no jax.
"""

from __future__ import annotations

import collections
import hashlib
from typing import Sequence

import numpy as np


class PagePool:
    """Pages of one shard-split pool: free lists, reference counts, and the prefix index.

    num_pages: the pool's pages (a multiple of shards); page_size: tokens per page; prefix: whether to
    index full pages for reuse (False: pages are freed as soon as no row holds them).
    """

    def __init__(self, num_pages: int, shards: int, page_size: int, prefix: bool = True):
        if num_pages % shards or num_pages // shards < 2:
            raise ValueError(f"a pool of {num_pages} pages cannot give {shards} shards a trash page and room")
        self.num_pages, self.shards, self.page_size, self.prefix = num_pages, shards, page_size, prefix
        self.per_shard = num_pages // shards
        self._free = [collections.deque(range(s * self.per_shard + 1, (s + 1) * self.per_shard))
                      for s in range(shards)]
        self._refs = np.zeros(num_pages, np.int32)
        self._key_of: dict[int, bytes] = {}  # page -> its key, for indexed pages
        self._index: list[dict[bytes, int]] = [{} for _ in range(shards)]  # key -> page, per shard
        # Indexed pages no row holds, least recently used first: evicted in this order.
        self._idle: list[collections.OrderedDict[int, None]] = [collections.OrderedDict() for _ in range(shards)]
        self.hits = 0  # prompt tokens served from the cache (a counter for /metrics)

    # --- counts ------------------------------------------------------------------------------------
    def trash(self, shard: int) -> int:
        """The shard's trash page (page-table filler)."""
        return shard * self.per_shard

    def capacity(self) -> int:
        """Pages one row can ever hold: its shard's, but the trash page."""
        return self.per_shard - 1

    def available(self, shard: int) -> int:
        """Pages the shard can hand out now: free ones plus cached ones no row holds."""
        return len(self._free[shard]) + len(self._idle[shard])

    def free_count(self) -> int:
        return sum(len(f) for f in self._free)

    def cached_count(self) -> int:
        """Indexed pages (held by rows or idle)."""
        return len(self._key_of)

    def in_use_count(self) -> int:
        """Pages some row holds."""
        return int((self._refs > 0).sum())

    def shard_of(self, page: int) -> int:
        return page // self.per_shard

    # --- taking and giving back ----------------------------------------------------------------------
    def take(self, shard: int, n: int) -> list[int] | None:
        """n pages for one row (reference count 1 each), evicting idle cached pages as needed; None (and
        nothing taken) if the shard does not have n available."""
        if n > self.available(shard):
            return None
        out = []
        for _ in range(n):
            if self._free[shard]:
                page = self._free[shard].popleft()
            else:  # evict the least recently used cached page no row holds
                page, _ = self._idle[shard].popitem(last=False)
                del self._index[shard][self._key_of.pop(page)]
            self._refs[page] = 1
            out.append(page)
        return out

    def release(self, pages: Sequence[int]) -> None:
        """A row lets go of its pages (in order). Indexed pages become idle, the most recently used ones
        (evicted last), the sequence's last page first (so its tail is evicted before its head); the
        others return to the free list."""
        for page in reversed(pages):
            self._refs[page] -= 1
            if self._refs[page] > 0:
                continue
            shard = self.shard_of(page)
            if page in self._key_of:
                self._idle[shard][page] = None
            else:
                self._free[shard].append(page)

    # --- the prefix index ----------------------------------------------------------------------------
    def keys(self, tokens: Sequence[int], n_pages: int, start: bytes = b"") -> list[bytes]:
        """The hash chain of the first n_pages full pages of `tokens`."""
        out, key, Y = [], start, self.page_size
        for i in range(n_pages):
            key = hashlib.blake2b(key + np.asarray(tokens[i * Y:(i + 1) * Y], np.int64).tobytes(),
                                  digest_size=16).digest()
            out.append(key)
        return out

    def match(self, shard: int, tokens: Sequence[int], take: bool = True) -> tuple[list[int], list[bytes]]:
        """The cached pages holding the longest run of `tokens`' first full pages on this shard, at most
        (len(tokens) - 1) // page_size of them (a row must compute at least its last token to get logits),
        and their keys; with take, each gains a reference (the row holds them). ([], []) without the cache."""
        if not self.prefix:
            return [], []
        pages, keys = [], []
        for key in self.keys(tokens, (len(tokens) - 1) // self.page_size):
            page = self._index[shard].get(key)
            if page is None:
                break
            pages.append(page)
            keys.append(key)
        if take:
            for page in pages:
                if self._refs[page] == 0:
                    del self._idle[shard][page]
                self._refs[page] += 1
            self.hits += len(pages) * self.page_size
        return pages, keys

    def register(self, shard: int, tokens: Sequence[int], pages: Sequence[int], keys: list[bytes]) -> None:
        """Index a row's full pages past the `keys` it has (its hash chain so far, extended in place):
        pages[i] holds tokens[i*Y:(i+1)*Y] for every full page of `tokens` (whose latents are written). A key
        another page already holds stays with that page (this one is freed when its row lets go)."""
        if not self.prefix:
            return
        full = min(len(tokens) // self.page_size, len(pages))
        done = len(keys)
        if full <= done:
            return
        new = self.keys(tokens[done * self.page_size:], full - done, keys[-1] if keys else b"")
        for i, key in enumerate(new, done):
            if key not in self._index[shard] and pages[i] not in self._key_of:
                self._index[shard][key] = pages[i]
                self._key_of[pages[i]] = key
        keys.extend(new)
