"""Structured output: token masks from a grammar, through llguidance.

Why llguidance and not xgrammar: xgrammar's wheel requires torch, transformers and triton, and imports torch
when loaded (its matcher module) -- k2jax's serving code never imports torch and does not install it.
llguidance has no Python dependencies, reads a tiktoken vocabulary as it is, fills numpy int32 bitmasks,
and names special tokens in grammars (`<|tool_call_begin|>`), which K2's tool-call format needs.

Pieces:
- `GrammarTokenizer(tokenizer, vocab_size)`: llguidance's view of a KimiTokenizer (every id's bytes; the
  special tokens by name) over the MODEL's vocab of V ids; ids the tokenizer lacks are never allowed.
  Stop tokens: <|im_end|> and [EOS] (tokenizer.stop_ids).
- `GrammarCompiler(gtok)`: `for_request(response_format=, tools=, tool_choice=)` -> a `Grammar` or None;
  or `json_object()`, `json_schema(schema, strict)`, `tool_calls(tools, name=None)`. Compiled grammars are
  cached by their canonical JSON key (LRU); each request gets a cheap copy of a cached, already-built matcher.
- `Grammar.matcher()` -> `GrammarMatcher`, one per request: `fill_bitmask(row)`, `accept(id)`,
  `is_terminated()`, `rollback(n)`.

Bitmask layout (llguidance's and the sampler's): int32 words, W = ceil(V/32) per row; bit j of word w
(`(row[w] >> j) & 1`) allows token 32*w + j. Rows of requests without a grammar are all ones (-1).

Termination: once the grammar's text is complete, the mask allows the stop tokens (and whatever may still
extend the text, e.g. JSON whitespace is bounded to 16 characters per gap); once nothing can extend it, the
mask allows ONLY the stop tokens, so the request ends with <|im_end|> or [EOS]. `accept(stop id)` then makes
`is_terminated()` true. A rejected token (accept -> False) puts the matcher in an error state whose mask
allows only the stop tokens; `error` says why.

JSON: `strict` schemas are compiled strictly (an unsupported keyword -> ValueError); others leniently
(unsupported keywords ignored). Object properties come in the schema's order (llguidance's rule).
Reasoning: with `reasoning=True` the grammar first admits `<think>…</think>` (K2-Thinking; optional), or with
`reasoning_at_start=True` requires reasoning text closed by `</think>` (the prompt opened `<think>`);
`<think>` is matched as a special token when the tokenizer has one by that name, else as text.
"""

from __future__ import annotations

import collections
import json
import re
import threading
from collections.abc import Sequence

import llguidance
import numpy as np

from k2jax.serving.chat_template import validate_tools
from k2jax.tokenizer import PAT_STR

WHITESPACE = r"[\x20\x0A\x0D\x09]{0,16}"  # any JSON whitespace, at most 16 characters between two tokens
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")  # OpenAI's function-name rule (plus '.')
CALL_INDEX = r"/0|[1-9][0-9]{0,5}/"


class GrammarTokenizer:
    """llguidance's tokenizer for a KimiTokenizer, over the model's vocab size V (>= the tokenizer's)."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: Sequence[int] | None = None):
        """`tokenizer`: k2jax.tokenizer.KimiTokenizer. `vocab_size`: the model's V (logits width).
        `stop_ids`: ids that end the output (default tokenizer.stop_ids)."""
        if vocab_size < tokenizer.vocab_size:
            raise ValueError(f"vocab_size: the model's vocab ({vocab_size}) is smaller than the tokenizer's "
                             f"({tokenizer.vocab_size})")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.stop_ids = tuple(int(i) for i in (tokenizer.stop_ids if stop_ids is None else stop_ids))
        self.special_names = frozenset(tokenizer.special_tokens)
        self.ll = llguidance.LLTokenizer.from_tiktoken(
            encoder=tokenizer.mergeable_ranks, special_tokens=tokenizer.special_tokens, pattern=PAT_STR,
            eos_token=list(self.stop_ids), n_vocab=vocab_size)
        # Words of the mask that may be set: ids past the tokenizer (model padding) never are.
        valid = np.zeros(self.words * 32, dtype=bool)
        valid[:tokenizer.vocab_size] = True
        self.valid_words = pack_bits(valid)


def pack_bits(allowed_V: np.ndarray) -> np.ndarray:
    """bool [n] -> int32 [ceil(n/32)] in the bitmask layout (bit j of word w = id 32*w + j)."""
    n = allowed_V.shape[0]
    padded = np.zeros(((n + 31) // 32) * 32, dtype=np.uint64)
    padded[:n] = allowed_V
    words = (padded.reshape(-1, 32) << np.arange(32, dtype=np.uint64)).sum(axis=1)
    return words.astype(np.uint32).view(np.int32)


def unpack_bits(bitmask_W: np.ndarray, vocab_size: int) -> np.ndarray:
    """int32 [W] bitmask -> bool [vocab_size] (True = allowed)."""
    bits = (bitmask_W.astype(np.int64)[:, None] >> np.arange(32)) & 1
    return bits.reshape(-1)[:vocab_size].astype(bool)


class GrammarMatcher:
    """One request's grammar state. Not thread-safe; one per request."""

    def __init__(self, matcher: "llguidance.LLMatcher", gtok: GrammarTokenizer, grammar: "Grammar"):
        self._m = matcher
        self._gtok = gtok
        self.grammar = grammar
        self._terminated = False

    def fill_bitmask(self, row_W: np.ndarray) -> None:
        """Write the allowed next tokens into row_W (int32 [W], C-contiguous, W = ceil(V/32))."""
        if row_W.dtype != np.int32 or row_W.shape != (self._gtok.words,) or not row_W.flags["C_CONTIGUOUS"]:
            raise ValueError(f"bitmask row: need a contiguous int32 array of shape ({self._gtok.words},), got "
                             f"{row_W.dtype} {row_W.shape}")
        self._m.unsafe_compute_mask_ptr(row_W.ctypes.data, row_W.nbytes)
        row_W &= self._gtok.valid_words

    def accept(self, token_id: int) -> bool:
        """Advance by the sampled token; False (and the error state) if the grammar does not allow it."""
        token_id = int(token_id)
        if not 0 <= token_id < self._gtok.tokenizer.vocab_size:
            return False
        ok = self._m.consume_token(token_id)
        if ok and token_id in self._gtok.stop_ids:
            self._terminated = True
        return ok

    def is_terminated(self) -> bool:
        """Whether a stop token was accepted (the output is finished and satisfies the grammar)."""
        return self._terminated

    def can_stop(self) -> bool:
        """Whether the text so far is a complete sentence of the grammar (a stop token is allowed now)."""
        return self._m.is_accepting()

    def rollback(self, num_tokens: int) -> bool:
        """Undo the last num_tokens accepted tokens (speculative decoding); True on success."""
        ok = self._m.rollback(int(num_tokens))
        if ok and num_tokens > 0:
            self._terminated = False
        return ok

    @property
    def error(self) -> str | None:
        """Why the matcher is in its error state, or None."""
        return self._m.get_error() if self._m.is_error() else None


def fill_bitmasks(rows: Sequence[tuple[GrammarMatcher, int]], bitmask_BW: np.ndarray,
                  executor: "llguidance.LLExecutor | None" = None) -> None:
    """Fill several rows of a [B, W] int32 bitmask at once (in parallel threads); rows not listed are left
    as they are (set them to -1 for requests without a grammar)."""
    if not rows:
        return
    if bitmask_BW.dtype != np.int32 or bitmask_BW.ndim != 2 or not bitmask_BW.flags["C_CONTIGUOUS"]:
        raise ValueError("bitmask: need a contiguous int32 [B, W] array")
    gtok = rows[0][0]._gtok
    if bitmask_BW.shape[1] != gtok.words:
        raise ValueError(f"bitmask: W must be {gtok.words}, got {bitmask_BW.shape[1]}")
    executor = executor or _executor()
    executor.unsafe_compute_mask_ptr([(m._m, i) for m, i in rows], bitmask_BW.ctypes.data,
                                     gtok.words * 4, bitmask_BW.shape[0])
    for _, i in rows:
        bitmask_BW[i] &= gtok.valid_words


_EXECUTOR = None


def _executor() -> "llguidance.LLExecutor":
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = llguidance.LLExecutor()
    return _EXECUTOR


class Grammar:
    """A compiled grammar: `matcher()` gives a fresh per-request matcher."""

    def __init__(self, key: str, lark: str, prototype: "llguidance.LLMatcher", gtok: GrammarTokenizer):
        self.key = key
        self.lark = lark
        self._prototype = prototype
        self._gtok = gtok

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._prototype.deep_copy(), self._gtok, self)


def _schema_with_options(schema, strict: bool) -> dict:
    if schema is True or schema is None:
        schema = {}
    if not isinstance(schema, dict):
        raise TypeError(f"a JSON schema must be an object, got {type(schema).__name__}")
    opts = dict(schema.get("x-guidance") or {})
    opts.setdefault("whitespace_pattern", WHITESPACE)
    opts["lenient"] = not strict
    return {**schema, "x-guidance": opts}


class GrammarCompiler:
    """Compiles and caches grammars for one GrammarTokenizer (thread-safe)."""

    def __init__(self, gtok: GrammarTokenizer, cache_size: int = 256):
        self.gtok = gtok
        self.cache_size = cache_size
        self._cache: collections.OrderedDict[str, Grammar] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0
        think = "<think>" in gtok.special_names and "</think>" in gtok.special_names
        # Reasoning text before the constrained part (see the module doc).
        if think:
            self._think_open = 'think: <think> THINK_TEXT </think>\nTHINK_TEXT: /(.|\\n)*/\n'
            self._think_rest = 'think_rest: THINK_TEXT </think>\nTHINK_TEXT: /(.|\\n)*/\n'
        else:
            self._think_open = 'think: "<think>" think_text\nthink_text[lazy]: /(.|\\n)*<\\/think>/\n'
            self._think_rest = 'think_rest: think_text\nthink_text[lazy]: /(.|\\n)*<\\/think>/\n'

    # --------------------------------------------------------------------------------------- entry points
    def for_request(self, *, response_format: dict | None = None, tools: list[dict] | None = None,
                    tool_choice=None, reasoning: bool = False, reasoning_at_start: bool = False,
                    parallel: bool = True) -> Grammar | None:
        """The grammar an OpenAI chat request asks for, or None (unconstrained).

        tool_choice "required" -> at least one call of one of `tools` (exactly one when not `parallel`, the
        request's parallel_tool_calls: false); {"type": "function", "function": {"name": N}} -> exactly one
        call of N; both with arguments per the tool's `parameters` schema (strict when the tool says
        `strict: true`). Otherwise response_format {"type": "json_object"} -> a JSON object;
        {"type": "json_schema", "json_schema": {"schema": S, "strict": b}} -> JSON matching S; "text"/None ->
        None. tool_choice "auto"/"none"/None never constrains. ValueError names the bad field."""
        if tool_choice is not None and tool_choice not in ("auto", "none"):
            if not tools:
                raise ValueError("tool_choice: forcing a tool call needs `tools`")
            if tool_choice == "required":
                return self.tool_calls(tools, parallel=parallel, reasoning=reasoning,
                                       reasoning_at_start=reasoning_at_start)
            if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
                name = (tool_choice.get("function") or {}).get("name")
                if not isinstance(name, str):
                    raise ValueError("tool_choice.function.name: required")
                return self.tool_calls(tools, name=name, reasoning=reasoning, reasoning_at_start=reasoning_at_start)
            raise ValueError(f"tool_choice: must be 'none', 'auto', 'required' or "
                             f"{{'type': 'function', 'function': {{'name': ...}}}}; got {tool_choice!r}")
        if response_format is None:
            return None
        if not isinstance(response_format, dict):
            raise ValueError("response_format: must be an object")
        kind = response_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return self.json_object(reasoning=reasoning, reasoning_at_start=reasoning_at_start)
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise ValueError("response_format.json_schema.schema: required (a JSON schema object)")
            return self.json_schema(spec["schema"], strict=bool(spec.get("strict")), reasoning=reasoning,
                                    reasoning_at_start=reasoning_at_start, param="response_format.json_schema.schema")
        raise ValueError(f"response_format.type: must be 'text', 'json_object' or 'json_schema'; got {kind!r}")

    def json_object(self, **reasoning) -> Grammar:
        """Any JSON object."""
        return self.json_schema({"type": "object"}, strict=False, param="response_format", **reasoning)

    def json_schema(self, schema: dict, strict: bool = False, *, reasoning: bool = False,
                    reasoning_at_start: bool = False, param: str = "schema") -> Grammar:
        """JSON text matching `schema` (draft 2020-12 as llguidance supports it)."""
        try:
            body = "start_body: %json " + json.dumps(_schema_with_options(schema, strict)) + "\n"
        except TypeError as e:
            raise ValueError(f"{param}: {e}") from None
        return self._compile(("json", schema, strict, reasoning, reasoning_at_start), body, reasoning,
                             reasoning_at_start, param)

    def tool_calls(self, tools: list[dict], name: str | None = None, *, parallel: bool = True,
                   reasoning: bool = False, reasoning_at_start: bool = False) -> Grammar:
        """A K2 tool-call section: with `name`, exactly one call of that function; else one or more calls of
        any of `tools` (exactly one when not `parallel`). Each call: <|tool_call_begin|>functions.NAME:IDX
        <|tool_call_argument_begin|>{JSON per the tool's parameters}<|tool_call_end|>."""
        validate_tools(tools)
        chosen = []
        for i, t in enumerate(tools):
            fn = t["function"]
            if not FUNCTION_NAME.fullmatch(fn["name"]):
                raise ValueError(f"tools[{i}].function.name: must match {FUNCTION_NAME.pattern}")
            if name is None or fn["name"] == name:
                chosen.append(fn)
        if not chosen:
            raise ValueError(f"tool_choice.function.name: no tool named {name!r} in tools")
        lines = []
        for i, fn in enumerate(chosen):
            schema = _schema_with_options(fn.get("parameters") or {"type": "object"}, bool(fn.get("strict")))
            lines.append(f'call_{i}: <|tool_call_begin|> "functions.{fn["name"]}:" CALL_INDEX '
                         f'<|tool_call_argument_begin|> args_{i} <|tool_call_end|>')
            lines.append(f"args_{i}: %json {json.dumps(schema)}")
        calls = " | ".join(f"call_{i}" for i in range(len(chosen)))
        repeat = "+" if name is None and parallel else ""
        body = (f"start_body: <|tool_calls_section_begin|> call{repeat} <|tool_calls_section_end|>\n"
                f"call: {calls}\n" + "\n".join(lines) + f"\nCALL_INDEX: {CALL_INDEX}\n")
        key = ("tools", [{"name": f["name"], "parameters": f.get("parameters"), "strict": bool(f.get("strict"))}
                         for f in chosen], name, bool(repeat), reasoning, reasoning_at_start)
        return self._compile(key, body, reasoning, reasoning_at_start, "tools")

    # ------------------------------------------------------------------------------------------ internals
    def _compile(self, key_parts, body: str, reasoning: bool, reasoning_at_start: bool, param: str) -> Grammar:
        # Not key-sorted: llguidance keeps the schema's property order, so schemas differing only in order differ.
        key = json.dumps(key_parts, default=str)
        with self._lock:
            if key in self._cache:
                self.hits += 1
                self._cache.move_to_end(key)
                return self._cache[key]
        if reasoning_at_start:
            lark = "start: think_rest start_body\n" + self._think_rest + body
        elif reasoning:
            lark = "start: think? start_body\n" + self._think_open + body
        else:
            lark = "start: start_body\n" + body
        prototype = llguidance.LLMatcher(self.gtok.ll, llguidance.LLMatcher.grammar_from_lark(lark), log_level=0)
        if prototype.is_error():
            raise ValueError(f"{param}: cannot be compiled to a grammar: {prototype.get_error()}")
        grammar = Grammar(key, lark, prototype, self.gtok)
        with self._lock:
            self.misses += 1
            self._cache[key] = grammar
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return grammar
