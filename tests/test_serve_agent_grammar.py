"""Constrained decoding through `k2jax serve --demo` (the random-weight demo model), with the real `openai`
client: tool_choice "required" / a named function, parallel_tool_calls, an agent loop over three turns, and
response_format json_schema / json_object. Every output is checked by an independent validator (json,
jsonschema, a regular expression for the ids), never by the grammar library itself, and nothing steers the
model: no logit_bias anywhere. A random model left free keeps calling tools and pads every gap JSON allows
with whitespace; the server's grammar bounds both (ids by construction, a section that closes within
max_tokens, compact JSON), which is what these tests hold it to. The server runs the demo model in float32,
where a seed's tokens do not depend on the batch it runs in (bf16 steps of other batch sizes round
differently), so a streamed answer can be compared with the whole one token for token.

Figures the goals ask for (finish rates, calls per answer, whitespace fractions) are printed (`pytest -s`)."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest

from tests.serve_util import demo_server, metric

MAX_TOKENS = 256
SEEDS = range(20)  # at temperature 1, and one more request at temperature 0


def _obj(props, required=None):
    return {"type": "object", "properties": props, "required": list(required or props), "additionalProperties": False}


# The two tools of the issue's trial: an enum city and 1..7 days; an enum zone.
AGENT_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast for a city",
                                      "parameters": _obj({"city": {"enum": ["Beijing", "Paris", "Lima"]},
                                                          "days": {"type": "integer", "minimum": 1, "maximum": 7}})}},
    {"type": "function", "function": {"name": "get_time", "description": "The time now in a zone",
                                      "parameters": _obj({"zone": {"enum": ["CET", "UTC", "JST"]}})}},
]
# Nested objects, strings, arrays, a strict tool.
TOOLS = [
    {"type": "function", "function": {"name": "weather_now", "description": "Weather now", "parameters": _obj(
        {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}})}},
    {"type": "function", "function": {"name": "book", "strict": True, "parameters": _obj(
        {"when": _obj({"day": {"type": "integer", "minimum": 1, "maximum": 31}, "slot": {"enum": ["am", "pm"]}}),
         "guests": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2}})}},
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS + AGENT_TOOLS}
ENUM_SCHEMA = _obj({"city": {"enum": ["Beijing", "Paris", "Lima", "Cairo"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 14},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                    "alerts": {"type": "array", "items": {"enum": ["rain", "wind", "heat"]}, "maxItems": 3}})
SCHEMAS = [
    _obj({"name": {"type": "string", "maxLength": 8}, "color": {"enum": ["red", "green", "blue"]},
          "size": _obj({"w": {"type": "integer", "minimum": 0, "maximum": 99},
                        "h": {"type": "integer", "minimum": 0, "maximum": 99}}),
          "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2}},
         required=["name", "color", "size"]),
    _obj({"ok": {"type": "boolean"}, "level": {"enum": ["low", "mid", "high", None]},
          "items": {"type": "array", "minItems": 1, "maxItems": 2,
                    "items": _obj({"id": {"type": "integer", "minimum": 0, "maximum": 9},
                                   "kind": {"enum": ["a", "b"]}})}}),
    _obj({"user": _obj({"id": {"type": "integer", "minimum": 1, "maximum": 500},
                        "role": {"enum": ["admin", "guest"]},
                        "prefs": _obj({"dark": {"type": "boolean"}, "lang": {"enum": ["en", "zh", "fr"]}})}),
          "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 10}, "maxItems": 3}},
         required=["user"]),
    _obj({"answer": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 6}]},
          "confidence": {"enum": ["low", "high"]}}),
    _obj({"matrix": {"type": "array", "maxItems": 2, "items": {"type": "array", "maxItems": 2,
                                                              "items": {"enum": [0, 1]}}},
          "label": {"type": "string", "maxLength": 5}}),
]
CALL_ID = re.compile(r"functions\.(?P<name>[A-Za-z0-9_.\-]+):(?P<idx>0|[1-9][0-9]*)")


@pytest.fixture(scope="module")
def demo():
    with demo_server("--max-batch", "8", "--max-len", "1024", "--prefill-chunk", "256") as port:
        yield port


@pytest.fixture(scope="module")
def whitespace_ids():
    """The demo tokenizer's whitespace-only tokens."""
    from k2jax.synthetic import demo_tokenizer

    tok = demo_tokenizer()  # the tokenizer `serve --demo` serves
    return {i for i in range(tok.num_base) if tok.decode_bytes([i]) and not tok.decode_bytes([i]).strip()}


def aclient(port):
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=1800)


def user(i):
    return [{"role": "user", "content": f"Task {i}: what is the weather, or the time?"}]


async def _chat(c, stream=False, **kw):
    """One chat request -> (message dict, finish_reason, token ids, prompt tokens), streamed or not. A stream
    is joined as an OpenAI client joins it, checking that each call's first delta carries its id and name
    (and only it)."""
    kw = {"model": "k2jax-demo", "max_tokens": MAX_TOKENS} | kw
    if not stream:
        r = await c.chat.completions.create(**kw)
        ch = r.choices[0]
        calls = [{"id": t.id, "name": t.function.name, "arguments": t.function.arguments}
                 for t in ch.message.tool_calls or []]
        assert all(t.type == "function" for t in ch.message.tool_calls or [])
        return {"content": ch.message.content, "calls": calls}, ch.finish_reason, ch.token_ids, r.usage.prompt_tokens
    content, calls, ids, finish, usage = "", {}, [], None, None
    async for chunk in await c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage.prompt_tokens
        for ch in chunk.choices:
            content += ch.delta.content or ""
            ids += ch.token_ids
            for t in ch.delta.tool_calls or []:
                if t.index not in calls:
                    assert t.id and t.function.name and t.type == "function", t  # the header first
                    calls[t.index] = {"id": t.id, "name": t.function.name, "arguments": ""}
                else:
                    assert t.id is None and t.function.name is None, t
                calls[t.index]["arguments"] += t.function.arguments or ""
            if ch.finish_reason:
                assert finish is None
                finish = ch.finish_reason
    assert sorted(calls) == list(range(len(calls)))
    return {"content": content or None, "calls": [calls[i] for i in range(len(calls))]}, finish, ids, usage


def check_calls(msg, finish, first=0, only=None, one=False):
    """A tool-call answer: finish_reason tool_calls, no content, ids functions.NAME:first, first+1, ... in
    order, arguments valid for the tool, no whitespace outside their strings."""
    assert finish == "tool_calls" and msg["calls"], (finish, msg)
    assert msg["content"] is None
    assert len(msg["calls"]) == 1 if one else len(msg["calls"]) >= 1
    for i, t in enumerate(msg["calls"]):
        assert t["name"] in PARAMS and (only is None or t["name"] == only), t
        m = CALL_ID.fullmatch(t["id"])
        assert m and m.group("name") == t["name"] and int(m.group("idx")) == first + i, (i, t["id"])
        jsonschema.validate(json.loads(t["arguments"]), PARAMS[t["name"]])
        outside = re.sub(r'"(\\.|[^"\\])*"', '""', t["arguments"])  # the model's own strings apart
        assert not re.search(r"\s", outside), t  # compact: no whitespace between the JSON's tokens


def whitespace_share(ids, ws) -> float:
    return sum(t in ws for t in ids) / max(len(ids), 1)


# --- the goals' requests, run as one batch (long answers first, so that short ones fill the free slots) ------

TEMPS = [{"temperature": 1.0, "seed": s} for s in SEEDS] + [{"temperature": 0.0, "seed": 0}]
STREAMED = (0, 7, 20)  # of TEMPS: also streamed under tool_choice "required"
ENUM_RF = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": ENUM_SCHEMA, "strict": True}}
N_OBJECT = 4


@pytest.fixture(scope="module")
def answers(demo):
    """{kind: [(message, finish_reason, token ids, prompt tokens)]} of every goal request, and the move of
    the prompt-token counter over them."""
    async def run():
        c = aclient(demo)
        tools = {"tools": AGENT_TOOLS, "tool_choice": "required"}
        kinds = {
            "required": [_chat(c, messages=user(kw["seed"]), **tools, **kw) for kw in TEMPS],
            "required_streamed": [_chat(c, stream=True, messages=user(TEMPS[i]["seed"]), **tools, **TEMPS[i])
                                  for i in STREAMED],
            "json_object": [_chat(c, messages=user(i), response_format={"type": "json_object"}, temperature=1.0,
                                  seed=200 + i) for i in range(N_OBJECT)],
            "one": [_chat(c, messages=user(kw["seed"]), parallel_tool_calls=False, **tools, **kw) for kw in TEMPS],
            "one_streamed": [_chat(c, stream=True, messages=user(kw["seed"]), parallel_tool_calls=False, **tools,
                                   **kw) for kw in TEMPS],
            "named": [_chat(c, messages=user(i), tools=TOOLS, temperature=1.0, seed=100 + i,
                            tool_choice={"type": "function", "function": {"name": "book"}}) for i in range(2)],
            "json_schema": [_chat(c, messages=user(i), response_format=ENUM_RF, temperature=1.0, seed=i)
                            for i in SEEDS],
            "json_varied": [_chat(c, messages=user(i), temperature=1.0, seed=50 + i, max_tokens=160, response_format={
                "type": "json_schema", "json_schema": {"name": f"s{i}", "schema": SCHEMAS[i], "strict": i % 2 == 0}})
                for i in range(len(SCHEMAS))],
        }
        flat = await asyncio.gather(*[r for rs in kinds.values() for r in rs])
        out, k = {}, 0
        for name, rs in kinds.items():
            out[name], k = flat[k:k + len(rs)], k + len(rs)
        return out

    before = metric(demo, "k2jax_prompt_tokens_total")
    out = asyncio.run(run())
    return out, metric(demo, "k2jax_prompt_tokens_total") - before


def test_required_finishes_with_ids_counted_from_0_without_any_logit_bias(answers):
    """The issue's goal: 20 seeds at temperature 1 and one at temperature 0, max_tokens 256, no logit_bias:
    every answer ends with finish_reason tool_calls, ids functions.NAME:0, 1, 2... in order, arguments valid
    and compact. Three of them also streamed: the same tokens, joined to the same message."""
    got = answers[0]
    for msg, finish, ids, _ in got["required"] + got["required_streamed"]:
        check_calls(msg, finish)
        assert len(ids) <= MAX_TOKENS
    for streamed, i in zip(got["required_streamed"], STREAMED):
        assert streamed[2] == got["required"][i][2]  # a seed's tokens, whatever the batch
        assert streamed[:2] == got["required"][i][:2]
    calls = [len(r[0]["calls"]) for r in got["required"]]
    print(f"\nrequired, {len(calls)} runs: finish tool_calls {sum(r[1] == 'tool_calls' for r in got['required'])}/"
          f"{len(calls)}, calls per answer {min(calls)}..{max(calls)}, tokens per answer "
          f"{min(len(r[2]) for r in got['required'])}..{max(len(r[2]) for r in got['required'])}")


def test_one_call_when_parallel_tool_calls_is_false_or_a_function_is_named(answers):
    """parallel_tool_calls false: exactly one call (functions.NAME:0), for every seed, streamed and not (the
    stream joined equals the whole answer); a named function: one call of it (nested, strict arguments)."""
    got = answers[0]
    for (msg, finish, ids, _), streamed in zip(got["one"], got["one_streamed"]):
        check_calls(msg, finish, one=True)
        assert streamed[2] == ids and streamed[:2] == (msg, finish)
    for msg, finish, _, _ in got["named"]:
        check_calls(msg, finish, only="book", one=True)
    print(f"\nparallel_tool_calls false, {len(got['one'])} runs x (whole, streamed): one call in "
          f"{sum(len(m['calls']) == 1 for m, *_ in got['one'] + got['one_streamed'])}/{2 * len(got['one'])}")


def test_json_schema_answers_finish_and_parse_with_little_whitespace(answers, whitespace_ids):
    """The issue's goal: a schema of enums and bounded integers, 20 seeds at max_tokens 256: 20 of 20 finish
    and parse, at most 10% of the tokens whitespace; schemas of nested objects, strings and arrays too.
    json_object keeps the same whitespace bound (its finish rate is printed: an object of free keys and
    values may run past max_tokens, and is then a prefix of one)."""
    got = answers[0]
    shares = []
    for (msg, finish, ids, _), schema in [(r, ENUM_SCHEMA) for r in got["json_schema"]] + list(
            zip(got["json_varied"], SCHEMAS)):
        assert finish == "stop", (finish, msg)
        jsonschema.validate(json.loads(msg["content"]), schema)
        shares.append(whitespace_share(ids, whitespace_ids))
    enum = shares[:len(SEEDS)]
    assert max(enum) <= 0.10, enum
    finished, obj = 0, []
    for msg, finish, ids, _ in got["json_object"]:
        assert finish in ("stop", "length") and msg["content"].startswith("{")
        if finish == "stop":
            finished += 1
            assert isinstance(json.loads(msg["content"]), dict)
        obj.append(whitespace_share(ids, whitespace_ids))
    assert max(shares + obj) <= 0.10, (shares, obj)
    print(f"\njson_schema (enums, bounded integers): {sum(r[1] == 'stop' for r in got['json_schema'])}/"
          f"{len(SEEDS)} finish and parse, whitespace tokens at most {max(enum):.1%} (mean "
          f"{sum(enum) / len(enum):.1%}); json_object: {finished}/{len(obj)} finish, whitespace tokens at most {max(obj):.1%}")


def test_the_prompt_token_counter_is_the_sum_of_the_usages(answers):
    got, moved = answers
    assert moved == sum(r[3] for rs in got.values() for r in rs) > 0


def test_an_agent_loop_counts_ids_across_turns(demo):
    """call, tool result, call, tool result, answer: the second turn's call is :1 after the first turn's one
    call (and :3 after a history of three); the template renders the history's ids exactly as sent, an id
    the client chose included."""
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{demo}/v1", api_key="none", max_retries=0, timeout=1800)
    messages = user(7)
    for turn in range(2):
        r = c.chat.completions.create(model="k2jax-demo", messages=messages, tools=AGENT_TOOLS, tool_choice="required",
                                      parallel_tool_calls=False, temperature=1.0, seed=70 + turn, max_tokens=MAX_TOKENS)
        m = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and len(m.tool_calls) == 1
        call = m.tool_calls[0]
        assert call.id == f"functions.{call.function.name}:{turn}"
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
        messages = messages + [m.model_dump(exclude_none=True),
                               {"role": "tool", "tool_call_id": call.id, "content": f"result {turn}"}]
    r = c.chat.completions.create(model="k2jax-demo", messages=messages, tools=AGENT_TOOLS, tool_choice="none",
                                  temperature=1.0, seed=72, max_tokens=8)
    assert r.choices[0].finish_reason in ("stop", "length") and not r.choices[0].message.tool_calls
    import httpx

    prompt = httpx.post(f"http://127.0.0.1:{demo}/tokenize", json={"messages": messages, "tools": AGENT_TOOLS,
                                                                   "return_token_strs": True}).json()
    text = "".join(prompt["token_strs"])
    for turn in range(2):
        call = messages[1 + 2 * turn]["tool_calls"][0]
        assert (f"<|tool_call_begin|>{call['id']}<|tool_call_argument_begin|>{call['function']['arguments']}"
                f"<|tool_call_end|>") in text
        assert f"## Return of {call['id']}\nresult {turn}" in text
    # a client that sends its own ids (another provider's history): rendered as sent, counted all the same
    own = [{"id": f"call_{k}x", "type": "function", "function": {"name": "get_time", "arguments": '{"zone":"UTC"}'}}
           for k in range(3)]
    history = user(8) + [{"role": "assistant", "content": None, "tool_calls": own}] + [
        {"role": "tool", "tool_call_id": f"call_{k}x", "content": "12:00"} for k in range(3)]
    text = "".join(httpx.post(f"http://127.0.0.1:{demo}/tokenize", json={
        "messages": history, "return_token_strs": True}).json()["token_strs"])
    assert all(f"<|tool_call_begin|>call_{k}x<|tool_call_argument_begin|>" in text and
               f"## Return of call_{k}x\n" in text for k in range(3))
    r = c.chat.completions.create(model="k2jax-demo", messages=history, tools=AGENT_TOOLS, tool_choice="required",
                                  parallel_tool_calls=False, temperature=1.0, seed=80, max_tokens=MAX_TOKENS)
    assert r.choices[0].message.tool_calls[0].id.endswith(":3")


def test_bad_agent_requests_are_400s_naming_the_field(demo):
    """The five requests of the issue's trial answered 200 before: each is now a 400 naming the field, under
    tool_choice auto (the default) as under the others."""
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{demo}/v1", api_key="none", max_retries=0)
    called = user(1) + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "functions.get_time:0", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}]
    bad_name = {"type": "function", "function": AGENT_TOOLS[1]["function"] | {"name": "bad name!"}}
    twice = {"type": "function", "function": AGENT_TOOLS[1]["function"] | {"parameters": {"type": "object"}}}
    bad = [
        ({"messages": called + [{"role": "tool", "tool_call_id": "functions.get_time:5", "content": "x"}]},
         "messages[2].tool_call_id", "functions.get_time:5"),
        ({"tools": [bad_name]}, "tools[0].function.name", "bad name!"),
        ({"tools": AGENT_TOOLS + [twice]}, "tools[2].function.name", "get_time"),
        ({"messages": user(1) + [{"role": "assistant", "tool_calls": [{"id": "functions.get_time:0", "type": "function",
                                                                      "function": {"name": "get_time",
                                                                                   "arguments": "{zone: UTC"}}]}]},
         "messages[1].tool_calls[0].function.arguments", "not JSON"),
        ({"stop": [f"s{i}" for i in range(50)]}, "stop", "at most 4"),
    ]
    for choice in ("auto", "none", "required"):
        for body, param, says in bad:
            body = {"messages": user(1), "tools": AGENT_TOOLS, "tool_choice": choice, "max_tokens": 4} | body
            with pytest.raises(openai.BadRequestError) as e:
                c.chat.completions.create(model="k2jax-demo", messages=body.pop("messages"), extra_body=body)
            assert e.value.status_code == 400 and e.value.body["param"] == param, (choice, param, e.value.body)
            assert says in e.value.body["message"], e.value.body["message"]


def test_a_mixed_batch_compiles_nothing_new(demo):
    """Rows with and without grammars in the same steps: the one compiled step serves both (the mask is an
    input of the jitted sampler), and the free rows are not constrained. The tool rows call tools with nested
    objects, strings and arrays (one strict), their sections closed within a smaller max_tokens."""
    async def run():
        c = aclient(demo)
        rf = {"type": "json_schema", "json_schema": {"name": "s0", "schema": SCHEMAS[0]}}
        free = [_chat(c, messages=[{"role": "user", "content": f"Hi {i}"}], max_tokens=24, temperature=1.0, seed=i,
                      extra_body={"ignore_eos": True}) for i in range(4)]
        return await asyncio.gather(*[_chat(c, messages=user(i), tools=TOOLS, tool_choice="required", max_tokens=120,
                                            temperature=1.0, seed=1000 + i) for i in range(4)],
                                    *[_chat(c, messages=user(i), response_format=rf, temperature=1.0, seed=i,
                                            max_tokens=120) for i in range(4)],
                                    *free)

    asyncio.run(run())  # warm-up: every shape this mix reaches has been run once
    before = metric(demo, "k2jax_compilations_total")
    results = asyncio.run(run())
    assert metric(demo, "k2jax_compilations_total") == before
    for msg, finish, ids, _ in results[:4]:  # nested objects, strings, arrays, a strict tool
        check_calls(msg, finish)
        assert len(ids) <= 120
    for msg, finish, _, _ in results[4:8]:
        assert finish == "stop"
        jsonschema.validate(json.loads(msg["content"]), SCHEMAS[0])
    assert all(finish == "length" for _, finish, _, _ in results[8:])
    free_texts = [msg["content"] for msg, *_ in results[8:]]
    assert not all(t.lstrip().startswith("{") for t in free_texts), free_texts  # not JSON-constrained
