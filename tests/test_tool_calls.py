"""Tool-call and reasoning parsing of scripted K2 outputs: the non-streamed message is what K2's format
means (written out by hand here), and streamed deltas, fed at many split points (inside markers too, and
token by token as the engine reports them), reassemble to exactly that message."""

import random

import pytest

from k2jax.serving import reasoning, tool_calls
from k2jax.serving.chat_output import ChatOutputStream, hidden_names, parse_output
from k2jax.serving.deltas import ChatMessage, Delta, ToolCallDelta, assemble
from k2jax.tokenizer import KimiTokenizer
from tests.bpe import write_test_tokenizer

SB, SE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CB, AB, CE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


def call(call_id, args):
    return f"{CB}{call_id}{AB}{args}{CE}"


def tc(call_id, name, args):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return KimiTokenizer.from_dir(write_test_tokenizer(tmp_path_factory.mktemp("tok")))


# name -> (output text, parse_output kwargs, expected message)
SCRIPTS = {
    "one_call": (SB + call("functions.get_weather:0", '{"city": "Beijing"}') + SE, {},
                 ChatMessage(None, None, [tc("functions.get_weather:0", "get_weather", '{"city": "Beijing"}')])),
    "two_parallel_calls": (
        SB + call("functions.get_weather:0", '{"city": "Beijing"}') + "\n"
        + call("functions.get_time:1", ' {"tz": "Asia/Shanghai", "fmt": "<b>"} ') + SE, {},
        ChatMessage(None, None, [tc("functions.get_weather:0", "get_weather", '{"city": "Beijing"}'),
                                 tc("functions.get_time:1", "get_time", '{"tz": "Asia/Shanghai", "fmt": "<b>"}')])),
    "text_then_call": (
        "Let me check the weather for you. " + SB + call("functions.get_weather:3", '{"city": "北京"}') + SE, {},
        ChatMessage("Let me check the weather for you. ", None,
                    [tc("functions.get_weather:3", "get_weather", '{"city": "北京"}')])),
    "call_inside_unterminated_reasoning": (
        "<think>The user wants weather, so I call the tool" + SB
        + call("functions.get_weather:0", '{"city": "Paris"}') + SE, {"reasoning": True},
        ChatMessage(None, "The user wants weather, so I call the tool",
                    [tc("functions.get_weather:0", "get_weather", '{"city": "Paris"}')])),
    "reasoning_then_text_then_call": (
        "<think>plan</think>\n\nOn it. " + SB + call("functions.f.g:0", "{}") + SE + " done",
        {"reasoning": True},
        ChatMessage("\n\nOn it.  done", "plan", [tc("functions.f.g:0", "f.g", "{}")])),
    "malformed_json": (
        "Sure." + SB + call("functions.get_weather:0", '{"city": "Bei') + SE, {},
        ChatMessage('Sure.functions.get_weather:0{"city": "Bei', None, [])),
    "malformed_id": (SB + call("get weather", '{"a": 1}') + SE, {}, ChatMessage("get weather{\"a\": 1}", None, [])),
    "args_not_an_object": (SB + call("functions.f:0", "[1, 2]") + SE, {}, ChatMessage("functions.f:0[1, 2]", None, [])),
    "empty_section": ("hi" + SB + SE, {}, ChatMessage("hi", None, [])),
    "cut_by_max_tokens": (
        "Calling. " + SB + call("functions.get_weather:0", '{"city": "Beijing"}') + CB + "functions.get_time:1" + AB
        + '{"tz": "Asia', {},
        ChatMessage('Calling. functions.get_weather:0{"city": "Beijing"}functions.get_time:1{"tz": "Asia', None, [])),
    "reasoning_cut_by_max_tokens": ("<think>still thinking about it", {"reasoning": True},
                                    ChatMessage(None, "still thinking about it", [])),
    "reasoning_at_start": ("thought</think>answer", {"reasoning": True, "reasoning_at_start": True},
                           ChatMessage("answer", "thought", [])),
    "no_think_tag_with_reasoning_on": ("plain answer <think>not reasoning</think>", {"reasoning": True},
                                       ChatMessage("plain answer <think>not reasoning</think>", None, [])),
    "stray_special_tokens_hidden": ("Hello<|im_middle|> world [EOS]x" + "<|reserved_token_{n}|>", {},
                                    ChatMessage("Hello world x", None, [])),
    # a free model repeats an id: the repeat gets 1 + the largest IDX so far (ids stay unique in a response)
    "repeated_ids_renumbered": (
        SB + call("functions.get_time:4", '{"z": 1}') + call("functions.get_time:2", '{"z": 2}')
        + call("functions.get_time:4", '{"z": 3}') + call("functions.get_weather:4", "{}") + SE
        + SB + call("functions.get_time:2", '{"z": 4}') + SE, {},
        ChatMessage(None, None, [tc("functions.get_time:4", "get_time", '{"z": 1}'),
                                 tc("functions.get_time:2", "get_time", '{"z": 2}'),
                                 tc("functions.get_time:5", "get_time", '{"z": 3}'),
                                 tc("functions.get_weather:4", "get_weather", "{}"),
                                 tc("functions.get_time:6", "get_time", '{"z": 4}')])),
    # a forced call cut by max_tokens: no markup left in content, no calls (finish_reason stays "length")
    "forced_cut_by_max_tokens": (
        SB + call("functions.get_weather:0", '{"city": "Beijing"}') + CB + "functions.get_time:1" + AB + '{"tz": "A',
        {"forced": True}, ChatMessage("", None, [])),
    "forced_reasoning_then_cut": (
        "<think>call it" + SB + CB + "functions.get_time:0" + AB, {"forced": True, "reasoning": True},
        ChatMessage(None, "call it", [])),
    "tools_off": ("a" + SB + call("functions.f:0", "{}") + SE, {"tools": False},
                  ChatMessage("afunctions.f:0{}", None, [])),
}


def _text(name, tok):
    text = SCRIPTS[name][0]
    return text.replace("{n}", str(tok.num_base + 30))


def _kwargs(name, tok):
    kw = {"tools": True, "hide": hidden_names(tok)}
    kw.update(SCRIPTS[name][1])
    return kw


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_non_streamed_message(name, tok):
    text = _text(name, tok)
    # The text is what the engine's decode gives for the generated ids: specials by name.
    ids = tok.encode(text, allow_special=True)
    assert tok.decode(ids) == text
    msg = parse_output(tok.decode(ids), **_kwargs(name, tok))
    assert msg == SCRIPTS[name][2]
    reason = "length" if "cut" in name else "stop"
    assert tool_calls.finish_reason(reason, msg.tool_calls) == ("tool_calls" if msg.tool_calls else reason)


def _stream(text, cuts, kw):
    s = ChatOutputStream(**kw)
    deltas, prev = [], 0
    for c in [*cuts, len(text)]:
        deltas += s.feed(text[prev:c])
        prev = c
    deltas += s.finish()
    return deltas, s


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_streamed_deltas_reassemble_to_the_message(name, tok):
    text, kw = _text(name, tok), _kwargs(name, tok)
    expected = parse_output(text, **kw)
    ids = tok.encode(text, allow_special=True)
    # Token by token, as the engine reports text (incremental decode of the ids so far).
    token_cuts = [len(tok.decode(ids[:i])) for i in range(1, len(ids))]
    splits = [token_cuts, list(range(1, len(text))), []]
    splits += [[c] for c in range(1, len(text))]  # every single split point, markers included
    rng = random.Random(name)
    splits += [sorted(rng.sample(range(1, len(text)), rng.randint(1, min(len(text) - 1, 20)))) for _ in range(100)]
    for cuts in splits:
        deltas, s = _stream(text, cuts, kw)
        assert assemble(deltas) == expected, cuts
        assert s.tool_calls == expected.tool_calls
        for d in deltas:
            assert sum(x is not None for x in (d.content, d.reasoning_content, d.tool_call)) == 1
            assert d.content != "" and d.reasoning_content != ""


def test_tool_call_deltas_come_as_openai_expects():
    text = "Hi " + SB + call("functions.a:0", '{"x": 1}') + call("functions.b:1", '{"y": 2}') + SE
    s = ChatOutputStream(tools=True)
    deltas = s.feed(text[:10]) + s.feed(text[10:]) + s.finish()
    assert deltas == [
        Delta(content="Hi "),
        Delta(tool_call=ToolCallDelta(0, id="functions.a:0", name="a", arguments="")),
        Delta(tool_call=ToolCallDelta(0, arguments='{"x": 1}')),
        Delta(tool_call=ToolCallDelta(1, id="functions.b:1", name="b", arguments="")),
        Delta(tool_call=ToolCallDelta(1, arguments='{"y": 2}')),
    ]
    assert deltas[1].to_openai() == {"tool_calls": [{"index": 0, "id": "functions.a:0", "type": "function",
                                                     "function": {"name": "a", "arguments": ""}}]}
    assert deltas[2].to_openai() == {"tool_calls": [{"index": 0, "function": {"arguments": '{"x": 1}'}}]}
    msg = parse_output(text, tools=True).to_openai()
    assert msg == {"role": "assistant", "content": "Hi ", "tool_calls": [
        tc("functions.a:0", "a", '{"x": 1}'), tc("functions.b:1", "b", '{"y": 2}')]}


def test_content_streams_before_the_section_ends():
    s = ChatOutputStream(tools=True)
    assert s.feed("Hello <|tool_") == [Delta(content="Hello ")]  # the tail may be a marker: held
    assert s.feed("calls_section_begin|>" + CB + "functions.f:0") == []  # inside a section: held
    assert s.feed(AB + "{}" + CE + SE + "bye") == [
        Delta(tool_call=ToolCallDelta(0, id="functions.f:0", name="f", arguments="")),
        Delta(tool_call=ToolCallDelta(0, arguments="{}")), Delta(content="bye")]
    assert s.finish() == []


def test_reasoning_streams_incrementally():
    s = ChatOutputStream(reasoning=True, tools=True)
    assert s.feed(" <thi") == []
    assert s.feed("nk>abc</th") == [Delta(reasoning_content="abc")]
    assert s.feed("ink>x") == [Delta(content="x")]
    plain = ChatOutputStream(reasoning=True)
    assert plain.feed("<b>") == [Delta(content="<b>")]  # not <think>: content at once


def test_parse_without_the_composer():
    text = "pre" + SB + call("functions.x:0", '{"a": [1]}') + SE + "post"
    assert tool_calls.parse(text) == ("prepost", [tc("functions.x:0", "x", '{"a": [1]}')])
    assert tool_calls.parse(SB + call("functions.x:0", "{}") + SE) == (None, [tc("functions.x:0", "x", "{}")])
    singular = "<|tool_call_section_begin|>" + call("functions.x:0", "{}") + "<|tool_call_section_end|>"
    assert tool_calls.parse(singular) == (None, [tc("functions.x:0", "x", "{}")])
    assert tool_calls.parse_call_id("functions.get_weather:12") == "get_weather"
    assert tool_calls.parse_call_id("functions.ns.tool:0") == "ns.tool"
    assert tool_calls.parse_call_id("get_weather:0") == "get_weather"
    for bad in ("functions.get_weather", "functions.a b:0", "functions.:0", "f:x"):
        assert tool_calls.parse_call_id(bad) is None, bad
    assert reasoning.split_reasoning("  <think>r</think>c") == ("r", "c")
    assert reasoning.split_reasoning("c<think>r</think>") == ("", "c<think>r</think>")
    assert reasoning.split_reasoning("r</think>c", reasoning_at_start=True) == ("r", "c")
    assert reasoning.split_reasoning("<think>r" + SB + "x") == ("r", SB + "x")
    assert reasoning.prompt_opens_reasoning("<|im_assistant|>assistant<|im_middle|><think>")
    assert not reasoning.prompt_opens_reasoning("<|im_assistant|>assistant<|im_middle|><think></think>")


def test_special_tokens_kept_when_not_skipped(tok):
    text = "a<|im_middle|>b"
    assert parse_output(text, hide=hidden_names(tok, skip_special_tokens=False)).content == text
    assert parse_output(text, hide=hidden_names(tok)).content == "ab"


def test_a_repeated_id_is_logged(caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="k2jax.serve"):
        _, calls = tool_calls.parse(SB + call("functions.f:0", "{}") + call("functions.f:0", "{}") + SE)
    assert [c["id"] for c in calls] == ["functions.f:0", "functions.f:1"]
    assert "'functions.f:0' repeated in one response: renamed 'functions.f:1'" in caplog.text


def test_parsed_calls_render_back_verbatim(tok):
    """An agent loop's second prompt carries the model's own section and the tool result under its id."""
    from k2jax.serving.chat_template import ChatTemplate

    out = "Checking. " + SB + call("functions.get_weather:0", '{"city": "Beijing"}') + SE
    msg = parse_output(out, tools=True, hide=hidden_names(tok))
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    prompt = ChatTemplate.builtin().render(
        [{"role": "user", "content": "Weather?"}, msg.to_openai(),
         {"role": "tool", "tool_call_id": msg.tool_calls[0]["id"], "content": "Sunny"}], tools=tools)
    assert "<|im_assistant|>assistant<|im_middle|>" + out + "<|im_end|>" in prompt
    assert prompt.endswith("<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\nSunny<|im_end|>"
                           "<|im_assistant|>assistant<|im_middle|>")
