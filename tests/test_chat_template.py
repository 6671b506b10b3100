"""k2jax.serving.chat_template: rendering equals transformers' own apply_chat_template(tokenize=False) on the
same jinja template (the oracle), and bad messages are refused with the index and field named."""

import json

import pytest

from k2jax.serving.chat_template import BUILTIN_TEMPLATE, ChatTemplate
from k2jax.tokenizer import KimiTokenizer
from tests.bpe import write_test_tokenizer

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather now <in> a \"city\" & region, e.g. 北京",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                        "unit": {"type": "string", "enum": ["c", "f"]}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Local time", "parameters": {
            "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}},
]

# Three agent turns: a system prompt, tools, parallel calls with their results, a call answered then a final
# answer, and a third request that is mid-turn (its last message is a tool result).
AGENT = [
    {"role": "system", "content": "You are a careful assistant."},
    {"role": "user", "content": "Weather and time in Beijing?"},
    {"role": "assistant", "content": None, "reasoning_content": "Two tools at once.", "tool_calls": [
        {"id": "functions.get_weather:0", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Beijing\"}"}},
        {"id": "functions.get_time:1", "type": "function",
         "function": {"name": "get_time", "arguments": "{\"tz\": \"Asia/Shanghai\"}"}}]},
    {"role": "tool", "tool_call_id": "functions.get_weather:0", "name": "get_weather",
     "content": "{\"weather\": \"Sunny\", \"temp\": 31}"},
    {"role": "tool", "tool_call_id": "functions.get_time:1", "content": "14:05"},
    {"role": "assistant", "content": "Sunny, 31°C, and it is 14:05."},
    {"role": "user", "content": [{"type": "text", "text": "And in "}, {"type": "text", "text": "Paris?"}]},
    {"role": "assistant", "content": "Checking.", "reasoning_content": "One more call.", "tool_calls": [
        {"id": "functions.get_weather:2", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}]},
    {"role": "tool", "tool_call_id": "functions.get_weather:2", "content": "Rain"},
]

SPECIAL = {"bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]", "pad_token": "[PAD]"}

# A second template in K2-Thinking's shape, written to use what transformers offers templates: namespace,
# loop controls, tojson's options, raise_exception, strftime_now, the `thinking` alias of reasoning_content,
# special-token variables and chat_template_kwargs (thinking on by default).
THINKING_FORMAT = """\
{%- set thinking = thinking if thinking is defined else true -%}
{%- set ns = namespace(last=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last = loop.index0 -%}{%- endif -%}{%- endfor -%}
{{ bos_token }}
{%- if tools %}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson(sort_keys=true) }}<|im_end|>{% endif %}
{%- for m in messages %}
  {%- if m.role not in ['system', 'developer', 'user', 'assistant', 'tool'] %}
    {{- raise_exception('bad role ' + m.role) }}
  {%- endif %}
  {%- if m.role == 'user' %}<|im_user|>user<|im_middle|>
  {%- elif m.role == 'assistant' %}<|im_assistant|>assistant<|im_middle|>
  {%- else %}<|im_system|>{{ m.get('name') or m.role }}<|im_middle|>{% endif %}
  {%- if m.role == 'assistant' %}
    {%- if thinking and loop.index0 > ns.last %}<think>{{ m.get('thinking', '') }}</think>{% else %}<think></think>{% endif %}
    {%- if m.content is string %}{{ m.content }}{% endif %}
    {%- if m.tool_calls %}<|tool_calls_section_begin|>
      {%- for c in m.tool_calls %}<|tool_call_begin|>{{ c.id }}<|tool_call_argument_begin|>
        {%- if c.function.arguments is string %}{{ c.function.arguments }}{% else %}{{ c.function.arguments | tojson(indent=1) }}{% endif %}<|tool_call_end|>
        {%- if loop.index >= 8 %}{% break %}{% endif %}
      {%- endfor %}<|tool_calls_section_end|>
    {%- endif %}
  {%- elif m.role == 'tool' %}## Return of {{ m.tool_call_id }}
{{ m.content }}
  {%- elif m.content is string %}{{ m.content }}
  {%- else %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% if not thinking %}<think></think>{% endif %}{% endif %}
{%- if stamp is defined %}{{ strftime_now('%Y') }}{% endif %}
"""


def _reference(oracle, template: ChatTemplate, messages, tools=None, add_generation_prompt=True, **kwargs) -> str:
    out = oracle.run({"chat_template": {"template": template.source, "messages": messages, "tools": tools,
                                        "add_generation_prompt": add_generation_prompt, "kwargs": kwargs,
                                        "special_tokens": template.special_tokens}})
    return str(out["chat_template.text"])


@pytest.fixture(scope="module")
def builtin():
    return ChatTemplate.builtin(SPECIAL)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return KimiTokenizer.from_dir(write_test_tokenizer(tmp_path_factory.mktemp("tok")))


CASES = {
    "agent": (AGENT, TOOLS, {}),
    "agent_thinking_false": (AGENT, TOOLS, {"thinking": False}),
    "agent_thinking_true": (AGENT, TOOLS, {"thinking": True}),
    "developer_role": ([{"role": "developer", "content": "Answer in French."},
                        {"role": "user", "content": "Hi", "name": "ana"}], None, {}),
    "no_system": ([{"role": "user", "content": "Hi"}], None, {}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_builtin_matches_transformers(oracle, builtin, case):
    messages, tools, kwargs = CASES[case]
    assert builtin.render(messages, tools=tools, **kwargs) == _reference(oracle, builtin, messages, tools, **kwargs)


@pytest.mark.parametrize("case", sorted(CASES))
def test_thinking_format_matches_transformers(oracle, case):
    template = ChatTemplate(THINKING_FORMAT, special_tokens=SPECIAL)
    messages, tools, kwargs = CASES[case]
    assert template.render(messages, tools=tools, **kwargs) == _reference(oracle, template, messages, tools, **kwargs)
    ours = template.render(messages, tools=tools, add_generation_prompt=False, stamp=1)
    assert ours == _reference(oracle, template, messages, tools, add_generation_prompt=False, stamp=1)


def test_builtin_renders_k2_format(builtin):
    text = builtin.render(AGENT, tools=TOOLS)
    compact = json.dumps(TOOLS, separators=(",", ":"), ensure_ascii=False)
    assert text.startswith(f"<|im_system|>tool_declare<|im_middle|>{compact}<|im_end|>"
                           "<|im_system|>system<|im_middle|>You are a careful assistant.<|im_end|>")
    assert ("<|im_assistant|>assistant<|im_middle|><|tool_calls_section_begin|><|tool_call_begin|>"
            "functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"Beijing\"}<|tool_call_end|>"
            "<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{\"tz\": \"Asia/Shanghai\"}"
            "<|tool_call_end|><|tool_calls_section_end|><|im_end|>") in text
    assert ("<|im_system|>get_weather<|im_middle|>## Return of functions.get_weather:0\n"
            "{\"weather\": \"Sunny\", \"temp\": 31}<|im_end|>") in text
    assert "<|im_system|>tool<|im_middle|>## Return of functions.get_time:1\n14:05<|im_end|>" in text
    assert "<think>" not in text and text.endswith("<|im_assistant|>assistant<|im_middle|>")
    # Thinking on: the turn after the last user message carries its reasoning; the prompt opens <think>.
    on = builtin.render(AGENT, tools=TOOLS, thinking=True)
    assert "<|im_middle|><think>One more call.</think>Checking.<|tool_calls_section_begin|>" in on
    assert "<think>Two tools at once.</think>" not in on and on.endswith("<|im_middle|><think>")
    assert builtin.render(AGENT, tools=TOOLS, thinking=False) == text
    assert not builtin.thinking({}) and builtin.thinking({"thinking": True})
    dev = builtin.render(CASES["developer_role"][0])
    assert dev.startswith("<|im_system|>developer<|im_middle|>Answer in French.<|im_end|><|im_user|>ana<|im_middle|>")
    assert builtin.render([{"role": "user", "content": "Hi"}]).startswith(
        "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>")


def test_rendered_text_tokenizes_markers_as_special_ids(builtin, tok):
    text = builtin.render(AGENT, tools=TOOLS)
    ids = tok.encode(text, allow_special=True)
    for marker in ("<|tool_calls_section_begin|>", "<|tool_call_argument_begin|>", "<|im_middle|>"):
        assert tok.special_tokens[marker] in ids
    assert tok.decode(ids) == text


def test_from_tokenizer_dir(tmp_path, tok):
    d = write_test_tokenizer(tmp_path / "tok")
    assert ChatTemplate.from_tokenizer_dir(d).source == BUILTIN_TEMPLATE.read_text()  # none shipped
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["eos_token"] = {"content": "<|im_end|>"}
    cfg["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "{{ eos_token }}"}]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = ChatTemplate.from_tokenizer_dir(d)
    assert t.render([{"role": "user", "content": "x"}]) == "<|im_end|>" and not t.is_thinking
    cfg["chat_template"] = "{{ messages[0].content }}<think>"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = ChatTemplate.from_tokenizer_dir(d)
    assert t.render([{"role": "user", "content": "x"}]) == "x<think>"
    assert t.thinking({}) and not t.thinking({"thinking": False})  # thinking formats think by default
    override = tmp_path / "mine.jinja"
    override.write_text("{{ bos_token }}{{ messages | length }}")
    assert ChatTemplate.from_tokenizer_dir(d, override).render([{"role": "user", "content": "x"}]) == "[BOS]1"
    with pytest.raises(ValueError, match="not found"):
        ChatTemplate.from_tokenizer_dir(d, tmp_path / "missing.jinja")
    cfg["chat_template"] = [{"name": "tool_use", "template": "T"}]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="default"):
        ChatTemplate.from_tokenizer_dir(d)
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "chat_template.jinja").write_text("J{{ messages[0].role }}")
    assert ChatTemplate.from_tokenizer_dir(d).render([{"role": "user", "content": "x"}]) == "Juser"


BAD = [
    ([{"role": "robot", "content": "x"}], r"messages\[0\]\.role"),
    ([{"role": "user", "content": "x"}, {"role": "tool", "content": "42"}], r"messages\[1\]\.tool_call_id"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{}"}}]}], r"messages\[1\]\.tool_calls\[0\]\.id"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"id": "functions.f:0", "type": "function", "function": {"arguments": "{}"}}]}],
     r"messages\[1\]\.tool_calls\[0\]\.function\.name"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     r"messages\[0\]\.content\[0\]\.type"),
    ([{"role": "user", "content": 5}], r"messages\[0\]\.content"),
    ([{"role": "user"}], r"messages\[0\]\.content"),
    ([{"role": "assistant", "content": None}], r"messages\[0\]\.content"),
    ([{"role": "user", "content": "x", "tool_calls": []}], r"messages\[0\]\.tool_calls"),
    (["hello"], r"messages\[0\]"),
    ([], r"messages"),
]


@pytest.mark.parametrize("messages,field", BAD)
def test_bad_messages_raise_value_error(builtin, messages, field):
    with pytest.raises(ValueError, match=field):
        builtin.render(messages)


def test_bad_tools_kwargs_and_template_errors(builtin):
    ok = [{"role": "user", "content": "x"}]
    with pytest.raises(ValueError, match=r"tools\[0\]\.type"):
        builtin.render(ok, tools=[{"type": "retrieval"}])
    with pytest.raises(ValueError, match=r"tools\[1\]\.function\.name"):
        builtin.render(ok, tools=[TOOLS[0], {"type": "function", "function": {}}])
    with pytest.raises(ValueError, match="chat_template_kwargs"):
        builtin.render(ok, documents=[])
    raising = ChatTemplate("{{ raise_exception('no ' + messages[0].role + ' here') }}")
    with pytest.raises(ValueError, match="no user here"):
        raising.render(ok)
    with pytest.raises(ValueError, match="syntax error"):
        ChatTemplate("{% if %}")
    sneaky = ChatTemplate("{% set ns = namespace() %}{% set ns._x = 1 %}")
    with pytest.raises(ValueError):
        sneaky.render(ok)
    escape = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ValueError):
        escape.render(ok)
