"""The API's request parsing (k2jax.serving.openai_fields) and response formatting (k2jax.serving.responses)
without a server: every field parsed or refused with the field named, the seeds of n choices, and logprobs
in the completions and chat formats (whole and streamed) from engine events."""

import json

import pytest

from k2jax.serving import openai_fields as fields
from k2jax.runtime.detok import TokenText
from k2jax.runtime.engine import Event, SamplingParams
from k2jax.serving.responses import Choice, Chunks, Names, response
from k2jax.tokenizer import KimiTokenizer
from tests.bpe import write_test_tokenizer

LIMITS = fields.Limits(vocab_size=1024, max_len=64, max_choices=12)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return KimiTokenizer.from_dir(write_test_tokenizer(tmp_path_factory.mktemp("tok"), num_merges=500))


def refused(body, param, chat=False, limits=LIMITS, tok=None):
    with pytest.raises(fields.BadRequest) as e:
        (fields.parse_chat if chat else fields.parse_completion)(body, tok, limits)
    assert e.value.param == param and param.split(".")[0].split("[")[0] in e.value.message, e.value.message
    return e.value


def test_sampling_fields_reach_the_params():
    job = fields.parse_completion({"prompt": [5, 6], "max_tokens": 9, "temperature": 0.5, "top_p": 0.9, "top_k": 7,
                              "min_p": 0.1, "seed": 11, "presence_penalty": 0.5, "frequency_penalty": -1,
                              "repetition_penalty": 1.3, "logit_bias": {"7": 5, "3": -100}, "min_tokens": 2,
                              "logprobs": 3, "stop": ["x"], "stop_token_ids": [9], "ignore_eos": True,
                              "skip_special_tokens": False, "user": "u"}, None, LIMITS)
    assert job.params == [SamplingParams(max_tokens=9, temperature=0.5, top_p=0.9, top_k=7, min_p=0.1, seed=11,
                                         presence_penalty=0.5, frequency_penalty=-1.0, repetition_penalty=1.3,
                                         logit_bias=((3, -100.0), (7, 5.0)), min_tokens=2, logprobs=3,
                                         stop_ids=(9,), stop=("x",), skip_special_tokens=False)]


def test_chat_logprobs_and_top_logprobs(tok):
    base = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    assert fields.parse_chat(base, tok, LIMITS).params[0].logprobs is None
    assert fields.parse_chat(base | {"logprobs": True}, tok, LIMITS).params[0].logprobs == 0
    assert fields.parse_chat(base | {"logprobs": True, "top_logprobs": 5}, tok, LIMITS).params[0].logprobs == 5
    refused(base | {"top_logprobs": 5}, "top_logprobs", chat=True, tok=tok)
    refused(base | {"logprobs": True, "top_logprobs": 21}, "top_logprobs", chat=True, tok=tok)
    refused(base | {"logprobs": 3}, "logprobs", chat=True, tok=tok)


def test_no_seed_draws_a_random_one():
    seeds = {fields.parse_completion({"prompt": [5]}, None, LIMITS).params[0].seed for _ in range(4)}
    assert len(seeds) == 4 and all(0 <= s < 2**63 for s in seeds)


def test_n_choices_get_derived_seeds_and_prompt_major_indices():
    job = fields.parse_completion({"prompt": [[5, 6], [7]], "n": 3, "seed": 42}, None, LIMITS)
    got = [(k, j, p.seed) for k, j, p in job.choices()]
    # the documented derivation, written out: seed + i * 0x9E3779B97F4A7C15 mod 2^63
    want = [(j * 3 + i, j, (42 + i * 0x9E3779B97F4A7C15) % 2**63) for j in range(2) for i in range(3)]
    assert got == want and got[0][2] == 42
    assert len({s for _, _, s in got[:3]}) == 3


@pytest.mark.parametrize("body,param", [
    ({"prompt": [5], "suffix": "x"}, "suffix"),
    ({"prompt": [5], "frobnicate": 1}, "frobnicate"),
    ({"prompt": [5], "best_of": 2}, "best_of"),
    ({"prompt": [5], "n": 2, "best_of": 3}, "best_of"),
    ({"prompt": [5], "echo": True, "logprobs": 1}, "echo"),  # token ids to echo, and no tokenizer
    ({"prompt": [5], "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": [5], "prompt_logprobs": True}, "prompt_logprobs"),
    ({"prompt": [5], "max_tokens": 0}, "max_tokens"),  # 0 only when the prompt is scored
    ({"prompt": [5], "echo": "yes"}, "echo"),
    ({"prompt": [5], "logprobs": 21}, "logprobs"),
    ({"prompt": [5], "logprobs": True}, "logprobs"),
    ({"prompt": [5], "presence_penalty": 99}, "presence_penalty"),
    ({"prompt": [5], "frequency_penalty": -2.5}, "frequency_penalty"),
    ({"prompt": [5], "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": [5], "min_p": 1.5}, "min_p"),
    ({"prompt": [5], "min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"prompt": [5], "logit_bias": {"5": 101}}, "logit_bias"),
    ({"prompt": [5], "logit_bias": {"x": 1}}, "logit_bias"),
    ({"prompt": [5], "logit_bias": {"4096": 1}}, "logit_bias"),
    ({"prompt": [5], "logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ({"prompt": [5], "seed": 1.5}, "seed"),
    ({"prompt": [5], "temperature": float("inf")}, "temperature"),
    ({"prompt": [5], "top_p": float("nan")}, "top_p"),
    ({"prompt": [5], "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": [5], "stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options"),
    ({"prompt": [5], "n": 0}, "n"),
    ({"prompt": [[5]] * 5, "n": 3}, "n"),  # 15 sequences > max_choices 12
    ({"prompt": []}, "prompt"),
    ({"prompt": [[5], "x"]}, "prompt"),  # text without a tokenizer
    ({"prompt": [[5], []]}, "prompt"),
    ({"prompt": [5], "stop_token_ids": [5000]}, "stop_token_ids"),
    ({"prompt": [5], "skip_special_tokens": 1}, "skip_special_tokens"),
    ({"prompt": [5], "user": 3}, "user"),
])
def test_bad_or_unsupported_fields_are_refused_naming_them(body, param):
    refused(body, param)


@pytest.mark.parametrize("body,param", [
    ({"store": True}, "store"), ({"modalities": ["text", "audio"]}, "modalities"), ({"audio": {}}, "audio"),
    ({"prediction": {}}, "prediction"), ({"metadata": "x"}, "metadata"), ({"echo": True}, "echo"),
    ({"suffix": "x"}, "suffix"), ({"n": 13}, "n")])
def test_chat_refuses_what_it_does_not_implement(tok, body, param):
    refused({"messages": [{"role": "user", "content": "hi"}]} | body, param, chat=True, tok=tok)


FN = {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["CET", "UTC"]}}}}
CALLED = [{"role": "user", "content": "time?"},
          {"role": "assistant", "tool_calls": [{"id": "functions.get_time:0", "type": "function",
                                                "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}]}]


@pytest.mark.parametrize("choice", [None, "auto", "none", "required"])
@pytest.mark.parametrize("body,param", [
    ({"messages": CALLED + [{"role": "tool", "tool_call_id": "functions.get_time:7", "content": "12:00"}]},
     "messages[2].tool_call_id"),
    ({"tools": [{"type": "function", "function": FN | {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": FN}, {"type": "function", "function": FN | {"parameters": {}}}]},
     "tools[1].function.name"),
    ({"messages": [CALLED[0], {"role": "assistant", "tool_calls": [{"id": "functions.get_time:0", "function": {
        "name": "get_time", "arguments": "{zone: CET"}}]}]}, "messages[1].tool_calls[0].function.arguments"),
    ({"stop": [f"s{i}" for i in range(50)]}, "stop"),
    ({"stop": list("abcde")}, "stop"),
])
def test_agent_requests_are_checked_whatever_the_tool_choice(tok, body, param, choice):
    """A tool result for an id no call had, a tool name off OpenAI's pattern, two tools of one name, assistant
    arguments that are not JSON, more than 4 stop strings: each a 400 naming the field, under every
    tool_choice (the tool result names the id it could not match)."""
    from k2jax.serving.grammar import GrammarCompiler, GrammarTokenizer

    grammars = GrammarCompiler(GrammarTokenizer(tok, LIMITS.vocab_size))
    body = {"messages": CALLED[:1], "tools": [{"type": "function", "function": FN}], "max_tokens": 4} | body
    if choice is not None:
        body["tool_choice"] = choice
    with pytest.raises(fields.BadRequest) as e:
        fields.parse_chat(body, tok, fields.Limits(1024, 4096, 12), grammars=grammars)
    assert e.value.param == param, (e.value.param, e.value.message)
    assert e.value.message.startswith(param)
    if "tool_call_id" in param:
        assert "'functions.get_time:7'" in e.value.message
    ok = fields.parse_chat({"messages": CALLED + [{"role": "tool", "tool_call_id": "functions.get_time:0",
                                                  "content": "12:00"}], "stop": list("abcd"), "max_tokens": 4,
                            "tools": [{"type": "function", "function": FN}]}, tok, fields.Limits(1024, 4096, 12),
                           grammars=grammars)
    assert ok.params[0].stop == tuple("abcd")


def test_a_grammar_counts_on_from_the_conversation_calls(tok):
    """The grammar spec the engine gets: ids counted on from the assistant calls in the messages, the
    budget, the whitespace (the server's default, or the request's)."""
    from k2jax.serving.grammar import GrammarCompiler, GrammarTokenizer

    grammars = GrammarCompiler(GrammarTokenizer(tok, LIMITS.vocab_size))
    tools = [{"type": "function", "function": FN}]
    two = CALLED[:1] + [{"role": "assistant", "tool_calls": CALLED[1]["tool_calls"] * 2}]
    two[1]["tool_calls"] = [dict(c, id=f"functions.get_time:{i}") for i, c in enumerate(two[1]["tool_calls"])]
    msgs = two + [{"role": "tool", "tool_call_id": f"functions.get_time:{i}", "content": "x"} for i in range(2)]
    for choice in ("auto", "required"):
        job = fields.parse_chat({"messages": msgs, "tools": tools, "tool_choice": choice, "max_tokens": 7},
                                tok, fields.Limits(1024, 4096, 12), grammars=grammars)
        spec = job.params[0].grammar
        assert (spec["call_offset"], spec["max_tokens"], spec["whitespace"]) == (2, 7, "compact")
    job = fields.parse_chat({"messages": CALLED[:1], "response_format": {"type": "json_object"},
                             "json_whitespace": "any"}, tok, fields.Limits(1024, 4096, 12), grammars=grammars)
    assert job.params[0].grammar["whitespace"] == "any" and job.params[0].grammar["call_offset"] == 0
    assert fields.parse_chat({"messages": CALLED[:1], "tools": tools, "tool_choice": "none"}, tok,
                             fields.Limits(1024, 4096, 12), grammars=grammars).params[0].grammar is None
    refused({"messages": CALLED[:1], "json_whitespace": "pretty", "response_format": {"type": "json_object"}},
            "json_whitespace", chat=True, tok=tok)


def test_echo_and_prompt_lists(tok):
    job = fields.parse_completion({"prompt": ["The quick", "brown"], "echo": True}, tok, LIMITS)
    assert job.prompts == [tok.encode("The quick"), tok.encode("brown")]
    assert job.prompt_texts == ["The quick", "brown"] and job.echo


# --- responses -----------------------------------------------------------------------------------------

def lp_event(tok_ids, logprobs, tops, text="", finish=None):
    return Event(text, tok_ids, finish, 3, 0, logprobs=[{"token_id": t, "logprob": lp, "top": top}
                                                          for t, lp, top in zip(tok_ids, logprobs, tops)])


def test_completions_logprobs_format(tok):
    names = Names(TokenText(tok))
    a, b = tok.encode("The")[0], tok.encode(" fox")[0]
    c = Choice(0, 3, wants_logprobs=True, echo="ab")
    c.add(lp_event([a, b], [-0.5, float("-inf")], [[[a, -0.5], [b, -1.0]], [[a, -0.1]]], "The fox", "length"))
    r = response("id", 0, "m", False, [c], 3, names)
    lp = r["choices"][0]["logprobs"]
    ta, tb = tok.decode([a]), tok.decode([b])
    assert lp["tokens"] == [ta, tb]
    assert lp["token_logprobs"] == [-0.5, -9999.0]  # -inf is not JSON
    assert lp["top_logprobs"] == [{ta: -0.5, tb: -1.0}, {ta: -0.1, tb: -9999.0}]  # the sampled token is listed too
    assert lp["text_offset"] == [2, 2 + len(ta)]  # after the echo
    assert r["choices"][0]["text"] == "abThe fox"
    json.dumps(r, allow_nan=False)


def test_chat_logprobs_format_whole_and_streamed(tok):
    names = Names(TokenText(tok))
    ids = tok.encode("月之暗面")
    events = [lp_event([t], [-1.0 - k], [[[t, -1.0 - k], [7, -3.0]]]) for k, t in enumerate(ids)]
    c = Choice(0, 3, wants_logprobs=True)
    for e in events:
        c.add(e)
    whole = response("id", 0, "m", True, [c], 3, names)["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in whole] == [tok.decode([t]) for t in ids]
    assert b"".join(bytes(e["bytes"]) for e in whole).decode() == "月之暗面"  # bytes reassemble the characters
    assert [e["logprob"] for e in whole] == [-1.0 - k for k in range(len(ids))]
    assert whole[0]["top_logprobs"] == [{"token": tok.decode([ids[0]]), "logprob": -1.0,
                                         "bytes": list(tok.decode_bytes([ids[0]]))},
                                        {"token": tok.decode([7]), "logprob": -3.0, "bytes": [7]}]
    chunks = Chunks("id", 0, "m", True, names)
    s = Choice(0, 3, wants_logprobs=True)
    streamed = [json.loads(chunks.delta(s, e)[6:])["choices"][0]["logprobs"]["content"] for e in events]
    assert [x for part in streamed for x in part] == whole


def test_logprobs_are_null_when_not_asked(tok):
    c = Choice(0, 3, wants_logprobs=False)
    c.add(Event("x", [5], "stop", 3, 1))
    assert response("id", 0, "m", False, [c], 3, Names(TokenText(tok)))["choices"][0]["logprobs"] is None
