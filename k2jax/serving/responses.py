"""OpenAI response bodies from engine events: choices, streamed chunks, usage, and logprobs in both formats.

Logprobs come from the engine as one {"token_id", "logprob", "top": [[token_id, logprob], ...]} per token.
- completions (`logprobs: k`): {"tokens", "token_logprobs", "top_logprobs", "text_offset"}; each top_logprobs
  entry maps token text to logprob for the top k and the sampled token (so k + 1 entries when the sampled
  one is not among the top k); text_offset counts the characters of the tokens before it (after any echo).
- chat (`logprobs: true, top_logprobs: k`): {"content": [{"token", "logprob", "bytes", "top_logprobs":
  [{"token", "logprob", "bytes"}] (the top k)}]}.
A token's text is its bytes decoded on their own (an incomplete UTF-8 piece shows as U+FFFD: `bytes` has the
real ones); a special token shows its name. -inf (a token the sampled distribution excludes) is reported as
-9999.0, which JSON can carry.

A chat choice whose output is parsed (tools or reasoning: k2jax.serving.chat_request.ChatSetup) gets its
message from the parsers (content, reasoning_content, tool_calls; finish_reason "tool_calls" when a call was
parsed); streamed, each event's text goes through the choice's own ChatOutputStream and every delta it
yields is one chunk (the event's token_ids and logprobs ride on the first; finish_reason on the last).
"""

from __future__ import annotations

import json
import math

from k2jax.serving import chat_request
from k2jax.runtime.engine import Event

LOGPROB_FLOOR = -9999.0


class Names:
    """Token ids as logprobs show them, from a detok.TokenText (None without a tokenizer: "token_id:N")."""

    def __init__(self, table):
        self.table = table

    def text(self, i: int) -> str:
        return self.table.text_of(i) if self.table is not None else f"token_id:{i}"

    def bytes(self, i: int) -> list[int] | None:
        return list(self.table.bytes_of(i)) if self.table is not None else None


def logprob(x) -> float:
    x = float(x)
    return LOGPROB_FLOOR if math.isnan(x) or x < LOGPROB_FLOOR else x


def completion_logprobs(entries: list[dict], names: Names, offset: int) -> tuple[dict, int]:
    """-> (the completions-format logprobs of these tokens, the text offset after them)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        s = names.text(e["token_id"])
        top = {names.text(t): logprob(lp) for t, lp in e["top"]}
        top.setdefault(s, logprob(e["logprob"]))
        out["tokens"].append(s)
        out["token_logprobs"].append(logprob(e["logprob"]))
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(s)
    return out, offset


def chat_logprobs(entries: list[dict], names: Names) -> dict:
    """The chat-format logprobs of these tokens."""
    one = lambda t, lp: {"token": names.text(t), "logprob": logprob(lp), "bytes": names.bytes(t)}  # noqa: E731
    return {"content": [one(e["token_id"], e["logprob"]) | {"top_logprobs": [one(t, lp) for t, lp in e["top"]]}
                        for e in entries]}


class Choice:
    """One choice's answer, built up from its events."""

    def __init__(self, index: int, prompt_tokens: int, wants_logprobs: bool, echo: str = "", chat=None):
        """chat: the request's chat_request.ChatSetup (its output parsed when it asks for that)."""
        self.index, self.prompt_tokens, self.wants_logprobs = index, prompt_tokens, wants_logprobs
        self.setup = chat if chat is not None and chat.parses else None
        self.parser = self.setup.stream() if self.setup is not None else None  # streamed: one per choice
        self.echo = echo  # prompt text to put before the output (completions' echo), sent with the first chunk
        self.text: list[str] = [echo] if echo else []
        self.ids: list[int] = []
        self.logprobs: list[dict] = []
        self.finish_reason: str | None = None
        self.completion_tokens = 0
        self.offset = len(echo)  # completions logprobs: text_offset of the next token
        self.last_t: float | None = None  # when its last token reached the handler (inter-token latency)

    def add(self, ev: Event) -> None:
        self.text.append(ev.text)
        self.ids += ev.token_ids
        self.logprobs += ev.logprobs or []
        self.completion_tokens = ev.completion_tokens
        if ev.finish_reason:
            self.finish_reason = ev.finish_reason

    def logprobs_json(self, entries: list[dict], names: Names, chat: bool):
        """Logprobs of `entries` (tokens of this choice, in order) in the endpoint's format; None when not asked."""
        if not self.wants_logprobs:
            return None
        if chat:
            return chat_logprobs(entries, names)
        out, self.offset = completion_logprobs(entries, names, self.offset)
        return out


def usage(prompt_tokens: int, choices: list[Choice]) -> dict:
    done = sum(c.completion_tokens for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": done, "total_tokens": prompt_tokens + done}


def response(rid: str, created: int, model: str, chat: bool, choices: list[Choice], prompt_tokens: int,
             names: Names) -> dict:
    """The whole (non-streamed) answer."""
    out = []
    for c in choices:
        d = {"index": c.index, "finish_reason": c.finish_reason,
             "logprobs": c.logprobs_json(c.logprobs, names, chat), "token_ids": c.ids}
        text = "".join(c.text)
        if c.setup is not None:
            msg = c.setup.message(text)
            d |= {"message": msg.to_openai(),
                  "finish_reason": chat_request.finish_reason(c.finish_reason, msg.tool_calls)}
        else:
            d |= {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
        out.append(d)
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": out, "usage": usage(prompt_tokens, choices)}


class Chunks:
    """Server-sent events of a streamed answer."""

    def __init__(self, rid: str, created: int, model: str, chat: bool, names: Names):
        self.rid, self.created, self.model, self.chat, self.names = rid, created, model, chat, names
        self.object = "chat.completion.chunk" if chat else "text_completion"

    def _event(self, choices: list[dict], **extra) -> str:
        return "data: " + json.dumps({"id": self.rid, "object": self.object, "created": self.created,
                                      "model": self.model, "choices": choices, **extra}) + "\n\n"

    def first(self, c: Choice) -> str | None:
        """Chat: the role chunk; completions: the echoed prompt, if any."""
        if self.chat:
            return self._event([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None, "token_ids": []}])
        if c.echo:
            return self._event([{"index": c.index, "text": c.echo, "logprobs": None, "finish_reason": None,
                                 "token_ids": []}])
        return None

    def delta(self, c: Choice, ev: Event, finish: str | None = None) -> str:
        """New text and tokens of one choice (finish_reason set on its last chunk)."""
        d = {"index": c.index, "finish_reason": finish,
             "logprobs": c.logprobs_json(ev.logprobs or [], self.names, self.chat) if ev.token_ids else None,
             "token_ids": ev.token_ids}
        if self.chat:
            d["delta"] = {"content": ev.text} if ev.text or not finish else {}
        else:
            d["text"] = ev.text
        return self._event([d])

    def event(self, c: Choice, ev: Event) -> list[str]:
        """The chunks of one engine event of choice c (its last one carries ev.finish_reason)."""
        if c.parser is None:
            return [self.delta(c, ev, ev.finish_reason)]
        finish = ev.finish_reason
        deltas = c.parser.feed(ev.text) if ev.text else []
        if finish:
            deltas += c.parser.finish()
            finish = chat_request.finish_reason(finish, c.parser.tool_calls)
        if not deltas and not ev.token_ids and not finish:
            return []
        lp = c.logprobs_json(ev.logprobs or [], self.names, self.chat) if ev.token_ids else None
        bodies = [d.to_openai() for d in deltas] or [{}]
        return [self._event([{"index": c.index, "finish_reason": finish if i == len(bodies) - 1 else None,
                              "logprobs": lp if i == 0 else None, "token_ids": ev.token_ids if i == 0 else [],
                              "delta": body}])
                for i, body in enumerate(bodies)]

    def usage(self, prompt_tokens: int, choices: list[Choice]) -> str:
        return self._event([], usage=usage(prompt_tokens, choices))

    @staticmethod
    def done() -> str:
        return "data: [DONE]\n\n"
