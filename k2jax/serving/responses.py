"""OpenAI response bodies from engine events: choices, streamed chunks, usage, and logprobs in both formats.

Logprobs come from the engine as one {"token_id", "logprob", "top": [[token_id, logprob], ...]} per token.
- completions (`logprobs: k`): {"tokens", "token_logprobs", "top_logprobs", "text_offset"}; each top_logprobs
  entry maps token text to logprob for the top k and the sampled token (so k + 1 entries when the sampled
  one is not among the top k); text_offset counts the characters of the tokens before it (after any echo).
- chat (`logprobs: true, top_logprobs: k`): {"content": [{"token", "logprob", "bytes", "top_logprobs":
  [{"token", "logprob", "bytes"}] (the top k)}]}.
Prompt logprobs (the engine's {"token_id", "logprob", "rank", "top"} per prompt token from the second on):
- completions' echo with `logprobs: k`: the prompt's tokens lead the logprobs above (the first with a null
  logprob and null top_logprobs, as OpenAI's legacy completions and vLLM), text_offset counting from the
  echoed prompt's start; streamed, the echo chunk waits for them and carries them.
- vLLM's `prompt_logprobs: k`: [null, {token_id: {"logprob", "rank", "decoded_token"}} per later prompt
  token (the token itself and the top k)], in each completions choice and at the top of a chat response;
  streamed, on the choice's first chunk (chat: the first chunk's top level).
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
from k2jax.runtime.requests import Event

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


def echo_logprobs(prompt: list[int], entries: list[dict], names: Names) -> dict:
    """The completions-format logprobs of an echoed prompt (entries: its prompt scores)."""
    out, offset = completion_logprobs(entries, names, len(names.text(prompt[0])))
    out = {k: [v] + out[k] for k, v in (("tokens", names.text(prompt[0])), ("token_logprobs", None),
                                         ("top_logprobs", None), ("text_offset", 0))}
    return out


def vllm_prompt_logprobs(entries: list[dict], k: int, names: Names) -> list:
    """vLLM's prompt_logprobs: null for the first prompt token, then the token and its top k per token."""
    out = [None]
    for e in entries:
        d = {str(t): {"logprob": logprob(lp), "rank": r, "decoded_token": names.text(t)}
             for r, (t, lp) in enumerate(e["top"][:k], 1)}
        d[str(e["token_id"])] = {"logprob": logprob(e["logprob"]), "rank": e["rank"],
                                 "decoded_token": names.text(e["token_id"])}
        out.append(d)
    return out


def chat_logprobs(entries: list[dict], names: Names) -> dict:
    """The chat-format logprobs of these tokens."""
    one = lambda t, lp: {"token": names.text(t), "logprob": logprob(lp), "bytes": names.bytes(t)}  # noqa: E731
    return {"content": [one(e["token_id"], e["logprob"]) | {"top_logprobs": [one(t, lp) for t, lp in e["top"]]}
                        for e in entries]}


class Choice:
    """One choice's answer, built up from its events."""

    def __init__(self, index: int, prompt_tokens: int, wants_logprobs: bool, echo: str = "", chat=None,
                 prompt: list[int] | None = None, echo_logprobs: bool = False, prompt_logprobs: int | None = None):
        """chat: the request's chat_request.ChatSetup (its output parsed when it asks for that); prompt: its
        token ids; echo_logprobs: the prompt's logprobs lead the completions logprobs; prompt_logprobs: vLLM's
        field (the top k beside each prompt token)."""
        self.prompt, self.echo_logprobs, self.prompt_k = prompt, echo_logprobs, prompt_logprobs
        self.prompt_entries: list[dict] | None = None  # the engine's prompt scores, once they came
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
        if ev.prompt_logprobs is not None:
            self.prompt_entries = ev.prompt_logprobs
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

    def echo_json(self, names: Names) -> dict | None:
        """The echoed prompt's completions logprobs (None unless echo with logprobs)."""
        if not self.echo_logprobs or self.prompt_entries is None:
            return None
        return echo_logprobs(self.prompt, self.prompt_entries, names)

    def prompt_json(self, names: Names) -> list | None:
        """vLLM's prompt_logprobs (None when not asked)."""
        if self.prompt_k is None or self.prompt_entries is None:
            return None
        return vllm_prompt_logprobs(self.prompt_entries, self.prompt_k, names)


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
        if (echoed := c.echo_json(names)) is not None:
            d["logprobs"] = {k: v + d["logprobs"][k] for k, v in echoed.items()}
        if not chat and c.prompt_k is not None:
            d["prompt_logprobs"] = c.prompt_json(names)
        text = "".join(c.text)
        if c.setup is not None:
            msg = c.setup.message(text)
            d |= {"message": msg.to_openai(),
                  "finish_reason": chat_request.finish_reason(c.finish_reason, msg.tool_calls)}
        else:
            d |= {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
        out.append(d)
    body = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": out, "usage": usage(prompt_tokens, choices)}
    if chat and choices and choices[0].prompt_k is not None:
        body["prompt_logprobs"] = choices[0].prompt_json(names)
    return body


class Chunks:
    """Server-sent events of a streamed answer."""

    def __init__(self, rid: str, created: int, model: str, chat: bool, names: Names):
        self.rid, self.created, self.model, self.chat, self.names = rid, created, model, chat, names
        self.object = "chat.completion.chunk" if chat else "text_completion"

    def _event(self, choices: list[dict], **extra) -> str:
        return "data: " + json.dumps({"id": self.rid, "object": self.object, "created": self.created,
                                      "model": self.model, "choices": choices, **extra}) + "\n\n"

    def first(self, c: Choice) -> str | None:
        """Chat: the role chunk; completions: the echoed prompt, if any (with logprobs: see `echo`)."""
        if self.chat:
            return self._event([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None, "token_ids": []}])
        if c.echo and not c.echo_logprobs:
            return self._event([{"index": c.index, "text": c.echo, "logprobs": None, "finish_reason": None,
                                 "token_ids": []}])
        return None

    def prompt_scores(self, c: Choice, ev: Event) -> list[str]:
        """The chunks an event with the prompt's scores starts with: completions' echo with its logprobs; vLLM's
        prompt_logprobs (chat: on a chunk of its own, at the top level)."""
        if ev.prompt_logprobs is None:
            return []
        c.prompt_entries = ev.prompt_logprobs
        out = []
        if not self.chat and (c.echo_logprobs or c.prompt_k is not None):
            d = {"index": c.index, "text": c.echo if c.echo_logprobs else "", "logprobs": c.echo_json(self.names),
                 "finish_reason": None, "token_ids": []}
            if c.prompt_k is not None:
                d["prompt_logprobs"] = c.prompt_json(self.names)
            out.append(self._event([d]))
        elif self.chat and c.prompt_k is not None:
            out.append(self._event([{"index": c.index, "delta": {}, "logprobs": None, "finish_reason": None,
                                     "token_ids": []}], prompt_logprobs=c.prompt_json(self.names)))
        return out

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
