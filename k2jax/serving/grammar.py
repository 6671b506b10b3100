"""Structured output: token masks from a grammar, through llguidance.

Why llguidance and not xgrammar: xgrammar's wheel requires torch, transformers and triton, and imports torch
when loaded (its matcher module) -- k2jax's serving code never imports torch and does not install it.
llguidance has no Python dependencies, reads a tiktoken vocabulary as it is, fills numpy int32 bitmasks,
and names special tokens in grammars (`<|tool_call_begin|>`), which K2's tool-call format needs.

Pieces:
- `GrammarTokenizer(tokenizer, vocab_size)`: llguidance's view of a KimiTokenizer (every id's bytes; the
  special tokens by name) over the MODEL's vocab of V ids; ids the tokenizer lacks are never allowed.
  Stop tokens: <|im_end|> and [EOS] (tokenizer.stop_ids).
- `GrammarCompiler(gtok, whitespace="compact")`: `for_request(response_format=, tools=, tool_choice=, ...)` ->
  a `Grammar` or None; or `json_object()`, `json_schema(schema, strict)`, `tool_calls(tools, name=None)`.
  Compiled grammars are cached by their canonical JSON key (LRU); each request gets a cheap copy of a cached,
  already-built matcher.
- `Grammar.matcher()` -> `GrammarMatcher`, one per request: `fill_bitmask(row)`, `accept(id)`,
  `is_terminated()`, `rollback(n)`.

Bitmask layout (llguidance's and the sampler's): int32 words, W = ceil(V/32) per row; bit j of word w
(`(row[w] >> j) & 1`) allows token 32*w + j. Rows of requests without a grammar are all ones (-1).

Termination: once the grammar's text is complete, the mask allows the stop tokens (and whatever may still
extend the text); once nothing can extend it, the mask allows ONLY the stop tokens, so the request ends with
<|im_end|> or [EOS]. `accept(stop id)` then makes `is_terminated()` true. A rejected token (accept -> False)
puts the matcher in an error state whose mask allows only the stop tokens; `error` says why.

JSON whitespace between tokens (response_format and tool arguments; inside strings the text is the model's):
"compact" (the default) allows none (`{"a":1,"b":[1,2]}`); "spaced" one optional space after each `:` and `,`
(`{"a": 1, "b": [1, 2]}`, the form json.dumps writes and models are trained on); "any" any JSON whitespace,
at most 16 characters per gap. A free model pads every gap the grammar leaves open (a random one spends its
whole budget on `\r` runs), so the bound is on by default. None is the default, not one optional space: the
random demo model writes a space wherever one is allowed, as a token of its own, which makes 13% of a
schema's answer whitespace tokens. `--json-whitespace` (the server's default) or `"json_whitespace"` (a
request's) chooses.
JSON: `strict` schemas are compiled strictly (an unsupported keyword -> ValueError); others leniently
(unsupported keywords ignored). Object properties come in the schema's order (llguidance's rule).

Tool calls (K2's section, k2jax.serving.tool_calls): every call's id is fixed by the grammar to
`functions.NAME:IDX`, IDX counting on from `call_offset` (the conversation's earlier calls) in call order, so
the model never writes the digits. tool_choice "required" -> a section of one or more calls, a named
function -> exactly one call of it, "auto" -> any text (tool-call markers and stop tokens apart), then
optionally one section (with a JSON response_format: that JSON, or one section); with parallel_tool_calls
false a section holds exactly one call, else at most MAX_PARALLEL_CALLS. After the section only a stop token may follow, so generation stops there. With the
request's `max_tokens` given (the budget), a section starts no further call once fewer tokens are left than
CALL_ROOM (2) times its longest call so far plus one for the section's end: a section of parallel calls
closes within the budget instead of being cut in the middle of a call (a first call longer than the whole
budget still is: then the response ends with finish_reason "length").
Reasoning: with `reasoning=True` the grammar first admits `<think>…</think>` (K2-Thinking; optional), or with
`reasoning_at_start=True` requires reasoning text closed by `</think>` (the prompt opened `<think>`);
`<think>` is matched as a special token when the tokenizer has one by that name, else as text.
"""

from __future__ import annotations

import collections
import json
import threading
from collections.abc import Sequence

import llguidance
import numpy as np

from k2jax.serving.chat_template import validate_tools
from k2jax.serving.tool_calls import ARGUMENT_BEGIN, CALL_BEGIN, CALL_END, MARKERS, SECTION_BEGIN, SECTION_END
from k2jax.tokenizer import PAT_STR

# JSON whitespace per mode (see the module doc), as llguidance's "x-guidance" options.
WHITESPACE = {
    "compact": {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"},
    "spaced": {"whitespace_flexible": False, "item_separator": ", ?", "key_separator": ": ?"},
    "any": {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,16}"},
}
_WHITESPACE_KEYS = ("whitespace_flexible", "whitespace_pattern", "item_separator", "key_separator")
MAX_PARALLEL_CALLS = 16  # calls one section may hold under a grammar (parallel_tool_calls true)
# Room a section keeps for one more call, in multiples of its longest call so far: the next one may be longer
# (other arguments, or the same text in more tokens).
CALL_ROOM = 2


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
        # The tool-call markers that are special tokens here (K2's are): the budget rule reads two of them.
        self.markers = {m: tokenizer.special_tokens[m] for m in MARKERS if m in tokenizer.special_tokens}
        self.call_begin = self.markers.get(CALL_BEGIN)
        self.section_end = self.markers.get(SECTION_END[0])


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
    """One request's grammar state. Not thread-safe; one per request. `budget`: the request's max_tokens (the
    tool-call budget rule of the module doc), None = no rule."""

    def __init__(self, matcher: "llguidance.LLMatcher", gtok: GrammarTokenizer, grammar: "Grammar",
                 budget: int | None = None):
        self._m = matcher
        self._gtok = gtok
        self.grammar = grammar
        self.budget = budget
        self._terminated = False
        self._ids: list[int] = []  # accepted ids (the budget rule measures the calls in them)
        self._call_start: int | None = None  # where the open call began
        self._longest_call = 0  # tokens of the longest finished call, its begin and end markers included

    def fill_bitmask(self, row_W: np.ndarray) -> None:
        """Write the allowed next tokens into row_W (int32 [W], C-contiguous, W = ceil(V/32))."""
        if row_W.dtype != np.int32 or row_W.shape != (self._gtok.words,) or not row_W.flags["C_CONTIGUOUS"]:
            raise ValueError(f"bitmask row: need a contiguous int32 array of shape ({self._gtok.words},), got "
                             f"{row_W.dtype} {row_W.shape}")
        self._m.unsafe_compute_mask_ptr(row_W.ctypes.data, row_W.nbytes)
        self._finish_mask(row_W)

    def _finish_mask(self, row_W: np.ndarray) -> None:
        """The model's padding ids out, and the budget rule: between two calls (where the section may end or
        another call begin) no new call once the tokens left cannot hold CALL_ROOM times the longest so far
        and the section's end."""
        row_W &= self._gtok.valid_words
        begin, end = self._gtok.call_begin, self._gtok.section_end
        if self.budget is None or begin is None or end is None or not self._longest_call:
            return
        left = self.budget - len(self._ids)
        if _bit(row_W, begin) and _bit(row_W, end) and left < CALL_ROOM * self._longest_call + 1:
            row_W[begin // 32] &= ~np.int32(np.uint32(1 << (begin % 32)).view(np.int32))

    def accept(self, token_id: int) -> bool:
        """Advance by the sampled token; False (and the error state) if the grammar does not allow it."""
        token_id = int(token_id)
        if not 0 <= token_id < self._gtok.tokenizer.vocab_size:
            return False
        ok = self._m.consume_token(token_id)
        if ok:
            self._ids.append(token_id)
            self._track_call(token_id, len(self._ids) - 1)
            if token_id in self._gtok.stop_ids:
                self._terminated = True
        return ok

    def _track_call(self, token_id: int, at: int) -> None:
        if token_id == self._gtok.call_begin:
            self._call_start = at
        elif token_id == self._gtok.markers.get(CALL_END) and self._call_start is not None:
            self._longest_call = max(self._longest_call, at - self._call_start + 1)
            self._call_start = None

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
            ids = self._ids[:len(self._ids) - num_tokens]
            self._ids, self._call_start, self._longest_call = [], None, 0
            for i, t in enumerate(ids):  # the call lengths of what is left
                self._ids.append(t)
                self._track_call(t, i)
        return ok

    @property
    def error(self) -> str | None:
        """Why the matcher is in its error state, or None."""
        return self._m.get_error() if self._m.is_error() else None


def _bit(row_W: np.ndarray, i: int) -> bool:
    return bool((int(row_W[i // 32]) >> (i % 32)) & 1)


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
    for m, i in rows:
        m._finish_mask(bitmask_BW[i])


_EXECUTOR = None


def _executor() -> "llguidance.LLExecutor":
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = llguidance.LLExecutor()
    return _EXECUTOR


class Grammar:
    """A compiled grammar: `matcher()` gives a fresh per-request matcher. `budget`: what for_request's
    max_tokens bound it to (the matchers' budget)."""

    def __init__(self, key: str, lark: str, prototype: "llguidance.LLMatcher", gtok: GrammarTokenizer,
                 budget: int | None = None):
        self.key = key
        self.lark = lark
        self._prototype = prototype
        self._gtok = gtok
        self.budget = budget

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._prototype.deep_copy(), self._gtok, self, self.budget)

    def with_budget(self, max_tokens: int | None) -> "Grammar":
        """This grammar (shared, not recompiled) with matchers that keep to a budget of max_tokens."""
        return self if max_tokens is None else Grammar(self.key, self.lark, self._prototype, self._gtok, max_tokens)


def _schema_with_options(schema, strict: bool, whitespace: str) -> dict:
    if schema is True or schema is None:
        schema = {}
    if not isinstance(schema, dict):
        raise TypeError(f"a JSON schema must be an object, got {type(schema).__name__}")
    opts = dict(schema.get("x-guidance") or {})
    if not any(k in opts for k in _WHITESPACE_KEYS):  # a schema's own whitespace options stand
        opts.update(WHITESPACE[whitespace])
    opts["lenient"] = not strict
    return {**schema, "x-guidance": opts}


class GrammarCompiler:
    """Compiles and caches grammars for one GrammarTokenizer (thread-safe). `whitespace`: the JSON whitespace
    of requests that do not choose ("compact" or "any"; see the module doc)."""

    def __init__(self, gtok: GrammarTokenizer, cache_size: int = 256, whitespace: str = "compact"):
        if whitespace not in WHITESPACE:
            raise ValueError(f"whitespace: must be one of {', '.join(WHITESPACE)}, got {whitespace!r}")
        self.gtok = gtok
        self.cache_size = cache_size
        self.whitespace = whitespace
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
        # "auto": text is any token but the tool-call markers (a section must begin with its own marker) and
        # the stop tokens (the grammar ends on those).
        out = sorted({*gtok.markers.values(), *gtok.stop_ids})
        self._free_token = "<[^" + ",".join(map(str, out)) + "]>"

    # --------------------------------------------------------------------------------------- entry points
    @staticmethod
    def fill_bitmasks(rows: Sequence[tuple[GrammarMatcher, int]], bitmask_BW: np.ndarray) -> None:
        """`fill_bitmasks`: several matchers' masks into their rows of bitmask_BW at once."""
        fill_bitmasks(rows, bitmask_BW)

    def for_request(self, *, response_format: dict | None = None, tools: list[dict] | None = None,
                    tool_choice=None, reasoning: bool = False, reasoning_at_start: bool = False,
                    parallel: bool = True, call_offset: int = 0, whitespace: str | None = None,
                    max_tokens: int | None = None) -> Grammar | None:
        """The grammar an OpenAI chat request asks for, or None (unconstrained).

        tool_choice "required" -> one or more calls of `tools` (exactly one when not `parallel`, the request's
        parallel_tool_calls: false); {"type": "function", "function": {"name": N}} -> exactly one call of N;
        "auto" with tools -> text, or a section of calls (one when not `parallel`), or, with a JSON
        response_format, that JSON or a section; ids count on from `call_offset`, and arguments follow the
        tool's `parameters` schema (strict when the tool says `strict: true`). Otherwise response_format
        {"type": "json_object"} -> a JSON object; {"type": "json_schema", "json_schema": {"schema": S,
        "strict": b}} -> JSON matching S; "text"/None -> None. "none" never constrains. `whitespace`: the JSON
        whitespace mode (default: the compiler's). `max_tokens`: the request's budget (the matchers keep a
        section of calls within it). ValueError names the bad field."""
        whitespace = self.whitespace if whitespace is None else whitespace
        if whitespace not in WHITESPACE:
            raise ValueError(f"json_whitespace: must be one of {', '.join(WHITESPACE)}, got {whitespace!r}")
        if isinstance(call_offset, bool) or not isinstance(call_offset, int) or call_offset < 0:
            raise ValueError(f"call_offset: must be an integer >= 0, got {call_offset!r}")
        think = dict(reasoning=reasoning, reasoning_at_start=reasoning_at_start)
        forced = tool_choice is not None and tool_choice not in ("auto", "none")
        if forced and not tools:
            raise ValueError("tool_choice: forcing a tool call needs `tools`")
        if tool_choice == "required":
            g = self.tool_calls(tools, parallel=parallel, call_offset=call_offset, whitespace=whitespace, **think)
        elif forced:
            if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function":
                raise ValueError(f"tool_choice: must be 'none', 'auto', 'required' or "
                                 f"{{'type': 'function', 'function': {{'name': ...}}}}; got {tool_choice!r}")
            name = (tool_choice.get("function") or {}).get("name")
            if not isinstance(name, str):
                raise ValueError("tool_choice.function.name: required")
            g = self.tool_calls(tools, name=name, call_offset=call_offset, whitespace=whitespace, **think)
        else:
            schema = self._response_schema(response_format)
            if tools and tool_choice != "none":
                g = self.tool_calls(tools, parallel=parallel, call_offset=call_offset, whitespace=whitespace,
                                    auto=True, answer=schema, **think)
            elif schema is None:
                return None
            else:
                g = self.json_schema(schema[0], strict=schema[1], whitespace=whitespace, param=schema[2], **think)
        return g.with_budget(max_tokens)

    @staticmethod
    def _response_schema(response_format) -> tuple[dict, bool, str] | None:
        """response_format -> (schema, strict, the field to name in errors), or None for text."""
        if response_format is None:
            return None
        if not isinstance(response_format, dict):
            raise ValueError("response_format: must be an object")
        kind = response_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return {"type": "object"}, False, "response_format"
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise ValueError("response_format.json_schema.schema: required (a JSON schema object)")
            return spec["schema"], bool(spec.get("strict")), "response_format.json_schema.schema"
        raise ValueError(f"response_format.type: must be 'text', 'json_object' or 'json_schema'; got {kind!r}")

    def json_object(self, **kw) -> Grammar:
        """Any JSON object."""
        return self.json_schema({"type": "object"}, strict=False, param="response_format", **kw)

    def json_schema(self, schema: dict, strict: bool = False, *, reasoning: bool = False,
                    reasoning_at_start: bool = False, whitespace: str | None = None,
                    param: str = "schema") -> Grammar:
        """JSON text matching `schema` (draft 2020-12 as llguidance supports it)."""
        whitespace = whitespace or self.whitespace
        body = "start_body: " + self._json(schema, strict, whitespace, param) + "\n"
        return self._compile(("json", schema, strict, whitespace, reasoning, reasoning_at_start), body, reasoning,
                             reasoning_at_start, param)

    def tool_calls(self, tools: list[dict], name: str | None = None, *, parallel: bool = True,
                   call_offset: int = 0, reasoning: bool = False, reasoning_at_start: bool = False,
                   whitespace: str | None = None, auto: bool = False,
                   answer: tuple[dict, bool, str] | None = None) -> Grammar:
        """A K2 tool-call section: with `name`, exactly one call of that function; else one or more calls of
        any of `tools` (exactly one when not `parallel`, at most MAX_PARALLEL_CALLS). Call i (from 0) is
        <|tool_call_begin|>functions.NAME:{call_offset + i}<|tool_call_argument_begin|>{JSON per the tool's
        parameters}<|tool_call_end|>. `auto`: the section is optional, after free text (see the module doc),
        or, with `answer` (response_format's (schema, strict, param)), the alternative to that JSON."""
        whitespace = whitespace or self.whitespace
        validate_tools(tools)
        chosen = [(i, t["function"]) for i, t in enumerate(tools) if name is None or t["function"]["name"] == name]
        if not chosen:
            raise ValueError(f"tool_choice.function.name: no tool named {name!r} in tools")
        n_calls = MAX_PARALLEL_CALLS if name is None and parallel else 1
        lines = [f"section: {SECTION_BEGIN[0]} calls_0 {SECTION_END[0]}"]
        for j, (i, fn) in enumerate(chosen):
            lines.append(f"args_{j}: " + self._json(fn.get("parameters") or {"type": "object"}, bool(fn.get("strict")),
                                                    whitespace, f"tools[{i}].function.parameters"))
        chosen = [fn for _, fn in chosen]
        for i in range(n_calls):
            heads = " | ".join(f'"functions.{fn["name"]}:{call_offset + i}" {ARGUMENT_BEGIN} args_{j}'
                               for j, fn in enumerate(chosen))
            lines.append(f"call_{i}: {CALL_BEGIN} ({heads}) {CALL_END}")
            lines.append(f"calls_{i}: call_{i}" + (f" calls_{i + 1}?" if i + 1 < n_calls else ""))
        if not auto:
            top = "start_body: section"
        elif answer is None:
            top = f"start_body: free* section?\nfree: {self._free_token}"
        else:
            top = "start_body: answer | section\nanswer: " + self._json(answer[0], answer[1], whitespace, answer[2])
        key = ("tools", [{"name": f["name"], "parameters": f.get("parameters"), "strict": bool(f.get("strict"))}
                         for f in chosen], name, n_calls, call_offset, whitespace, auto, answer, reasoning,
               reasoning_at_start)
        body = top + "\n" + "\n".join(lines) + "\n"
        if auto and answer is None:  # free text covers any reasoning as well
            reasoning = reasoning_at_start = False
        return self._compile(key, body, reasoning, reasoning_at_start, "tools")

    def _json(self, schema, strict: bool, whitespace: str, param: str) -> str:
        """A `%json {...}` rule body for schema."""
        try:
            return "%json " + json.dumps(_schema_with_options(schema, strict, whitespace))
        except TypeError as e:
            raise ValueError(f"{param}: {e}") from None

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
