"""Chat messages -> prompt text, with the checkpoint's own jinja chat template, rendered as transformers does.

The template is, in order: `override` (a file, `--chat-template FILE`), the `chat_template` of the checkpoint's
tokenizer_config.json (a string, or a list of {name, template}: "default" is taken), a `chat_template.jinja`
beside it, else the built-in K2 template (templates/kimi_k2.jinja). The environment is transformers':
an immutable sandbox with trim_blocks and lstrip_blocks, the loopcontrols extension, `raise_exception`,
`strftime_now`, and a `tojson` filter that is plain `json.dumps` (no HTML escaping, ensure_ascii False,
indent/separators/sort_keys passed through). Like transformers' apply_chat_template, messages lose their
None-valued keys, `reasoning_content` is also offered as `thinking` (and filled from `reasoning`/`thinking`),
and the tokenizer's special tokens (bos_token, eos_token, unk_token, pad_token) are template variables that
chat_template_kwargs may override.

Tokenize the result with `tokenizer.encode(text, allow_special=True)`: the markers the template writes become
special ids. Message text is not sanitized (transformers' default too): a user who types `<|im_end|>` gets
that special id.
"""

from __future__ import annotations

import datetime
import json
import os
import re
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox

BUILTIN_TEMPLATE = Path(__file__).with_name("templates") / "kimi_k2.jinja"
ROLES = ("system", "developer", "user", "assistant", "tool")
# Template variables transformers fills from the tokenizer's special-token map.
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
# OpenAI's function-name rule (plus '.'): the name is also written into K2's call ids and into grammars.
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """transformers' tojson: json.dumps as is (jinja2's own escapes <, >, & and ' for HTML)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """jinja2's namespace() minus underscore attributes (a sandbox hardening transformers applies too)."""

    def __init__(*args, **kwargs):  # noqa: N805 -- jinja2's own signature trick, so namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not set {name!r} on a namespace")


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    return env


def _template_from_config(cfg: dict, where: str) -> str | None:
    """The chat_template entry of a tokenizer_config: a string, or a list of {name, template} ("default")."""
    t = cfg.get("chat_template")
    if t is None or isinstance(t, str):
        return t
    if isinstance(t, list):
        named = {e.get("name"): e.get("template") for e in t if isinstance(e, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise ValueError(f"{where}: chat_template is a list without a 'default' entry (has {sorted(named)})")
    raise ValueError(f"{where}: chat_template must be a string or a list of {{name, template}}, "
                     f"got {type(t).__name__}")


class ChatTemplate:
    """A compiled chat template plus the special-token variables it is rendered with."""

    def __init__(self, source: str, *, origin: str = "<string>", special_tokens: dict[str, str] | None = None,
                 thinking_default: bool | None = None):
        """`source`: jinja text. `special_tokens`: values of bos_token/eos_token/... offered to the template.
        `thinking_default`: whether a prompt rendered without a `thinking` kwarg makes the model think; None =
        whether the template mentions `<think>` (K2-Thinking, K2.5 and K2.6 think by default)."""
        self.source = source
        self.origin = origin
        self.special_tokens = dict(special_tokens or {})
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ValueError(f"chat template {origin}: syntax error on line {e.lineno}: {e.message}") from e
        self.is_thinking = "<think>" in source
        self.thinking_default = self.is_thinking if thinking_default is None else thinking_default

    @classmethod
    def builtin(cls, special_tokens: dict[str, str] | None = None) -> "ChatTemplate":
        """K2's format (templates/kimi_k2.jinja); thinking only when rendered with thinking=True."""
        return cls(BUILTIN_TEMPLATE.read_text(encoding="utf-8"), origin="built-in K2 template",
                   special_tokens=special_tokens, thinking_default=False)

    @classmethod
    def from_tokenizer_dir(cls, directory: str | os.PathLike | None,
                           override: str | os.PathLike | None = None) -> "ChatTemplate":
        """The template for a checkpoint/tokenizer directory (see the module doc for the order).
        `override`: a jinja file that replaces the checkpoint's template. `directory` None: built-in/override
        only, with K2's special tokens."""
        special = {"bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]", "pad_token": "[PAD]"}
        source = origin = None
        if directory is not None:
            directory = Path(directory)
            cfg_path = directory / "tokenizer_config.json"
            if cfg_path.is_file():
                try:
                    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
                except ValueError as e:
                    raise ValueError(f"malformed {cfg_path}: {e}") from e
                for key in SPECIAL_TOKEN_KEYS:
                    v = cfg.get(key)
                    v = v.get("content") if isinstance(v, dict) else v
                    if isinstance(v, str):
                        special[key] = v
                source = _template_from_config(cfg, str(cfg_path))
                origin = f"{cfg_path} chat_template"
            jinja_path = directory / "chat_template.jinja"
            if source is None and jinja_path.is_file():
                source, origin = jinja_path.read_text(encoding="utf-8"), str(jinja_path)
        if override is not None:
            path = Path(override)
            if not path.is_file():
                raise ValueError(f"chat template file not found: {path}")
            source, origin = path.read_text(encoding="utf-8"), str(path)
        if source is None:
            return cls.builtin(special)
        return cls(source, origin=origin, special_tokens=special)

    def thinking(self, chat_template_kwargs: dict | None = None) -> bool:
        """Whether a prompt rendered with these kwargs leaves the model thinking (so its output is parsed for
        `<think>` reasoning): never for a template without `<think>`; else the `thinking` kwarg, defaulting
        to `thinking_default`."""
        if not self.is_thinking:
            return False
        value = (chat_template_kwargs or {}).get("thinking", self.thinking_default)
        return bool(value)

    def render(self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True,
               **chat_template_kwargs) -> str:
        """Prompt text for OpenAI-style `messages` (and `tools`, OpenAI function tools).

        Raises ValueError naming the message index and field for malformed messages or tools, and for
        errors the template raises (raise_exception, undefined names used wrongly)."""
        validate_messages(messages)
        if tools is not None:
            validate_tools(tools)
        clash = {"messages", "tools", "documents", "add_generation_prompt"} & set(chat_template_kwargs)
        if clash:
            raise ValueError(f"chat_template_kwargs: {sorted(clash)} are set by the request itself")
        msgs = [_normalize(m) for m in messages]
        variables = {**self.special_tokens, **chat_template_kwargs}
        try:
            return self._template.render(messages=msgs, tools=tools, documents=None,
                                         add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"chat template {self.origin}: {e}") from e
        except (TypeError, KeyError, AttributeError, IndexError) as e:
            raise ValueError(f"chat template {self.origin} failed on these messages: {type(e).__name__}: {e}") from e


def _normalize(message: dict) -> dict:
    """As transformers does: drop None-valued keys; offer reasoning under reasoning_content and thinking."""
    m = {k: v for k, v in message.items() if v is not None}
    reasoning = next((m[k] for k in _REASONING_KEYS if m.get(k) is not None), None)
    if reasoning is not None:
        m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
    return m


def _text_parts_ok(content: Any, where: str) -> None:
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise ValueError(f"{where}: must be a string or a list of text parts, got {type(content).__name__}")
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise ValueError(f"{where}[{j}]: a content part must be an object, got {type(part).__name__}")
        if part.get("type", "text") != "text":
            raise ValueError(f"{where}[{j}].type: only text parts are supported, got {part.get('type')!r}")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{where}[{j}].text: must be a string")


def validate_messages(messages: Any) -> None:
    """Check OpenAI chat messages; ValueError names `messages[i].field`."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages: must be a non-empty list")
    call_ids: set[str] = set()  # the ids of the tool calls of the assistant messages so far
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ValueError(f"{where}: must be an object, got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"{where}.role: must be one of {', '.join(ROLES)}; got {role!r}")
        if m.get("name") is not None and not isinstance(m["name"], str):
            raise ValueError(f"{where}.name: must be a string")
        content = m.get("content")
        _text_parts_ok(content, f"{where}.content")
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str) or not m["tool_call_id"]:
                raise ValueError(f"{where}.tool_call_id: a tool message needs the id of the call it answers")
            if m["tool_call_id"] not in call_ids:
                known = ", ".join(sorted(call_ids)) or "none"
                raise ValueError(f"{where}.tool_call_id: {m['tool_call_id']!r} matches no tool call of an earlier "
                                 f"assistant message (their ids: {known}); send the id as the call had it")
        tool_calls = m.get("tool_calls")
        if tool_calls is not None:
            if role != "assistant":
                raise ValueError(f"{where}.tool_calls: only assistant messages carry tool calls")
            if not isinstance(tool_calls, list):
                raise ValueError(f"{where}.tool_calls: must be a list")
            for j, c in enumerate(tool_calls):
                cw = f"{where}.tool_calls[{j}]"
                if not isinstance(c, dict):
                    raise ValueError(f"{cw}: must be an object")
                if not isinstance(c.get("id"), str) or not c["id"]:
                    raise ValueError(f"{cw}.id: required (K2's ids look like functions.NAME:IDX; keep them verbatim)")
                if c.get("type", "function") != "function":
                    raise ValueError(f"{cw}.type: must be 'function'")
                f = c.get("function")
                if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
                    raise ValueError(f"{cw}.function.name: required")
                if not isinstance(f.get("arguments"), (str, dict)):
                    raise ValueError(f"{cw}.function.arguments: must be a JSON string (or an object)")
                if isinstance(f["arguments"], str):
                    try:
                        json.loads(f["arguments"])
                    except ValueError as e:
                        raise ValueError(f"{cw}.function.arguments: not JSON ({e}): {f['arguments'][:80]!r}") from None
                call_ids.add(c["id"])
        elif role in ("system", "developer", "user", "tool") and content is None:
            raise ValueError(f"{where}.content: required for a {role} message")
        elif role == "assistant" and content is None and not tool_calls:
            raise ValueError(f"{where}.content: an assistant message needs content or tool_calls")


def validate_tools(tools: Any) -> None:
    """Check OpenAI function tools; ValueError names `tools[i].field`."""
    if not isinstance(tools, list):
        raise ValueError("tools: must be a list")
    names: dict[str, int] = {}
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise ValueError(f"{where}: must be an object")
        if t.get("type") != "function":
            raise ValueError(f"{where}.type: must be 'function', got {t.get('type')!r}")
        f = t.get("function")
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise ValueError(f"{where}.function.name: required")
        if not FUNCTION_NAME.fullmatch(f["name"]):
            raise ValueError(f"{where}.function.name: {f['name']!r} must match {FUNCTION_NAME.pattern} (letters, "
                             f"digits, _ . -, at most 64)")
        if f["name"] in names:
            raise ValueError(f"{where}.function.name: {f['name']!r} is also the name of tools[{names[f['name']]}]; "
                             f"tool names must be unique")
        names[f["name"]] = i
        if "parameters" in f and not isinstance(f["parameters"], dict):
            raise ValueError(f"{where}.function.parameters: must be a JSON schema object")
