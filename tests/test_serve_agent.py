"""Tools and reasoning through `k2jax serve`, driven by the real `openai` client, on a scripted model
(tests/scripted_server.py: the real server whose runner emits fixed token sequences, chosen by the request's
seed, and records every prompt it is fed).

Two servers over one tokenizer (Kimi's special-token layout, with `<think>` and `</think>` named as in
K2-Thinking): `thinking` renders the chat template shipped in the tokenizer's tokenizer_config.json (a
K2-Thinking-shaped template that thinks by default), `k2` overrides it with `--chat-template` (the built-in K2
template, thinking off unless asked). Prompts are checked against transformers' apply_chat_template on the
same template (the oracle) tokenized by the tokenizer; outputs against messages written out by hand, streamed
and not (the stream reassembled as an OpenAI client does must equal the whole message)."""

from __future__ import annotations

import json
import sys

import openai
import pytest

from k2jax.serving.chat_template import BUILTIN_TEMPLATE, ChatTemplate
from k2jax.serving.openai_fields import choice_seed
from tests.serve_util import MERGES, free_port, running
from tests.test_chat_template import AGENT, THINKING_FORMAT, TOOLS

SB, SE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CB, AB, CE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
THINK_IDS = {22: "<think>", 23: "</think>"}  # offsets in the special block, as K2-Thinking's tokenizer has them


def call(call_id, args):
    return f"{CB}{call_id}{AB}{args}{CE}"


def tc(call_id, name, args):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def msg(content=None, reasoning=None, calls=()):
    return {"content": content, "reasoning_content": reasoning, "tool_calls": list(calls)}


WEATHER = '{"city": "Beijing"}'
CUT_HEAD = "Calling. " + SB + call("functions.get_weather:0", WEATHER) + CB + "functions.get_time:1" + AB
# seed -> (script, expected message, finish_reason)
SCRIPTS = {
    1: (SB + call("functions.get_weather:0", WEATHER) + SE,
        msg(calls=[tc("functions.get_weather:0", "get_weather", WEATHER)]), "tool_calls"),
    2: (SB + call("functions.get_weather:0", WEATHER) + "\n" + call("functions.get_time:1", '{"tz": "Asia/Shanghai"}')
        + SE, msg(calls=[tc("functions.get_weather:0", "get_weather", WEATHER),
                         tc("functions.get_time:1", "get_time", '{"tz": "Asia/Shanghai"}')]), "tool_calls"),
    3: ("Let me check the weather for you. " + SB + call("functions.get_weather:3", '{"city": "北京"}') + SE,
        msg("Let me check the weather for you. ", calls=[tc("functions.get_weather:3", "get_weather",
                                                           '{"city": "北京"}')]), "tool_calls"),
    4: ("<think>The user wants the weather, so I call the tool" + SB + call("functions.get_weather:0", WEATHER) + SE,
        msg(reasoning="The user wants the weather, so I call the tool",
            calls=[tc("functions.get_weather:0", "get_weather", WEATHER)]), "tool_calls"),
    5: ("Sure." + SB + call("functions.get_weather:0", '{"city": "Bei') + SE,
        msg('Sure.functions.get_weather:0{"city": "Bei'), "stop"),
    6: (CUT_HEAD + '{"tz": "Asia/Shanghai"}' + CE + SE,
        msg('Calling. functions.get_weather:0{"city": "Beijing"}functions.get_time:1'), "length"),
    7: ("<think>Sunny, say so.</think>It is sunny.", msg("It is sunny.", "Sunny, say so."), "stop"),
    8: ("Hello<|im_middle|> world<|tool_call_end|>!", msg("Hello world!"), "stop"),
    9: ("Plan it.</think>It is sunny.", msg("It is sunny.", "Plan it."), "stop"),  # after a prompt ending in <think>
    # the agent loop: a call, then the answer once the tool has spoken
    10: (SB + call("functions.get_weather:0", WEATHER) + SE, None, "tool_calls"),
    11: ("It is sunny in Beijing, 31°C.", None, "stop"),
}
N_SEED = 20  # n=2: choice 0 runs script 1, choice 1 script 3
SEEDS = {str(k): v[0] for k, v in SCRIPTS.items()} | {
    str(N_SEED): SCRIPTS[1][0], str(choice_seed(N_SEED, 1) % 2**32): SCRIPTS[3][0]}
USER = [{"role": "user", "content": "Weather in Beijing?"}]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from k2jax.tokenizer import KimiTokenizer
    from tests.bpe import write_test_tokenizer

    root = tmp_path_factory.mktemp("agent")
    d = write_test_tokenizer(root / "tok", num_merges=MERGES)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    base = KimiTokenizer.from_dir(d).num_base
    for off, name in THINK_IDS.items():
        cfg["added_tokens_decoder"][str(base + off)]["content"] = name
    cfg["chat_template"] = THINKING_FORMAT
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (root / "scripts.json").write_text(json.dumps(SEEDS))
    return root, d


@pytest.fixture(scope="module")
def tok(files):
    from k2jax.tokenizer import KimiTokenizer

    return KimiTokenizer.from_dir(files[1])


class Scripted:
    def __init__(self, port, record):
        self.port, self.record = port, record
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)

    def prompts(self, seed) -> list[list[int]]:
        """The prompts the model was fed for requests with this seed, in order."""
        if not self.record.exists():
            return []
        lines = [json.loads(x) for x in self.record.read_text().splitlines()]
        return [x["prompt"] for x in lines if x["seed"] == seed % 2**32]

    def tokenize(self, **body) -> list[int]:
        import httpx

        r = httpx.post(f"http://127.0.0.1:{self.port}/tokenize", json=body, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["tokens"]


def _server(files, name, *extra):
    root, tok_dir = files
    port = free_port()
    record = root / f"{name}.jsonl"
    argv = [sys.executable, "-m", "tests.scripted_server", "--scripts", str(root / "scripts.json"), "--record",
            str(record), "--demo", "--tokenizer", str(tok_dir), "--port", str(port), "--no-prefix-cache",
            "--max-len", "2048", "--max-batch", "4", "--model-name", "scripted", *extra]
    return running([argv], port), Scripted(port, record)


@pytest.fixture(scope="module")
def thinking(files):
    ctx, s = _server(files, "thinking")
    with ctx:
        yield s


@pytest.fixture(scope="module")
def k2(files):
    ctx, s = _server(files, "k2", "--chat-template", str(BUILTIN_TEMPLATE))
    with ctx:
        yield s


# --- what the client sees -------------------------------------------------------------------------------

def whole(r, i=0):
    """(message, finish_reason) of a non-streamed choice, in the expected messages' shape."""
    c = r.choices[i]
    m = c.message
    calls = [tc(t.id, t.function.name, t.function.arguments) for t in m.tool_calls or []]
    assert all(t.type == "function" for t in m.tool_calls or [])
    return msg(m.content, getattr(m, "reasoning_content", None), calls), c.finish_reason


def assembled(stream, n=1):
    """[(message, finish_reason)] per choice of a stream, joined as an OpenAI client joins deltas; checks
    that each tool call's id and name come first and only once."""
    parts = [{"content": "", "reasoning": "", "calls": {}, "finish": None} for _ in range(n)]
    for chunk in stream:
        for c in chunk.choices:
            p, d = parts[c.index], c.delta
            p["content"] += d.content or ""
            p["reasoning"] += getattr(d, "reasoning_content", None) or ""
            for t in d.tool_calls or []:
                if t.index not in p["calls"]:
                    assert t.id and t.function.name and t.type == "function", t  # the header first
                    p["calls"][t.index] = tc(t.id, t.function.name, "")
                else:
                    assert t.id is None and t.function.name is None, t
                p["calls"][t.index]["function"]["arguments"] += t.function.arguments or ""
            if c.finish_reason:
                assert p["finish"] is None
                p["finish"] = c.finish_reason
    out = []
    for p in parts:
        assert sorted(p["calls"]) == list(range(len(p["calls"])))
        calls = [p["calls"][i] for i in range(len(p["calls"]))]
        out.append((msg(p["content"] or None, p["reasoning"] or None, calls), p["finish"]))
    return out


def both(server, **kw):
    """The non-streamed and the reassembled streamed answer of the same request (checked equal)."""
    r = server.client.chat.completions.create(model="scripted", **kw)
    s = assembled(server.client.chat.completions.create(model="scripted", stream=True, **kw), kw.get("n", 1))
    got = [whole(r, i) for i in range(len(r.choices))]
    for (m, f), (sm, sf) in zip(got, s):
        # an empty content is null in the message and absent from the stream
        assert (sm | {"content": sm["content"] or None}, sf) == (m | {"content": m["content"] or None}, f)
    return got[0] if len(got) == 1 else got


def max_tokens_for(tok, seed):
    """The scripts cut by max_tokens end right after a special marker (a token boundary in any tokenization)."""
    return len(tok.encode(CUT_HEAD, allow_special=True)) if seed == 6 else None


# --- prompts ----------------------------------------------------------------------------------------------

def _oracle_ids(oracle, template: ChatTemplate, tok, messages, tools=None, **kwargs) -> list[int]:
    out = oracle.run({"chat_template": {"template": template.source, "messages": messages, "tools": tools,
                                        "add_generation_prompt": True, "kwargs": kwargs,
                                        "special_tokens": template.special_tokens}})
    return tok.encode(str(out["chat_template.text"]), allow_special=True)


@pytest.mark.parametrize("which", ["thinking", "k2"])
@pytest.mark.parametrize("kwargs", [{}, {"thinking": False}], ids=["default", "thinking_off"])
def test_the_prompt_equals_transformers_rendering(which, kwargs, request, oracle, files, tok):
    """A 3-turn agent conversation (system prompt, tools, parallel calls and their results, reasoning, a
    call answered, a pending tool result): /tokenize and the prompt a chat request feeds the model both
    equal transformers' apply_chat_template on the same template, tokenized."""
    server = request.getfixturevalue(which)
    template = ChatTemplate.from_tokenizer_dir(files[1], None if which == "thinking" else BUILTIN_TEMPLATE)
    want = _oracle_ids(oracle, template, tok, AGENT, TOOLS, **kwargs)
    extra = {"chat_template_kwargs": kwargs} if kwargs else {}
    assert server.tokenize(messages=AGENT, tools=TOOLS, **extra) == want
    seed = 100 + len(kwargs) + (10 if which == "k2" else 0)  # no script: the answer ends at once
    r = server.client.chat.completions.create(model="scripted", messages=AGENT, tools=TOOLS, seed=seed,
                                              extra_body=extra)
    assert server.prompts(seed)[-1] == want
    assert r.usage.prompt_tokens == len(want) and r.choices[0].finish_reason == "stop"
    text = tok.decode(want)
    assert "## Return of functions.get_weather:0\n" in text and "<|tool_call_begin|>functions.get_time:1" in text
    if which == "thinking":  # thinking off: the template closes the reasoning in the prompt
        assert text.endswith("<|im_middle|><think></think>" if kwargs else "<|im_middle|>")


def test_developer_role_and_message_errors_name_the_field(k2):
    c = k2.client
    r = c.chat.completions.create(model="scripted", messages=[{"role": "developer", "content": "Be terse."}] + USER,
                                  seed=200)
    assert r.choices[0].finish_reason == "stop"
    assert k2.tokenize(messages=[{"role": "developer", "content": "Be terse."}] + USER) == k2.prompts(200)[-1]
    bad = [
        ({"messages": USER + [{"role": "tool", "content": "42"}]}, "messages[1].tool_call_id"),
        ({"messages": USER + [{"role": "assistant", "tool_calls": [{"type": "function", "function": {
            "name": "f", "arguments": "{}"}}]}]}, "messages[1].tool_calls[0].id"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": USER, "tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"messages": USER, "tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"messages": USER, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name"),
        ({"messages": USER, "tool_choice": "required"}, "tool_choice"),
        ({"messages": USER, "response_format": {"type": "yaml"}}, "response_format.type"),
        ({"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "strict": True, "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}},
         "response_format.json_schema.schema"),
        ({"messages": USER, "chat_template_kwargs": ["thinking"]}, "chat_template_kwargs"),
        ({"messages": USER, "functions": [{"name": "f"}]}, "functions"),
        ({"messages": USER, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ]
    for body, param in bad:
        body = dict(body)
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="scripted", messages=body.pop("messages"), extra_body=body)
        assert e.value.body["param"] == param, (param, e.value.body)
        assert param.split(".")[0].split("[")[0] in e.value.body["message"]


# --- tool calls and reasoning from the scripted model ------------------------------------------------------

@pytest.mark.parametrize("seed", [1, 2, 3, 5, 6, 8])
def test_tool_calls_streamed_and_not(k2, tok, seed):
    script, want, finish = SCRIPTS[seed]
    got = both(k2, messages=USER, tools=TOOLS, seed=seed, max_tokens=max_tokens_for(tok, seed))
    assert got == (want, finish)
    for m in (got[0]["content"] or "", got[0]["reasoning_content"] or ""):
        assert "<|" not in m  # special tokens never leak


def test_reasoning_and_a_call_inside_unterminated_reasoning(thinking):
    for seed in (4, 7):
        _, want, finish = SCRIPTS[seed]
        assert both(thinking, messages=USER, tools=TOOLS, seed=seed) == (want, finish)
    # without tools the reasoning is still apart; with thinking off it is not parsed (and <think> is hidden)
    assert both(thinking, messages=USER, seed=7) == (SCRIPTS[7][1], "stop")
    off = both(thinking, messages=USER, seed=7, extra_body={"chat_template_kwargs": {"thinking": False}})
    assert off == (msg("Sunny, say so.It is sunny."), "stop")


def test_reasoning_when_the_prompt_opens_it(k2, tok):
    """The built-in template with thinking: true ends the prompt inside <think>: the output starts as
    reasoning."""
    on = {"chat_template_kwargs": {"thinking": True}}
    assert k2.tokenize(messages=USER, **on)[-1] == tok.special_tokens["<think>"]
    assert both(k2, messages=USER, tools=TOOLS, seed=9, extra_body=on) == (SCRIPTS[9][1], "stop")
    assert both(k2, messages=USER, seed=9) == (msg("Plan it.It is sunny."), "stop")  # thinking off by default


def test_tool_choice_none_and_special_tokens(k2):
    # "none": no parsing; the markers are special tokens, so skip_special_tokens (the default) drops them
    assert both(k2, messages=USER, tools=TOOLS, tool_choice="none", seed=1) == (
        msg("functions.get_weather:0" + WEATHER), "stop")
    # no tools: plain detokenization, specials skipped too
    assert both(k2, messages=USER, seed=8) == (msg("Hello world!"), "stop")
    # skip_special_tokens false: the parser still reads the section; stray specials stay in the content
    assert both(k2, messages=USER, tools=TOOLS, seed=8, extra_body={"skip_special_tokens": False}) == (
        msg("Hello<|im_middle|> world<|tool_call_end|>!"), "stop")
    got = both(k2, messages=USER, tools=TOOLS, seed=1, extra_body={"skip_special_tokens": False})
    assert got == (SCRIPTS[1][1], "tool_calls")


def test_n_choices_parse_apart_and_parallel_tool_calls_false(k2):
    got = both(k2, messages=USER, tools=TOOLS, seed=N_SEED, n=2)
    assert got == [SCRIPTS[1][1:], SCRIPTS[3][1:]]
    one = both(k2, messages=USER, tools=TOOLS, seed=2, parallel_tool_calls=False)
    assert one == (msg(calls=SCRIPTS[2][1]["tool_calls"][:1]), "tool_calls")


def test_an_agent_loop_over_http(k2, oracle, files, tok):
    """tools -> a call -> a tool message answering that id -> the final answer; the second prompt is the
    template's rendering of the whole exchange, the model's own call section verbatim in it."""
    c = k2.client
    r1 = c.chat.completions.create(model="scripted", messages=USER, tools=TOOLS, seed=10)
    assert r1.choices[0].finish_reason == "tool_calls"
    call_ = r1.choices[0].message.tool_calls[0]
    assert (call_.id, call_.function.name, json.loads(call_.function.arguments)) == (
        "functions.get_weather:0", "get_weather", {"city": "Beijing"})
    result = '{"weather": "Sunny", "temp": 31}'
    messages = USER + [r1.choices[0].message.model_dump(exclude_none=True),
                       {"role": "tool", "tool_call_id": call_.id, "content": result}]
    r2 = c.chat.completions.create(model="scripted", messages=messages, tools=TOOLS, seed=11)
    assert (r2.choices[0].message.content, r2.choices[0].finish_reason) == ("It is sunny in Beijing, 31°C.", "stop")
    assert not r2.choices[0].message.tool_calls
    prompt = k2.prompts(11)[-1]
    template = ChatTemplate.from_tokenizer_dir(files[1], BUILTIN_TEMPLATE)
    assert prompt == _oracle_ids(oracle, template, tok, messages, TOOLS)
    text = tok.decode(prompt)
    assert ("<|im_assistant|>assistant<|im_middle|>" + SCRIPTS[10][0] + "<|im_end|><|im_system|>tool<|im_middle|>"
            "## Return of functions.get_weather:0\n" + result + "<|im_end|>") in text


def test_a_failed_step_ends_every_request_and_stops_the_server(files):
    """A step that raises (the scripted runner, on a row of one seed; a device or compiler error would do the
    same): the requests in flight end with "abort" (a stream with it, then [DONE]; a request with no token yet
    gets a 503), /health says why with a 503 until the process exits, with status 1 (for a supervisor to start
    it afresh), and the log says which step failed."""
    import subprocess

    import httpx

    from tests.serve_util import REPO, env, stream_in_background, wait_ready

    root, tok_dir = files
    port = free_port()
    argv = [sys.executable, "-m", "tests.scripted_server", "--scripts", str(root / "scripts.json"), "--fail-seed",
            "666", "--demo", "--tokenizer", str(tok_dir), "--port", str(port), "--max-len", "2048", "--max-batch",
            "4", "--model-name", "scripted"]
    proc = subprocess.Popen(argv, env=env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_ready(port, [proc])
        # no script for its seed: it emits the end token, ignored, until the step fails
        lines, reader = stream_in_background(port, {"model": "scripted", "prompt": "x", "max_tokens": 2000,
                                                    "seed": 7, "stream": True, "ignore_eos": True}, timeout=60)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model="scripted", prompt="y", max_tokens=8, seed=666)
        assert e.value.status_code == 503 and "aborted after 0 tokens" in str(e.value)
        reader.join(60)
        assert lines[-1] == "data: [DONE]", lines[-3:]
        assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "abort", lines[-3:]
        try:
            health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
            assert health.status_code == 503 and "scripted failure" in health.json()["error"], health.text
        except httpx.TransportError:  # the process had stopped already
            pass
        assert proc.wait(timeout=60) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
        out = proc.communicate()[0]
    assert "a step failed: RuntimeError: scripted failure: a row of seed 666" in out, out[-3000:]
