"""K2-Thinking's `<think>…</think>` -> reasoning_content apart from content, whole or streamed.

Input is the same text the tool-call parser reads (generated ids detokenized with special tokens by name).
Reasoning is parsed only when the prompt leaves the model thinking (ChatTemplate.thinking(kwargs): a
thinking-format template without thinking=false); callers skip this module otherwise.

- `reasoning_at_start`: the prompt itself ends with `<think>` (K2.5-style templates prefill it), so the output
  begins inside the reasoning. Otherwise reasoning is only an output that begins (after whitespace) with
  `<think>`; any other output is all content.
- The reasoning ends at `</think>` (dropped) or at a tool-call section that begins before it (the marker
  stays, at the head of the content, for the tool-call parser): K2 sometimes calls a tool mid-thought.
- An output that ends inside the reasoning (max_tokens) is all reasoning, no content.
"""

from __future__ import annotations

from k2jax.serving.tool_calls import SECTION_BEGIN, partial_marker_tail

THINK_BEGIN = "<think>"
THINK_END = "</think>"
_ENDS = (THINK_END, *SECTION_BEGIN)


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """Whether a rendered prompt ends inside an open `<think>` (pass as reasoning_at_start)."""
    return prompt_text.rstrip().endswith(THINK_BEGIN)


def _reasoning_end(text: str) -> tuple[int, int]:
    """(position, length to drop) of the first end of reasoning in text; (-1, 0) if none. A `</think>` is
    dropped; a section marker is kept (length 0)."""
    best, drop = -1, 0
    for marker in _ENDS:
        i = text.find(marker)
        if i >= 0 and (best < 0 or i < best):
            best, drop = i, (len(marker) if marker == THINK_END else 0)
    return best, drop


def split_reasoning(text: str, reasoning_at_start: bool = False) -> tuple[str, str]:
    """Whole output text -> (reasoning, content), either possibly empty."""
    if not reasoning_at_start:
        stripped = text.lstrip()
        if not stripped.startswith(THINK_BEGIN):
            return "", text
        text = stripped[len(THINK_BEGIN):]
    end, drop = _reasoning_end(text)
    if end < 0:
        return text, ""
    return text[:end], text[end + drop:]


class ReasoningStream:
    """Incremental `split_reasoning`: feed text pieces, get (reasoning, content) pieces; what the feed()s
    and finish() return, joined, equals split_reasoning of the whole text."""

    _START, _REASONING, _CONTENT = range(3)

    def __init__(self, reasoning_at_start: bool = False):
        self._state = self._REASONING if reasoning_at_start else self._START
        self._buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        """Take the next piece; return (reasoning, content) released now."""
        if self._state == self._CONTENT:
            return "", text
        self._buf += text
        if self._state == self._START:
            stripped = self._buf.lstrip()
            if stripped.startswith(THINK_BEGIN):
                self._buf, self._state = stripped[len(THINK_BEGIN):], self._REASONING
            elif THINK_BEGIN.startswith(stripped):  # empty, or a prefix of <think>: undecided
                return "", ""
            else:
                out, self._buf, self._state = self._buf, "", self._CONTENT
                return "", out
        end, drop = _reasoning_end(self._buf)
        if end >= 0:
            reasoning, content = self._buf[:end], self._buf[end + drop:]
            self._buf, self._state = "", self._CONTENT
            return reasoning, content
        keep = partial_marker_tail(self._buf, _ENDS)
        reasoning, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
        return reasoning, ""

    def finish(self) -> tuple[str, str]:
        """End of output: an undecided start is content; a held tail inside the reasoning is reasoning."""
        buf, self._buf = self._buf, ""
        if self._state == self._REASONING:
            return buf, ""
        return "", buf
