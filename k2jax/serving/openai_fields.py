"""OpenAI request bodies -> what the engine runs: the prompts, one SamplingParams per choice, and the response
options. Every field is either understood or refused with a 400 that names it (BadRequest.param), never
ignored: unknown fields and OpenAI fields this server does not implement are refused.

Semantics are OpenAI's, with vLLM's extensions (`top_k`, `min_p`, `repetition_penalty`, `min_tokens`,
`stop_token_ids`, `ignore_eos`, `skip_special_tokens`, chat's `chat_template_kwargs`). A chat request's
messages, tools, tool_choice, parallel_tool_calls, response_format and chat_template_kwargs are read by
k2jax.serving.chat_request (Job.chat). `n` choices of one prompt sample with seeds derived
from the request's `seed` (`choice_seed`); a request without a seed gets a random 63-bit one.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import secrets

from k2jax.serving import chat_request
from k2jax.serving.chat_request import AGENT_FIELDS, ChatSetup, FieldError
from k2jax.serving.chat_template import ChatTemplate
from k2jax.runtime.requests import SamplingParams

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_LOGPROBS = 20  # top logprobs per token, as vLLM's default max_logprobs
MAX_LOGIT_BIAS = 300  # entries, as OpenAI
MAX_STOP = 4  # stop strings, as OpenAI
SEED_MOD = 2**63
GOLDEN_64 = 0x9E3779B97F4A7C15  # 2^64 / golden ratio, odd: distinct choices get distinct seeds mod 2^32 too

COMMON_FIELDS = frozenset({
    "model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "presence_penalty",
    "frequency_penalty", "logit_bias", "seed", "user",
    # vLLM's extensions
    "top_k", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids", "ignore_eos", "skip_special_tokens",
    "prompt_logprobs"})
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "logprobs", "echo", "best_of", "suffix"}
CHAT_FIELDS = COMMON_FIELDS | AGENT_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs",
                                                  "metadata", "store", "service_tier", "modalities"}
# OpenAI fields this server knows and does not implement (a clearer message than "unknown field").
NOT_IMPLEMENTED = {
    "suffix": "text insertion (suffix) is not supported",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "functions": "deprecated by OpenAI and not supported: send `tools` (type \"function\") instead",
    "function_call": "deprecated by OpenAI and not supported: send `tool_choice` instead",
    "reasoning_effort": "not supported: K2 has no effort levels; turn reasoning off with chat_template_kwargs "
                        "{\"thinking\": false}",
}
# SamplingParams field -> the request field that sets it, where the names differ.
REQUEST_NAME = {"stop_ids": "stop_token_ids"}


class BadRequest(Exception):
    """An OpenAI-style error: status, message, the offending field (param) and an optional code."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


@dataclasses.dataclass
class Limits:
    """What the server can run: vocabulary, cache length, most choices at once."""

    vocab_size: int
    max_len: int
    max_choices: int


@dataclasses.dataclass
class Job:
    """A parsed request. prompts[j] with params[j]; choice index j * n + i samples with choice_seed(seed, i)."""

    prompts: list[list[int]]
    prompt_texts: list[str | None]  # the text a prompt was given as (echo), None for token ids
    params: list[SamplingParams]
    n: int
    echo: bool = False
    stream: bool = False
    include_usage: bool = False
    chat_logprobs: bool = False  # chat's format: logprobs.content[], top_logprobs as lists
    chat: ChatSetup | None = None  # a chat request's prompt, grammar and output parsing
    echo_logprobs: bool = False  # completions' echo with logprobs: the prompt's tokens lead the logprobs
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs field: the top k beside each prompt token

    def choices(self):
        """-> [(index, prompt index, SamplingParams)] in index order."""
        return [(j * self.n + i, j, dataclasses.replace(p, seed=choice_seed(p.seed, i)))
                for j, p in enumerate(self.params) for i in range(self.n)]


def choice_seed(seed: int, i: int) -> int:
    """The seed of choice i of a request with `seed`: the seed itself for choice 0, then steps of 2^64 /
    golden ratio, mod 2^63 (so a single request with that seed gives the same choice)."""
    return (seed + i * GOLDEN_64) % SEED_MOD


# --- field readers ------------------------------------------------------------------------------------

def number(body, name, default, lo=None, hi=None, lo_open=False, integer=False):
    v = body.get(name)
    if v is None:
        return default
    ok_type = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok_type:
        raise BadRequest(f"{name}: expected {'an integer' if integer else 'a number'}, got {v!r}", name)
    if not math.isfinite(v):
        raise BadRequest(f"{name}: must be a finite number, got {v}", name)
    if (lo is not None and (v <= lo if lo_open else v < lo)) or (hi is not None and v > hi):
        rng = f"{'(' if lo_open else '['}{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise BadRequest(f"{name}: must be in {rng}, got {v}", name)
    return v


def flag(body, name, default=False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise BadRequest(f"{name}: expected true or false, got {v!r}", name)
    return v


def string(body, name):
    v = body.get(name)
    if v is not None and not isinstance(v, str):
        raise BadRequest(f"{name}: expected a string, got {v!r}", name)
    return v


def check_fields(body: dict, allowed: frozenset) -> None:
    """400 for the first field the endpoint does not know (or knows and does not implement)."""
    for k in body:
        if k in NOT_IMPLEMENTED:
            raise BadRequest(f"{k}: {NOT_IMPLEMENTED[k]}", k)
        if k not in allowed:
            raise BadRequest(f"{k}: unknown field for this endpoint (refused rather than ignored)", k)


def token_ids(v, name, vocab) -> list[int]:
    if not isinstance(v, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in v):
        raise BadRequest(f"{name}: expected a list of token ids", name)
    if any(not 0 <= t < vocab for t in v):
        raise BadRequest(f"{name}: token ids must be in [0, {vocab})", name)
    return list(v)


# --- prompts ------------------------------------------------------------------------------------------

def completion_prompts(body, tok, limits: Limits) -> tuple[list[list[int]], list[str | None]]:
    """prompt: a string, a list of strings, a list of token ids, or a list of lists of token ids."""
    p = body.get("prompt")
    if p is None:
        raise BadRequest("prompt: required", "prompt")
    if isinstance(p, str) or (isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)
                                                              for t in p)):
        p = [p]
    if not isinstance(p, list) or not p or not all(isinstance(x, str) or isinstance(x, list) for x in p):
        raise BadRequest("prompt: expected a string, a list of strings, a list of token ids or a list of lists "
                         "of token ids", "prompt")
    ids, texts = [], []
    for x in p:
        if isinstance(x, str):
            if tok is None:
                raise BadRequest("prompt: text needs a tokenizer (--tokenizer DIR); send token ids instead",
                                 "prompt")
            ids.append(tok.encode(x))
            texts.append(x)
        else:
            ids.append(token_ids(x, "prompt", limits.vocab_size))
            texts.append(None)
        check_prompt(ids[-1], limits, "prompt")
    return ids, texts


def check_prompt(ids, limits: Limits, field):
    if not ids:
        raise BadRequest(f"{field}: empty", field)
    if any(not 0 <= t < limits.vocab_size for t in ids):
        raise BadRequest(f"{field}: token ids must be in [0, {limits.vocab_size})", field)
    if len(ids) >= limits.max_len:
        raise BadRequest(f"{field}: {len(ids)} tokens; this server's max_len is {limits.max_len} (prompt and "
                         f"completion together)", field, code="context_length_exceeded")


# --- the request as a whole ----------------------------------------------------------------------------

def parse_completion(body: dict, tok, limits: Limits) -> Job:
    """A /v1/completions body -> Job."""
    check_fields(body, COMPLETION_FIELDS)
    prompts, texts = completion_prompts(body, tok, limits)
    n = number(body, "n", 1, lo=1, integer=True)
    best_of = number(body, "best_of", None, lo=1, integer=True)
    if best_of is not None and best_of != n:
        raise BadRequest(f"best_of: only best_of == n is supported (got best_of {best_of}, n {n}): this server "
                         f"does not rank candidates", "best_of")
    echo = flag(body, "echo")
    logprobs = number(body, "logprobs", None, lo=0, hi=MAX_LOGPROBS, integer=True)
    if echo and tok is None and any(t is None for t in texts):
        raise BadRequest("echo: token-id prompts need a tokenizer (--tokenizer DIR) to be echoed as text", "echo")
    top = prompt_top(body, logprobs if echo else None)
    params = [sampling(body, len(p), tok, limits, chat=False, logprobs=logprobs, prompt_logprobs=top)
              for p in prompts]
    job = Job(prompts, texts, params, n, echo=echo, echo_logprobs=echo and logprobs is not None,
              prompt_logprobs=body.get("prompt_logprobs"), **stream_options(body))
    check_choices(job, limits)
    return job


def parse_chat(body: dict, tok, limits: Limits, template: ChatTemplate | None = None, grammars=None) -> Job:
    """A /v1/chat/completions body -> Job: one prompt, `template` (default: the built-in K2 template) over the
    messages and tools; `grammars` (a GrammarCompiler; None refuses constrained requests) for tool_choice
    required / a named function and response_format (k2jax.serving.chat_request)."""
    check_fields(body, CHAT_FIELDS)
    if tok is None:
        raise BadRequest("chat needs a tokenizer: start the server with --tokenizer DIR", "messages")
    skip = flag(body, "skip_special_tokens", True)
    try:
        setup = chat_request.chat_setup(body, tok, template or _builtin_template(), grammars, skip)
    except FieldError as e:
        raise BadRequest(str(e), e.param) from None
    check_prompt(setup.prompt, limits, "messages")
    n = number(body, "n", 1, lo=1, integer=True)
    want = flag(body, "logprobs")
    top = number(body, "top_logprobs", None, lo=0, hi=MAX_LOGPROBS, integer=True)
    if top is not None and not want:
        raise BadRequest("top_logprobs: needs logprobs: true", "top_logprobs")
    string(body, "service_tier")
    if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
        raise BadRequest("metadata: expected an object", "metadata")
    if flag(body, "store"):
        raise BadRequest("store: stored completions are not supported", "store")
    mods = body.get("modalities")
    if mods is not None and mods != ["text"]:
        raise BadRequest(f"modalities: only [\"text\"] is supported, got {mods!r}", "modalities")
    params = sampling(body, len(setup.prompt), tok, limits, chat=True, logprobs=(top or 0) if want else None,
                      prompt_logprobs=prompt_top(body, None))
    # A parsed output is detokenized with special-token names (the parsers read the markers; the setup hides
    # them again as the client asked).
    # The grammar also gets the budget (a section of parallel calls closes within max_tokens).
    grammar = None if setup.grammar is None else {**setup.grammar, "max_tokens": params.max_tokens}
    params = dataclasses.replace(params, grammar=grammar,
                                 skip_special_tokens=params.skip_special_tokens and not setup.parses)
    job = Job([setup.prompt], [None], [params], n, chat_logprobs=True, chat=setup,
              prompt_logprobs=body.get("prompt_logprobs"), **stream_options(body))
    check_choices(job, limits)
    return job


@functools.lru_cache(maxsize=1)
def _builtin_template() -> ChatTemplate:
    return ChatTemplate.from_tokenizer_dir(None)


def stream_options(body) -> dict:
    stream = flag(body, "stream")
    opts = body.get("stream_options")
    if opts is None:
        return {"stream": stream, "include_usage": False}
    if not stream:
        raise BadRequest("stream_options: only allowed with stream: true", "stream_options")
    if not isinstance(opts, dict):
        raise BadRequest("stream_options: expected an object", "stream_options")
    for k in opts:
        if k != "include_usage":
            raise BadRequest(f"stream_options.{k}: unknown option (only include_usage)", "stream_options")
    return {"stream": True, "include_usage": flag(opts, "include_usage")}


def check_choices(job: Job, limits: Limits) -> None:
    k = job.n * len(job.prompts)
    if k > limits.max_choices:
        raise BadRequest(f"n: {job.n} choices x {len(job.prompts)} prompts = {k} sequences; this server runs at "
                         f"most {limits.max_choices} at once (--max-batch + --max-queue)", "n")


def prompt_top(body, echo_logprobs: int | None) -> int | None:
    """How many top ids beside each prompt token the request needs (vLLM's prompt_logprobs field, or
    completions' echo with logprobs: that many), or None when it scores no prompt."""
    k = number(body, "prompt_logprobs", None, lo=0, hi=MAX_LOGPROBS, integer=True)
    if k is None:
        return echo_logprobs
    return k if echo_logprobs is None else max(k, echo_logprobs)


def sampling(body, n_prompt, tok, limits: Limits, chat: bool, logprobs: int | None,
             prompt_logprobs: int | None = None) -> SamplingParams:
    """The SamplingParams of one prompt (seed: the request's, or a random one). max_tokens may be 0 when the
    prompt is scored (prompt_logprobs, or echo with logprobs): the answer is the prompt's logprobs alone."""
    room = limits.max_len - n_prompt
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    least = 0 if prompt_logprobs is not None else 1
    if body.get(key) == 0 and least:
        raise BadRequest(f"{key}: 0 is only allowed when the prompt is scored (echo with logprobs, or "
                         f"prompt_logprobs); otherwise it must be >= 1", key)
    max_tokens = number(body, key, room if chat else min(DEFAULT_COMPLETION_MAX_TOKENS, room), lo=least,
                        integer=True)
    if max_tokens > room:
        raise BadRequest(f"{key}: prompt ({n_prompt} tokens) + {key} ({max_tokens}) exceeds this server's "
                         f"max_len of {limits.max_len} tokens", key, code="context_length_exceeded")
    seed = number(body, "seed", None, lo=-2**63, hi=2**63 - 1, integer=True)
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stop = tuple(stop)
    else:
        raise BadRequest("stop: expected a string or a list of strings", "stop")
    if any(s == "" for s in stop):
        raise BadRequest("stop: empty stop strings are not allowed", "stop")
    if len(stop) > MAX_STOP:
        raise BadRequest(f"stop: at most {MAX_STOP} stop strings (OpenAI's limit), got {len(stop)}", "stop")
    stop_ids = token_ids(body.get("stop_token_ids") or [], "stop_token_ids", limits.vocab_size)
    if not flag(body, "ignore_eos") and tok is not None:
        stop_ids = stop_ids + [t for t in (tok.stop_ids if chat else [tok.eos_id]) if t not in stop_ids]
    string(body, "user")
    string(body, "model")
    min_tokens = number(body, "min_tokens", 0, lo=0, integer=True)
    if min_tokens > max_tokens:
        raise BadRequest(f"min_tokens: {min_tokens} > max_tokens ({max_tokens})", "min_tokens")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=float(number(body, "temperature", 1.0, lo=0)),  # OpenAI's default
        top_p=float(number(body, "top_p", 1.0, lo=0, hi=1, lo_open=True)),
        top_k=max(int(number(body, "top_k", 0, lo=-1, hi=limits.vocab_size, integer=True)), 0),
        min_p=float(number(body, "min_p", 0.0, lo=0, hi=1)),
        seed=secrets.randbits(63) if seed is None else seed % SEED_MOD,
        presence_penalty=float(number(body, "presence_penalty", 0.0, lo=-2, hi=2)),
        frequency_penalty=float(number(body, "frequency_penalty", 0.0, lo=-2, hi=2)),
        repetition_penalty=float(number(body, "repetition_penalty", 1.0, lo=0, lo_open=True)),
        logit_bias=logit_bias(body, limits.vocab_size),
        min_tokens=min_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        stop_ids=tuple(stop_ids),
        stop=stop,
        skip_special_tokens=flag(body, "skip_special_tokens", True))
    return params


def logit_bias(body, vocab) -> tuple[tuple[int, float], ...]:
    """{"token id": bias in [-100, 100]} (at most 300) -> sorted (id, bias) pairs."""
    v = body.get("logit_bias")
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise BadRequest("logit_bias: expected an object mapping token ids to biases", "logit_bias")
    if len(v) > MAX_LOGIT_BIAS:
        raise BadRequest(f"logit_bias: at most {MAX_LOGIT_BIAS} entries, got {len(v)}", "logit_bias")
    out = {}
    for k, b in v.items():
        try:
            t = int(k)
        except (TypeError, ValueError):
            raise BadRequest(f"logit_bias: key {k!r} is not a token id", "logit_bias") from None
        if not 0 <= t < vocab:
            raise BadRequest(f"logit_bias: token id {t} not in [0, {vocab})", "logit_bias")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
            raise BadRequest(f"logit_bias: the bias of {k} must be a number in [-100, 100], got {b!r}", "logit_bias")
        out[t] = float(b)
    return tuple(sorted(out.items()))
