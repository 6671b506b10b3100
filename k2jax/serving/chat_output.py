"""A chat completion's generated text -> OpenAI message / stream deltas: reasoning, then tool calls, then
special-token hiding, composed as one parser per choice.

Input: the generated ids detokenized WITH special tokens by name, stop tokens left out (the engine's
`decode` = KimiTokenizer.decode gives exactly that). Order of work:
  1. reasoning (k2jax.serving.reasoning) when `reasoning`: `<think>…</think>` -> reasoning_content;
  2. tool calls (k2jax.serving.tool_calls) on the rest when `tools`;
  3. the names in `hide` (all special-token names when skip_special_tokens) are removed from reasoning and
     content, so markers of a malformed section or stray special tokens never reach the client.
`parse_output` (whole text) and `ChatOutputStream` (pieces) give the same message: assemble(stream deltas)
== parse_output(text) for any way of splitting the text. With `parallel=False` (the request's
parallel_tool_calls: false) only the first parsed call is kept; later ones are dropped (a grammar allows only
one anyway). With `forced` (tool_choice "required" or a named function) a section cut by max_tokens is
dropped rather than shown as content: the message is empty and finish_reason stays "length".
"""

from __future__ import annotations

from collections.abc import Iterable

from k2jax.serving import reasoning as reasoning_mod
from k2jax.serving import tool_calls as tool_calls_mod
from k2jax.serving.deltas import ChatMessage, Delta
from k2jax.serving.special_text import SpecialTextFilter


def hidden_names(tokenizer, skip_special_tokens: bool = True) -> tuple[str, ...]:
    """The names to pass as `hide`: every special token of a KimiTokenizer, or none."""
    return tuple(tokenizer.special_tokens) if skip_special_tokens else ()


def parse_output(text: str, *, reasoning: bool = False, reasoning_at_start: bool = False, tools: bool = False,
                 hide: Iterable[str] = (), parallel: bool = True, forced: bool = False) -> ChatMessage:
    """Whole generated text -> ChatMessage(content, reasoning_content, tool_calls)."""
    think, rest = reasoning_mod.split_reasoning(text, reasoning_at_start) if reasoning else ("", text)
    content, calls = tool_calls_mod.parse(rest, drop_cut=forced) if tools else (rest, [])
    calls = calls if parallel else calls[:1]
    strip = SpecialTextFilter(hide).strip
    return ChatMessage.from_parts(strip(content or ""), strip(think), calls)


class ChatOutputStream:
    """The streaming form of parse_output for one choice: feed() each text delta the engine reports, then
    finish() once; each returns Deltas to send (content, reasoning_content or tool-call fragments).
    `tool_calls` lists the calls released so far (finish_reason: tool_calls.finish_reason(reason, it))."""

    def __init__(self, *, reasoning: bool = False, reasoning_at_start: bool = False, tools: bool = False,
                 hide: Iterable[str] = (), parallel: bool = True, forced: bool = False):
        hide = tuple(hide)
        self._parallel = parallel
        self._reasoning = reasoning_mod.ReasoningStream(reasoning_at_start) if reasoning else None
        self._tools = tool_calls_mod.ToolCallStream(drop_cut=forced) if tools else None
        self._hide_reasoning = SpecialTextFilter(hide)
        self._hide_content = SpecialTextFilter(hide)

    @property
    def tool_calls(self) -> list[dict]:
        calls = self._tools.tool_calls if self._tools is not None else []
        return calls if self._parallel else calls[:1]

    def feed(self, text: str) -> list[Delta]:
        """Next text delta -> deltas to send now (possibly none)."""
        think, rest = self._reasoning.feed(text) if self._reasoning is not None else ("", text)
        return self._emit(think, rest, final=False)

    def finish(self) -> list[Delta]:
        """End of output -> the deltas still held back."""
        think, rest = self._reasoning.finish() if self._reasoning is not None else ("", "")
        return self._emit(think, rest, final=True)

    def _emit(self, think: str, rest: str, final: bool) -> list[Delta]:
        out: list[Delta] = []
        r = self._hide_reasoning.feed(think) + (self._hide_reasoning.finish() if final else "")
        if r:
            out.append(Delta(reasoning_content=r))
        pieces = self._tools.feed(rest) if self._tools is not None else [Delta(content=rest)]
        if final and self._tools is not None:
            pieces += self._tools.finish()
        text = ""
        for d in pieces:
            if d.content is None:  # a tool-call fragment: first flush the content before it
                if not self._parallel and d.tool_call.index > 0:
                    continue
                text = self._flush(out, text)
                out.append(d)
            else:
                text += self._hide_content.feed(d.content)
        if final:
            text += self._hide_content.finish()
        self._flush(out, text)
        return out

    @staticmethod
    def _flush(out: list[Delta], text: str) -> str:
        if text:
            out.append(Delta(content=text))
        return ""
