"""A request's types, jax-free: its sampling settings, what it reports after each engine step, and the
request itself as the engine holds it (k2jax.runtime.engine). The HTTP layer builds and reads these."""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Callable


class QueueFull(Exception):
    """The waiting queue is at its limit: try again later."""


class EngineStopped(Exception):
    """A step failed and the engine stopped: it ended every request ("abort") and takes no more."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request settings. temperature 0 = greedy; top_k 0 = all; stop_ids end the output (not included in
    the text); stop strings are matched on the detokenized text and cut from it (neither before min_tokens).
    The penalties count the request's own generated tokens (repetition_penalty the prompt's too);
    logit_bias: (token id, bias in [-100, 100]) pairs, at most 300; logprobs None = none, k >= 0 = the
    sampled token's logprob and the top k (k <= 20), from the distribution sampled from
    (k2jax.runtime.sampling). grammar: a structured-output spec the engine's grammar compiler turns into a
    per-request token mask ({"response_format": ..., "tools": ..., "tool_choice": ...}; JSON-able, so that
    every process of a multi-host server builds the same mask). prompt_logprobs None = none, k >= 0 = each
    prompt token's logprob (from the second on) under the model's own log-softmax, its rank and the top k
    ids there (k <= 20), computed in the prompt's own chunks (k2jax.runtime.runner); such a request reads
    nothing from the prefix cache (its prompt is computed whole, so every position is scored) and may ask
    for max_tokens 0 (the prompt scored, nothing generated)."""

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
    grammar: dict | None = None
    prompt_logprobs: int | None = None

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


@dataclasses.dataclass
class Event:
    """What a request gets after each of its engine steps: new text and token ids; finish_reason set on the
    last one ("stop" | "length" | "cancelled" | "abort" | "error"). logprobs (when params.logprobs is not
    None): one {"token_id", "logprob", "top": [[token_id, logprob], ...]} per token of token_ids.
    prompt_logprobs (when params.prompt_logprobs is not None, on the request's first event that follows its
    prompt): one {"token_id", "logprob", "rank", "top"} per prompt token from the second on."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    logprobs: list[dict] | None = None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    prompt_logprobs: list[dict] | None = None


@dataclasses.dataclass(eq=False)
class Request:
    prompt: list[int]
    params: SamplingParams
    on_event: Callable[[Event], None]
    id: int = dataclasses.field(default_factory=lambda: next(_IDS))
    arrived: float = dataclasses.field(default_factory=time.perf_counter)
    # engine-side state
    seq: object = None  # its k2jax.runtime.scheduler.Seq while the engine holds it (the scheduler imports this)
    detok: object = None  # its k2jax.runtime.detok.Detokenizer, made at its first token
    matcher: object = None  # its grammar matcher (structured output), made at submission
    out: list[int] = dataclasses.field(default_factory=list)  # generated ids (stop id included)
    first_token_at: float = 0.0
    cached_tokens: int = 0
    finished: bool = False
    prompt_lp: list[dict] = dataclasses.field(default_factory=list)  # prompt_lp[p]: prompt token p + 1's
    prompt_lp_sent: bool = False


_IDS = itertools.count()
