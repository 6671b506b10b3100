"""Constrained decoding through `k2jax serve --demo` (the random-weight demo model), with the real `openai`
client: response_format json_schema / json_object and tool_choice "required" / a named function. Every output
is checked by an independent validator (json + jsonschema), never by the grammar library itself.

A random model left free writes JSON whitespace wherever the grammar allows it (up to 16 characters per gap),
so its objects outgrow any small max_tokens; the requests here steer it off the whitespace-only tokens with
`logit_bias` (-100), which the grammar then never needs: every other token is still the model's own draw
among the ones the grammar allows. The schemas are bounded (maxLength, maxItems, integer ranges, enums), so
each output ends well within max_tokens. Likewise, after each call of a "required" section the grammar allows
another call or the section's end, and a random model keeps calling: a bias of +12 on the end marker makes it
stop after one call or two (measured: 2 of the 50 answers held two calls), so a few parallel calls occur."""

from __future__ import annotations

import asyncio
import json
import re
import sys

import jsonschema
import openai
import pytest

from tests.serve_util import free_port, metric, running

MAX_TOKENS = 160
TOOL_MAX_TOKENS = 400  # a call takes about 50 tokens; the tool prompts take about 540 of --max-len 1024
END_BIAS = 12.0
N = 50


def _obj(props, required=None):
    return {"type": "object", "properties": props, "required": list(required or props), "additionalProperties": False}


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
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": _obj(
        {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}})}},
    {"type": "function", "function": {"name": "book", "strict": True, "parameters": _obj(
        {"when": _obj({"day": {"type": "integer", "minimum": 1, "maximum": 31}, "slot": {"enum": ["am", "pm"]}}),
         "guests": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2}})}},
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
CALL_ID = re.compile(r"functions\.(?P<name>[A-Za-z0-9_.\-]+):(?P<idx>0|[1-9][0-9]*)")


@pytest.fixture(scope="module")
def demo():
    port = free_port()
    argv = [sys.executable, "-m", "k2jax.cli", "serve", "--demo", "--port", str(port), "--max-batch", "8",
            "--max-len", "1024", "--prefill-chunk", "256"]
    with running([argv], port):
        yield port


@pytest.fixture(scope="module")
def biases():
    """logit_bias for JSON (the demo tokenizer's whitespace-only tokens out) and for tool calls (that, and
    the section's end favoured); see the module doc."""
    from k2jax.synthetic import demo_tokenizer

    tok = demo_tokenizer()  # the tokenizer `serve --demo` serves
    ws = {str(i): -100 for i in range(tok.num_base) if tok.decode_bytes([i]) and not tok.decode_bytes([i]).strip()}
    assert ws and len(ws) < 300
    return ws, ws | {str(tok.special_tokens["<|tool_calls_section_end|>"]): END_BIAS}


def aclient(port):
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=900)


async def _json_request(c, i, bias):
    schema = SCHEMAS[i % len(SCHEMAS)]
    r = await c.chat.completions.create(
        model="k2jax-demo", messages=[{"role": "user", "content": f"Fill in record {i}."}], max_tokens=MAX_TOKENS,
        temperature=1.0, seed=i, logit_bias=bias,
        response_format={"type": "json_schema", "json_schema": {"name": f"s{i % len(SCHEMAS)}", "schema": schema,
                                                                "strict": i % 2 == 0}})
    return schema, r.choices[0]


async def _tool_request(c, i, bias, **kw):
    r = await c.chat.completions.create(
        model="k2jax-demo", messages=[{"role": "user", "content": f"Task {i}: book it or check the weather."}],
        tools=TOOLS, max_tokens=TOOL_MAX_TOKENS, temperature=1.0, seed=1000 + i, logit_bias=bias, **kw)
    return r.choices[0]


def check_json(schema, choice):
    assert choice.finish_reason == "stop", (choice.finish_reason, choice.message.content)
    jsonschema.validate(json.loads(choice.message.content), schema)


def check_calls(choice, only=None, one=False):
    """A tool-call answer: finish_reason tool_calls, ids as K2 writes them, arguments valid for the tool."""
    m = choice.message
    assert choice.finish_reason == "tool_calls" and m.tool_calls, (choice.finish_reason, m.content)
    assert m.content is None
    assert len(m.tool_calls) == 1 if one else len(m.tool_calls) >= 1
    for t in m.tool_calls:
        assert t.type == "function" and t.function.name in PARAMS, t
        assert only is None or t.function.name == only
        mid = CALL_ID.fullmatch(t.id)
        assert mid and mid.group("name") == t.function.name, t.id
        jsonschema.validate(json.loads(t.function.arguments), PARAMS[t.function.name])


def test_json_schema_outputs_all_validate(demo, biases):
    async def run():
        c = aclient(demo)
        return await asyncio.gather(*[_json_request(c, i, biases[0]) for i in range(N)])

    results = asyncio.run(run())
    for schema, choice in results:
        check_json(schema, choice)
    # json_object: any JSON object
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{demo}/v1", api_key="none", max_retries=0, timeout=900)
    r = c.chat.completions.create(model="k2jax-demo", messages=[{"role": "user", "content": "JSON please"}],
                                  response_format={"type": "json_object"}, max_tokens=MAX_TOKENS, seed=5,
                                  temperature=1.0, logit_bias=biases[0])
    assert r.choices[0].finish_reason in ("stop", "length")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # an unbounded object may run past max_tokens: then it is a prefix of one
        assert r.choices[0].message.content.startswith("{")


def test_tool_choice_required_returns_calls_whose_arguments_validate(demo, biases):
    async def run():
        c = aclient(demo)
        kws = [{"tool_choice": "required"} if i % 5 else
               {"tool_choice": {"type": "function", "function": {"name": "book"}}} for i in range(N)]
        kws = [kw | ({"parallel_tool_calls": False} if i % 5 == 1 else {}) for i, kw in enumerate(kws)]
        return kws, await asyncio.gather(*[_tool_request(c, i, biases[1], **kw) for i, kw in enumerate(kws)])

    kws, results = asyncio.run(run())
    for kw, choice in zip(kws, results):
        named = isinstance(kw["tool_choice"], dict)
        check_calls(choice, only="book" if named else None, one=named or "parallel_tool_calls" in kw)


def test_a_mixed_batch_compiles_nothing_new(demo, biases):
    """Rows with and without grammars in the same steps: the one compiled step serves both (the mask is an
    input of the jitted sampler), and the free rows are not constrained."""
    async def run():
        c = aclient(demo)
        free = [c.chat.completions.create(model="k2jax-demo", messages=[{"role": "user", "content": f"Hi {i}"}],
                                          max_tokens=24, temperature=1.0, seed=i, extra_body={"ignore_eos": True})
                for i in range(4)]
        return await asyncio.gather(*[_json_request(c, i, biases[0]) for i in range(4)],
                                    *[_tool_request(c, i, biases[1], tool_choice="required") for i in range(4)],
                                    *free)

    asyncio.run(run())  # warm-up: every shape this mix reaches has been run once
    before = metric(demo, "k2jax_compilations_total")
    results = asyncio.run(run())
    assert metric(demo, "k2jax_compilations_total") == before
    for schema, choice in results[:4]:
        check_json(schema, choice)
    for choice in results[4:8]:
        check_calls(choice)
    free_texts = [r.choices[0].message.content for r in results[8:]]
    assert all(r.choices[0].finish_reason == "length" for r in results[8:])
    assert not all(t.lstrip().startswith("{") for t in free_texts), free_texts  # not JSON-constrained
