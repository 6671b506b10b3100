"""The serving engine's settings (k2jax.runtime.engine.Engine): one frozen dataclass, checked when made, that
`k2jax serve` builds from its flags and tests and `generate` build directly. Plain Python, no jax."""

from __future__ import annotations

import dataclasses

DEFAULT_PAGE_SIZE = 64  # tokens per page of the paged cache


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """What an Engine runs with (the model, params, mesh and the text and grammar helpers apart).

    - `max_batch` slots (rows decoded together; rounded up to a multiple of the data-parallel shards); at
      most `max_len` tokens per request; `max_queue` requests waiting before submit refuses more.
    - The pool: `kv_tokens` tokens of paged latent cache (None: the engine's default_kv_tokens) in pages of
      `page_size` tokens, in `kv_cache_dtype` ("auto": the params' dtype; k2jax.runtime.cache.KV_DTYPES);
      `prefix_cache`: reuse the full pages of earlier prompts.
    - `batch_wait_s`: how long `run` lets a burst arriving at an idle engine gather.
    - `prefill_chunk`: most prompt tokens per step while requests decode (their stall); `idle_chunk`: most
      while none does (None: 4 x prefill_chunk; at most max_len). `stall_bound`: warm_up also times the
      steps, and the chunks beside decoding rows are cut so that a step takes no longer than a first chunk of
      prefill_chunk tokens, in powers of two down to `min_chunk` tokens; False: chunks of prefill_chunk
      whatever they cost. Ragged steps are timed per chunk region, over no cached prefix and a long one.
    - `ragged` (the default): each engine step is one ragged step (k2jax.ops.ragged) over every decoding row
      and the prompt chunks that fit (on a mesh, one segment per data-parallel shard); False: the
      rectangular steps.
    - `overlap` (ragged steps, the default): the engine plans and sends a step before it reads the step
      before's tokens, which the new step takes on the device (its decoding rows' fed tokens); the host's
      work for one step runs while the device runs the other. A request with a grammar keeps it (its
      mask, which needs its last token, goes with a sampler sent after the pass); with speculative
      decoding, a step that verifies drafts is read before the next is sent (drafts follow the last token).
    - `speculative` ("ngram", ragged steps only; see k2jax.runtime.speculate, whose lookup takes suffixes of
      `prompt_lookup` = (min, max) tokens): decoding rows feed up to `num_speculative_tokens` drafted tokens,
      which the step verifies (see Engine).
    """

    max_batch: int = 8
    max_len: int = 4096
    max_queue: int = 256
    kv_tokens: int | None = None
    page_size: int = DEFAULT_PAGE_SIZE
    kv_cache_dtype: str = "auto"
    prefix_cache: bool = True
    batch_wait_s: float = 0.0
    prefill_chunk: int = 512
    idle_chunk: int | None = None
    stall_bound: bool = True
    min_chunk: int = 64
    ragged: bool = True
    overlap: bool = True
    speculative: str | None = None
    num_speculative_tokens: int = 0
    prompt_lookup: tuple[int, int] = (2, 3)

    def __post_init__(self):
        if (self.max_batch < 1 or self.max_len < 2 or self.prefill_chunk < 1 or self.page_size < 1
                or (self.idle_chunk is not None and self.idle_chunk < 1)):
            raise ValueError(f"max_batch ({self.max_batch}), prefill_chunk ({self.prefill_chunk}), idle_chunk "
                             f"({self.idle_chunk}) and page_size ({self.page_size}) must be >= 1 and max_len "
                             f"({self.max_len}) >= 2")
        if self.kv_tokens is not None and self.kv_tokens < 1:
            raise ValueError(f"kv_tokens must be >= 1, got {self.kv_tokens}")
        if self.speculative is not None and not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16] with speculative decoding, got "
                             f"{self.num_speculative_tokens}")
        if self.speculative is not None and self.ragged is False:
            raise ValueError("speculative decoding verifies drafts in a ragged step: it needs ragged steps")

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)
