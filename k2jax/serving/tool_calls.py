"""K2's tool-call output -> OpenAI tool_calls, whole (`parse`) or streamed (`ToolCallStream`).

K2 writes, after any text:

    <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}
    <|tool_call_end|>...more calls...<|tool_calls_section_end|>

Input is TEXT in which special tokens appear by name: the generated ids detokenized WITH special tokens
(KimiTokenizer.decode does that), stop tokens left out. The markers are special tokens, so a model cannot
write them as plain text by accident; the text form loses that distinction only for a reply that spells a
marker out in ordinary characters, which is then read as a marker (vLLM and SGLang parse text the same way).

Per section: every call must be `<|tool_call_begin|> ID <|tool_call_argument_begin|> ARGS <|tool_call_end|>`
with only whitespace between the pieces; ID is `functions.NAME:IDX` (or `NAME:IDX`), kept verbatim as the
OpenAI id (as vLLM's kimi_k2 parser keeps it); NAME is the part between `functions.` and the last `:`; ARGS
(whitespace-stripped) must be a JSON object and is passed on as written. Ids stay unique within a response: an
id the response already used gets IDX = 1 + the largest IDX used so far in it (logged), since a client matches
tool results to calls by id. (Under a grammar the ids are right by construction: k2jax.serving.grammar.)
A section that breaks any of that, or holds no call, stays in the text as plain content, markers included (a
caller that hides special tokens strips them afterwards); so does a section that never ends (cut by
max_tokens), unless `drop_cut` (a forced call cut by max_tokens: its partial section is dropped, not shown as
content). Text before and after a section is content. The singular `<|tool_call_section_begin|>` /
`..._end|>` spelling, seen in the wild, is accepted too.

Streaming releases a section's calls when its end marker arrives (header delta, then one arguments delta per
call): until then the section may still turn out malformed or cut, and a call once streamed cannot be taken
back. Content outside sections streams at once, except a tail that may be the start of a section marker.
"""

from __future__ import annotations

import functools
import json
import logging
import re

from k2jax.serving.deltas import Delta, ToolCallDelta, tool_call
from k2jax.serving.oplog import LOGGER

SECTION_BEGIN = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
SECTION_END = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
MARKERS = (*SECTION_BEGIN, *SECTION_END, CALL_BEGIN, ARGUMENT_BEGIN, CALL_END)

_ID = re.compile(r"(?P<name>\S+):(?P<idx>\d+)")
_CALL = re.compile(r"\s*" + re.escape(CALL_BEGIN) + r"(?P<id>.*?)" + re.escape(ARGUMENT_BEGIN) + r"(?P<args>.*?)"
                   + re.escape(CALL_END) + r"\s*", re.DOTALL)


def parse_call_id(call_id: str) -> str | None:
    """The function name in a K2 call id (`functions.get_weather:0` -> `get_weather`), None if malformed."""
    m = _ID.fullmatch(call_id.removeprefix("functions."))
    if m is None or any(marker in call_id for marker in MARKERS):
        return None
    return m.group("name")


class UniqueIds:
    """The call ids of one response, kept unique (see the module doc)."""

    def __init__(self):
        self.seen: set[str] = set()
        self.top = -1  # the largest IDX used so far

    def take(self, call_id: str) -> str:
        """call_id (a well-formed K2 id), or its renumbered form if this response already used it."""
        head, _, idx = call_id.rpartition(":")
        if call_id in self.seen:
            new = f"{head}:{self.top + 1}"
            logging.getLogger(LOGGER).warning(f"tool call id {call_id!r} repeated in one response: renamed {new!r}")
            call_id, idx = new, self.top + 1
        self.seen.add(call_id)
        self.top = max(self.top, int(idx))
        return call_id


def parse_section_body(body: str, ids: UniqueIds | None = None) -> list[dict] | None:
    """The calls between a section's begin and end markers, or None if any part is malformed. `ids`: the
    response's ids so far (a repeated one is renamed)."""
    calls, pos = [], 0
    while body[pos:].strip():
        m = _CALL.match(body, pos)
        if m is None:
            return None
        call_id, args = m.group("id").strip(), m.group("args").strip()
        name = parse_call_id(call_id)
        if name is None or any(marker in args for marker in MARKERS):
            return None
        try:
            if not isinstance(json.loads(args), dict):
                return None
        except ValueError:
            return None
        calls.append((call_id, name, args))
        pos = m.end()
    if not calls:
        return None
    ids = ids or UniqueIds()
    return [tool_call(ids.take(call_id), name, args) for call_id, name, args in calls]


def _find_first(text: str, needles, start: int = 0) -> tuple[int, str | None]:
    """Earliest occurrence of any needle at or after start -> (position, needle); (-1, None) if none."""
    best, which = -1, None
    for n in needles:
        i = text.find(n, start)
        if i >= 0 and (best < 0 or i < best):
            best, which = i, n
    return best, which


def parse(text: str, drop_cut: bool = False) -> tuple[str | None, list[dict]]:
    """Whole output text -> (content, tool_calls). content is None when it is empty and calls were parsed;
    otherwise the text outside well-formed sections (malformed sections included verbatim, and a cut one
    unless drop_cut)."""
    content, calls, pos, ids = [], [], 0, UniqueIds()
    while True:
        begin, marker = _find_first(text, SECTION_BEGIN, pos)
        if begin < 0:
            content.append(text[pos:])
            break
        content.append(text[pos:begin])
        body_start = begin + len(marker)
        end, end_marker = _find_first(text, SECTION_END, body_start)
        if end < 0:  # cut off: the rest is plain content (or dropped)
            content.append("" if drop_cut else text[begin:])
            break
        section = parse_section_body(text[body_start:end], ids)
        if section is None:
            content.append(text[begin:end + len(end_marker)])
        else:
            calls += section
        pos = end + len(end_marker)
    joined = "".join(content)
    return (None if not joined and calls else joined), calls


def finish_reason(reason: str | None, tool_calls: list) -> str | None:
    """OpenAI's finish_reason: "tool_calls" when at least one call was parsed, else the engine's reason."""
    return "tool_calls" if tool_calls else reason


@functools.lru_cache(maxsize=16)
def _proper_prefixes(markers: tuple[str, ...]) -> tuple[frozenset[str], int]:
    return frozenset(m[:k] for m in markers for k in range(1, len(m))), max(map(len, markers), default=0)


def partial_marker_tail(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of text that is a proper prefix of one of markers (0 if none): the part
    a stream must hold back because the next piece may complete a marker."""
    prefixes, longest = _proper_prefixes(tuple(markers))
    for k in range(min(len(text), longest - 1), 0, -1):
        if text[-k:] in prefixes:
            return k
    return 0


class ToolCallStream:
    """Incremental `parse`: feed text pieces, get Deltas; the deltas of feed()s plus finish(), assembled,
    equal parse() of the whole text (see the module doc for when calls are released)."""

    def __init__(self, drop_cut: bool = False):
        self._buf = ""
        self._in_section = False
        self._next_index = 0
        self._drop_cut = drop_cut
        self._ids = UniqueIds()
        self.tool_calls: list[dict] = []  # every call released so far (for finish_reason)

    def feed(self, text: str) -> list[Delta]:
        """Take the next piece of output text; return what can be released now."""
        self._buf += text
        out: list[Delta] = []
        while True:
            if not self._in_section:
                begin, _ = _find_first(self._buf, SECTION_BEGIN)
                if begin < 0:
                    keep = partial_marker_tail(self._buf, SECTION_BEGIN)
                    self._content(out, self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    return out
                self._content(out, self._buf[:begin])
                self._buf, self._in_section = self._buf[begin:], True
            marker = next(m for m in SECTION_BEGIN if self._buf.startswith(m))
            end, end_marker = _find_first(self._buf, SECTION_END, len(marker))
            if end < 0:
                return out
            stop = end + len(end_marker)
            calls = parse_section_body(self._buf[len(marker):end], self._ids)
            if calls is None:
                self._content(out, self._buf[:stop])
            else:
                for c in calls:
                    i = self._next_index
                    self._next_index += 1
                    fn = c["function"]
                    out.append(Delta(tool_call=ToolCallDelta(i, id=c["id"], name=fn["name"], arguments="")))
                    out.append(Delta(tool_call=ToolCallDelta(i, arguments=fn["arguments"])))
                    self.tool_calls.append(c)
            self._buf, self._in_section = self._buf[stop:], False

    def finish(self) -> list[Delta]:
        """End of output: whatever is held (a marker prefix, or a section that never ended) is content; a
        section that never ended is dropped instead when drop_cut."""
        out: list[Delta] = []
        self._content(out, "" if self._in_section and self._drop_cut else self._buf)
        self._buf, self._in_section = "", False
        return out

    @staticmethod
    def _content(out: list[Delta], text: str) -> None:
        if text:
            out.append(Delta(content=text))
