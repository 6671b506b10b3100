"""A chat request's agent fields -> its prompt, its grammar, and how its output is parsed (`ChatSetup`).

Fields read here: `messages` (system, developer, user, assistant with tool_calls, tool), `tools` (OpenAI
function tools), `tool_choice`, `parallel_tool_calls`, `response_format`, `json_whitespace` ("compact",
"spaced" or "any": JSON whitespace under a grammar, default the server's --json-whitespace) and
`chat_template_kwargs` (e.g. {"thinking": false}); openai_fields reads the sampling fields. Errors are `FieldError`s naming the field
(`messages[2].tool_call_id`, `tool_choice.function.name`, `response_format.json_schema.schema`, ...). Checked
whatever tool_choice is: tool names (OpenAI's pattern, unique), assistant tool-call arguments (JSON), and
that every tool message answers the id of an earlier assistant call.

- Prompt: the server's ChatTemplate (the checkpoint's jinja template, `--chat-template`, or the built-in K2
  one) rendered with messages, tools and chat_template_kwargs, then tokenized with allow_special=True (the
  markers the template writes become special ids; /tokenize with messages gives the same ids).
- Output parsing: tool calls when `tools` are given and tool_choice is not "none"; reasoning when the
  template leaves the model thinking (ChatTemplate.thinking(kwargs)) or the prompt ends inside `<think>`.
  A request that parses has its output detokenized with special-token names kept (the parsers read the
  markers) and the names hidden again afterwards unless the client sent skip_special_tokens: false.
- Grammar (structured output, k2jax.serving.grammar): tool_choice "required", a named function, or "auto"
  with tools (the grammar takes over once the model opens a tool-call section), and response_format
  json_object / json_schema; compiled here once so that a bad schema is a 400 (the engine gets the JSON-able
  spec and looks the compiled grammar up in the compiler's cache). Call ids are fixed by the grammar:
  `call_offset` counts the tool calls of the conversation's assistant messages, so the first call of this
  turn is `functions.NAME:{call_offset}`.
"""

from __future__ import annotations

import dataclasses

from k2jax.serving.chat_output import ChatOutputStream, hidden_names, parse_output
from k2jax.serving.chat_template import ChatTemplate, validate_tools
from k2jax.serving.deltas import ChatMessage
from k2jax.serving.grammar import WHITESPACE as _WHITESPACE
from k2jax.serving.reasoning import prompt_opens_reasoning
from k2jax.serving.tool_calls import finish_reason as tool_finish_reason

AGENT_FIELDS = frozenset({"tools", "tool_choice", "parallel_tool_calls", "response_format", "chat_template_kwargs",
                          "json_whitespace"})
TOOL_CHOICES = ("none", "auto", "required")
WHITESPACE_MODES = tuple(_WHITESPACE)
_MESSAGE_PARAMS = ("messages", "tools", "chat_template_kwargs")


class FieldError(ValueError):
    """A bad request field: `param` names it (OpenAI's error.param); the message starts with it."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclasses.dataclass(frozen=True)
class ChatSetup:
    """A parsed chat request beyond sampling: prompt ids and text, the grammar spec (the keyword arguments
    of GrammarCompiler.for_request, JSON-able; None = unconstrained), and how its output is parsed."""

    prompt: list[int]
    text: str
    grammar: dict | None = None
    tools: bool = False  # parse tool calls
    reasoning: bool = False  # parse <think> reasoning
    reasoning_at_start: bool = False  # the prompt opened <think>
    parallel_tool_calls: bool = True
    forced: bool = False  # tool_choice "required" or a named function
    hide: tuple[str, ...] = ()  # special-token names removed from content and reasoning

    @property
    def parses(self) -> bool:
        """Whether the output goes through the parsers (then the engine keeps special-token names)."""
        return self.tools or self.reasoning

    def _kwargs(self) -> dict:
        return dict(reasoning=self.reasoning, reasoning_at_start=self.reasoning_at_start, tools=self.tools,
                    hide=self.hide, parallel=self.parallel_tool_calls, forced=self.forced)

    def stream(self) -> ChatOutputStream:
        """A fresh parser for one streamed choice."""
        return ChatOutputStream(**self._kwargs())

    def message(self, text: str) -> ChatMessage:
        """One choice's whole generated text (special-token names kept) -> its message."""
        return parse_output(text, **self._kwargs())


def finish_reason(reason: str | None, tool_calls: list) -> str | None:
    """OpenAI's finish_reason of a parsed choice: "tool_calls" when a call was parsed and the output ended
    by itself or at max_tokens; an abort or error stays what it is."""
    return tool_finish_reason(reason, tool_calls) if reason in ("stop", "length") else reason


def chat_template_kwargs(body: dict) -> dict:
    v = body.get("chat_template_kwargs")
    if v is None:
        return {}
    if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
        raise FieldError("chat_template_kwargs", "expected an object of template variables, e.g. "
                                                 "{\"thinking\": false}")
    return v


def read_tools(body: dict) -> list[dict] | None:
    """The request's function tools (None when absent or empty)."""
    tools = body.get("tools")
    if tools is None:
        return None
    try:
        validate_tools(tools)
    except ValueError as e:
        raise FieldError(str(e).split(":")[0], str(e).split(":", 1)[1].strip()) from None
    return tools or None


def read_tool_choice(body: dict, tools: list[dict] | None):
    """tool_choice: "none", "auto" (the default with tools), "required", or {"type": "function", "function":
    {"name": N}} naming one of the tools."""
    choice = body.get("tool_choice")
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise FieldError("tool_choice", f"must be one of {', '.join(TOOL_CHOICES)} or {{\"type\": \"function\", "
                                            f"\"function\": {{\"name\": ...}}}}; got {choice!r}")
        if choice == "required" and not tools:
            raise FieldError("tool_choice", "\"required\" needs `tools`")
        return choice
    if not isinstance(choice, dict) or choice.get("type") != "function" or set(choice) - {"type", "function"}:
        raise FieldError("tool_choice", f"must be one of {', '.join(TOOL_CHOICES)} or {{\"type\": \"function\", "
                                        f"\"function\": {{\"name\": ...}}}}; got {choice!r}")
    fn = choice.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or set(fn) - {"name"}:
        raise FieldError("tool_choice.function.name", "required (the name of one of `tools`)")
    names = [t["function"]["name"] for t in tools or ()]
    if fn["name"] not in names:
        raise FieldError("tool_choice.function.name",
                         f"no tool named {fn['name']!r} in tools ({', '.join(names) or 'none given'})")
    return choice


def call_offset(messages: list[dict]) -> int:
    """The tool calls of the conversation's assistant messages: the index of this turn's first call."""
    return sum(len(m.get("tool_calls") or ()) for m in messages if m.get("role") == "assistant")


def render(template: ChatTemplate, tok, body: dict, add_generation_prompt: bool = True) -> tuple[str, list[int]]:
    """messages (+ tools, chat_template_kwargs) -> (prompt text, its token ids)."""
    if body.get("messages") is None:
        raise FieldError("messages", "required")
    try:
        text = template.render(body["messages"], read_tools(body), add_generation_prompt=add_generation_prompt,
                               **chat_template_kwargs(body))
    except FieldError:
        raise
    except ValueError as e:
        msg = str(e)
        head = msg.split(":")[0]
        if head.split(".")[0].split("[")[0] in _MESSAGE_PARAMS:
            raise FieldError(head, msg.split(":", 1)[1].strip()) from None
        raise FieldError("messages", msg) from None  # the template itself refused them
    return text, tok.encode(text, allow_special=True)


def chat_setup(body: dict, tok, template: ChatTemplate, grammars, skip_special_tokens: bool = True) -> ChatSetup:
    """Everything a chat body asks beyond sampling. `grammars`: the server's GrammarCompiler (None: any
    constrained request is refused). `skip_special_tokens`: the client's (default true)."""
    text, ids = render(template, tok, body)
    tools = read_tools(body)
    choice = read_tool_choice(body, tools)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise FieldError("parallel_tool_calls", f"expected true or false, got {parallel!r}")
    kwargs = chat_template_kwargs(body)
    at_start = prompt_opens_reasoning(text)
    reasoning = at_start or template.thinking(kwargs)
    whitespace = body.get("json_whitespace")
    if whitespace is not None and whitespace not in WHITESPACE_MODES:
        raise FieldError("json_whitespace", f"must be one of {', '.join(WHITESPACE_MODES)}, got {whitespace!r}")
    spec = {"tools": tools, "tool_choice": choice, "parallel": parallel, "response_format": body.get("response_format"),
            "reasoning": reasoning, "reasoning_at_start": at_start, "call_offset": call_offset(body["messages"]),
            "whitespace": whitespace or (grammars.whitespace if grammars is not None else None)}
    grammar = _grammar(grammars, spec)
    return ChatSetup(ids, text, grammar, tools=bool(tools) and choice != "none", reasoning=reasoning,
                     reasoning_at_start=at_start, parallel_tool_calls=parallel,
                     forced=choice not in ("none", "auto"), hide=hidden_names(tok, skip_special_tokens))


def _grammar(grammars, spec: dict) -> dict | None:
    """The grammar spec when the request constrains its output (compiled now: errors name the field)."""
    rf, choice = spec["response_format"], spec["tool_choice"]
    if rf is not None and not isinstance(rf, dict):
        raise FieldError("response_format", f"expected an object, got {rf!r}")
    text = rf is None or rf.get("type") == "text"
    if text and rf is not None and set(rf) - {"type"}:
        raise FieldError("response_format", f"unknown keys {sorted(set(rf) - {'type'})} for type \"text\"")
    # "auto" with tools is constrained where a grammar compiler exists (from the section on); the others must be.
    if text and choice in ("none", "auto") and (choice == "none" or not spec["tools"] or grammars is None):
        return None
    if grammars is None:
        param = "tool_choice" if choice not in ("none", "auto") else "response_format"
        raise FieldError(param, "structured output needs the server's tokenizer (--tokenizer DIR)")
    try:
        return spec if grammars.for_request(**spec) is not None else None
    except ValueError as e:
        msg = str(e).split("\n")[0]  # llguidance's errors go on to list the whole grammar
        head = msg.split(":")[0]
        param = head if head.split(".")[0].split("[")[0] in ("response_format", "tool_choice", "tools",
                                                             "json_whitespace") else \
            "response_format"
        raise FieldError(param, msg.split(":", 1)[1].strip() if head == param else msg) from None
