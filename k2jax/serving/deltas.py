"""What the output parsers return: streamed `Delta`s and the whole `ChatMessage`, in OpenAI's shapes.

A Delta carries exactly one of: a content fragment, a reasoning fragment, or a tool-call fragment. A tool
call streams as two fragments, as OpenAI's `delta.tool_calls` do: first {index, id, type, function.name,
function.arguments ""}, then {index, function.arguments}. `assemble(deltas)` joins a stream back into the
ChatMessage a non-streamed response would carry.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ToolCallDelta:
    """One fragment of tool call `index`: the header (id and name set, arguments "") or an arguments piece."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None

    def to_openai(self) -> dict:
        """The element of an OpenAI stream chunk's `delta.tool_calls`."""
        out: dict = {"index": self.index}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
        fn = {}
        if self.name is not None:
            fn["name"] = self.name
        if self.arguments is not None:
            fn["arguments"] = self.arguments
        out["function"] = fn
        return out


@dataclasses.dataclass(frozen=True)
class Delta:
    """One streamed piece: exactly one field is set."""

    content: str | None = None
    reasoning_content: str | None = None
    tool_call: ToolCallDelta | None = None

    def to_openai(self) -> dict:
        """An OpenAI stream chunk's `delta` (role not included)."""
        if self.tool_call is not None:
            return {"tool_calls": [self.tool_call.to_openai()]}
        if self.reasoning_content is not None:
            return {"reasoning_content": self.reasoning_content}
        return {"content": self.content}


@dataclasses.dataclass
class ChatMessage:
    """The parsed assistant message. content is None when it is empty and there are tool calls or reasoning;
    reasoning_content is None when there was none; tool_calls are OpenAI tool_call dicts."""

    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[dict] = dataclasses.field(default_factory=list)

    @classmethod
    def from_parts(cls, content: str, reasoning: str, tool_calls: list[dict]) -> "ChatMessage":
        """Apply the None conventions to plain strings."""
        reasoning_content = reasoning or None
        if not content and (tool_calls or reasoning_content):
            content = None
        return cls(content, reasoning_content, list(tool_calls))

    def to_openai(self) -> dict:
        """The `message` of a non-streamed chat completion choice."""
        out = {"role": "assistant", "content": self.content}
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out


def tool_call(call_id: str, name: str, arguments: str) -> dict:
    """An OpenAI tool_call dict."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def assemble(deltas) -> ChatMessage:
    """Join streamed deltas into the message they spell (as an OpenAI client would)."""
    content, reasoning, calls = [], [], {}
    for d in deltas:
        if d.tool_call is not None:
            t = d.tool_call
            c = calls.setdefault(t.index, {"id": "", "name": "", "arguments": ""})
            c["id"] += t.id or ""
            c["name"] += t.name or ""
            c["arguments"] += t.arguments or ""
        elif d.reasoning_content is not None:
            reasoning.append(d.reasoning_content)
        elif d.content is not None:
            content.append(d.content)
    if sorted(calls) != list(range(len(calls))):
        raise ValueError(f"tool call indices {sorted(calls)} are not 0..n-1")
    tool_calls = [tool_call(calls[i]["id"], calls[i]["name"], calls[i]["arguments"]) for i in range(len(calls))]
    return ChatMessage.from_parts("".join(content), "".join(reasoning), tool_calls)
