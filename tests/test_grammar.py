"""Constrained decoding through k2jax.serving.grammar with random logits (no model) over the demo tokenizer's
real BPE pieces: every output is checked by an independent validator (jsonschema, and the tool-call parser),
never by the grammar library itself."""

import json
import re

import jsonschema
import numpy as np
import pytest

from k2jax.serving import tool_calls
from k2jax.serving.grammar import GrammarCompiler, GrammarTokenizer, fill_bitmasks, pack_bits, unpack_bits
from k2jax.tokenizer import KimiTokenizer, load_ranks
from tests.bpe import write_test_tokenizer

PAD = 37  # the model's vocab is the tokenizer's plus padding ids, and not a multiple of 32
MAX_STEPS = 400


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return KimiTokenizer.from_dir(write_test_tokenizer(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def gtok(tok):
    return GrammarTokenizer(tok, tok.vocab_size + PAD)


@pytest.fixture(scope="module")
def compiler(gtok):
    return GrammarCompiler(gtok)


def decode(matcher, gtok, rng, bias=None):
    """Sample with random logits under the mask until a stop token; -> (ids without the stop, stop id)."""
    row = np.zeros(gtok.words, dtype=np.int32)
    out = []
    for _ in range(MAX_STEPS):
        matcher.fill_bitmask(row)
        allowed = unpack_bits(row, gtok.vocab_size)
        assert allowed.any(), matcher.error
        assert not allowed[gtok.tokenizer.vocab_size:].any()  # padding ids are never allowed
        logits = rng.standard_normal(gtok.vocab_size) * 3.0
        if bias is not None:
            logits += bias
        logits[~allowed] = -np.inf
        p = np.exp(logits - logits.max())
        t = int(rng.choice(gtok.vocab_size, p=p / p.sum()))
        assert matcher.accept(t), (t, matcher.error)
        if t in gtok.stop_ids:
            assert matcher.is_terminated()
            return out, t
        out.append(t)
    raise AssertionError(f"no stop token after {MAX_STEPS} steps: {gtok.tokenizer.decode(out)!r}")


def random_schema(rng, depth=0):
    """A random JSON schema: nested objects (required fields, no extra keys), enums, arrays, bounded
    strings and integers, numbers, booleans, nullable values."""
    kinds = ["string", "integer", "enum", "boolean", "number", "array", "nullable"]
    kinds += ["object"] * 2 if depth < 2 else []
    kind = kinds[rng.integers(len(kinds))]
    if kind == "string":
        return {"type": "string", "maxLength": int(rng.integers(1, 12))}
    if kind == "integer":
        lo = int(rng.integers(-50, 50))
        return {"type": "integer", "minimum": lo, "maximum": lo + int(rng.integers(0, 1000))}
    if kind == "number":
        return {"type": "number", "minimum": -10, "maximum": 10}
    if kind == "enum":
        return {"enum": ["red", "green", "blue", 7, None][: int(rng.integers(2, 6))]}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "nullable":
        return {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 5}]}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": int(rng.integers(0, 2)),
                "maxItems": 3}
    return random_object(rng, depth + 1)


def random_object(rng, depth=0):
    n = int(rng.integers(1, 5))
    props = {f"k{i}_{int(rng.integers(100))}": random_schema(rng, depth) for i in range(n)}
    required = [k for k in props if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def test_fifty_json_schema_requests_validate(tok, gtok, compiler):
    rng = np.random.default_rng(0)
    misses = compiler.misses
    for i in range(50):
        schema = random_object(rng)
        schema["properties"][f"nested{i}"] = {"type": "object", "properties": {
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
            "inner": random_object(rng, 1)}, "required": ["tags", "inner"], "additionalProperties": False}
        schema["required"].append(f"nested{i}")
        rf = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": bool(i % 2)}}
        ids, _ = decode(compiler.for_request(response_format=rf).matcher(), gtok, rng)
        value = json.loads(tok.decode(ids))
        jsonschema.validate(value, schema)
        assert f"nested{i}" in value
    assert compiler.misses == misses + 50  # fifty different schemas, fifty compilations


def test_json_object(tok, gtok, compiler):
    rng = np.random.default_rng(1)
    for _ in range(5):
        # Bias towards closing brackets so an unconstrained object still ends within MAX_STEPS.
        bias = np.zeros(gtok.vocab_size)
        for piece in ("}", "]", '"', "0", ","):
            bias[tok.encode(piece)] = 4.0
        ids, _ = decode(compiler.for_request(response_format={"type": "json_object"}).matcher(), gtok, rng, bias)
        assert isinstance(json.loads(tok.decode(ids)), dict)


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {
            "query": {"type": "string", "maxLength": 8},
            "filters": {"type": "array", "maxItems": 2, "items": {
                "type": "object",
                "properties": {"field": {"enum": ["date", "site"]}, "value": {"type": "string", "maxLength": 6}},
                "required": ["field", "value"], "additionalProperties": False}}},
        "required": ["query"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _check_calls(text, names):
    content, calls = tool_calls.parse(text)
    assert content is None, text  # the grammar opens the section at once: no text, and nothing malformed
    assert calls and tool_calls.finish_reason("stop", calls) == "tool_calls"
    for c in calls:
        fn = c["function"]
        assert fn["name"] in names and c["id"].startswith(f"functions.{fn['name']}:")
        jsonschema.validate(json.loads(fn["arguments"]), SCHEMAS[fn["name"]])
    return calls


def test_fifty_required_tool_choice_decodes_validate(tok, gtok, compiler):
    rng = np.random.default_rng(2)
    grammar = compiler.for_request(tools=TOOLS, tool_choice="required")
    seen = set()
    for _ in range(50):
        ids, _ = decode(grammar.matcher(), gtok, rng)
        calls = _check_calls(tok.decode(ids), set(SCHEMAS))
        seen |= {c["function"]["name"] for c in calls}
    assert seen == set(SCHEMAS)  # every tool was reachable
    assert compiler.for_request(tools=TOOLS, tool_choice="required") is grammar  # cached


def test_named_function_decodes_validate(tok, gtok, compiler):
    rng = np.random.default_rng(3)
    for name in SCHEMAS:
        grammar = compiler.for_request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": name}})
        for _ in range(10):
            ids, _ = decode(grammar.matcher(), gtok, rng)
            assert len(_check_calls(tok.decode(ids), {name})) == 1


def test_termination_forces_the_stop_tokens(tok, gtok, compiler):
    schema = {"type": "object", "properties": {"x": {"const": 1}}, "required": ["x"], "additionalProperties": False}
    m = compiler.json_schema(schema).matcher()
    row = np.zeros(gtok.words, dtype=np.int32)
    for t in tok.encode('{"x":1}'):
        assert not m.can_stop()
        assert m.accept(t)
    assert m.can_stop() and not m.is_terminated()
    m.fill_bitmask(row)
    assert set(np.nonzero(unpack_bits(row, gtok.vocab_size))[0]) == set(tok.stop_ids)
    assert m.accept(tok.special_tokens["<|im_end|>"]) and m.is_terminated()
    # A rejected token: False, an error state, and only the stop tokens stay allowed.
    m = compiler.json_schema(schema).matcher()
    assert not m.accept(tok.encode("hello")[0])
    assert m.error
    m.fill_bitmask(row)
    assert set(np.nonzero(unpack_bits(row, gtok.vocab_size))[0]) <= set(tok.stop_ids)
    assert not compiler.json_schema(schema).matcher().accept(gtok.vocab_size - 1)  # a padding id


def test_rollback_and_batched_masks(tok, gtok, compiler):
    g1 = compiler.for_request(tools=TOOLS, tool_choice="required")
    g2 = compiler.json_schema(SCHEMAS["add"])
    a, b = g1.matcher(), g2.matcher()
    first = np.zeros(gtok.words, dtype=np.int32)
    a.fill_bitmask(first)
    prefix = tok.encode("<|tool_calls_section_begin|><|tool_call_begin|>functions.add:", allow_special=True)
    assert all(a.accept(t) for t in prefix)
    assert a.rollback(len(prefix))
    again = np.zeros(gtok.words, dtype=np.int32)
    a.fill_bitmask(again)
    np.testing.assert_array_equal(first, again)
    opens = {tok.special_tokens["<|tool_calls_section_begin|>"]}
    assert set(np.nonzero(unpack_bits(first, gtok.vocab_size))[0]) == opens  # a forced call opens the section
    # Rows filled together equal rows filled one by one; untouched rows stay as they were.
    batch = np.full((3, gtok.words), -1, dtype=np.int32)
    fill_bitmasks([(a, 0), (b, 2)], batch)
    single = np.zeros(gtok.words, dtype=np.int32)
    b.fill_bitmask(single)
    np.testing.assert_array_equal(batch[0], first)
    np.testing.assert_array_equal(batch[2], single)
    assert (batch[1] == -1).all()
    with pytest.raises(ValueError, match="bitmask row"):
        a.fill_bitmask(np.zeros(gtok.words + 1, dtype=np.int32))


def test_bit_layout():
    allowed = np.zeros(70, dtype=bool)
    allowed[[0, 31, 32, 69]] = True
    words = pack_bits(allowed)
    assert words.dtype == np.int32 and words.shape == (3,)
    assert words[0] == np.int32(-2147483647)  # bits 0 and 31
    assert words[1] == 1 and words[2] == 1 << 5
    np.testing.assert_array_equal(unpack_bits(words, 70), allowed)


def _accepts(grammar, tok, text):
    m = grammar.matcher()
    return all(m.accept(t) for t in tok.encode(text, allow_special=True)) and m.accept(tok.stop_ids[0])


def test_reasoning_before_the_constrained_part(tok, compiler, tmp_path):
    g = compiler.for_request(response_format={"type": "json_object"}, reasoning=True)
    assert _accepts(g, tok, '<think>maybe {"a": 1}? no.</think>{"a":2}')
    assert _accepts(g, tok, '{"a":2}')  # thinking may be skipped
    assert not _accepts(g, tok, '<think>unclosed {"a":2}')
    g = compiler.for_request(tools=TOOLS, tool_choice="required", reasoning_at_start=True)
    call = ('<|tool_calls_section_begin|><|tool_call_begin|>functions.add:0<|tool_call_argument_begin|>'
            '{"a":1,"b":2}<|tool_call_end|><|tool_calls_section_end|>')
    assert _accepts(g, tok, "I will add.</think>" + call)
    assert not _accepts(g, tok, call)
    # With <think> and </think> as special tokens (K2-Thinking's tokenizer), they are matched as tokens.
    d = write_test_tokenizer(tmp_path / "think")
    n = len(load_ranks(d / "tiktoken.model"))
    think_tok = KimiTokenizer(load_ranks(d / "tiktoken.model"), special_names={n + 20: "<think>", n + 21: "</think>"})
    g = GrammarCompiler(GrammarTokenizer(think_tok, think_tok.vocab_size)).for_request(
        response_format={"type": "json_object"}, reasoning=True)
    assert _accepts(g, think_tok, '<think>hmm</think>{"b":true}')
    assert think_tok.encode("<think>", allow_special=True) == [n + 20]


def test_bad_requests_raise_value_error(compiler):
    with pytest.raises(ValueError, match=r"tool_choice\.function\.name"):
        compiler.for_request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(ValueError, match="tool_choice"):
        compiler.for_request(tool_choice="required")
    with pytest.raises(ValueError, match=r"response_format\.type"):
        compiler.for_request(response_format={"type": "yaml"})
    with pytest.raises(ValueError, match=r"response_format\.json_schema\.schema"):
        compiler.for_request(response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    strict = {"type": "json_schema", "json_schema": {"schema": {"not": {"type": "string"}}, "strict": True}}
    with pytest.raises(ValueError, match=r"response_format\.json_schema\.schema"):
        compiler.for_request(response_format=strict)
    lenient = {"type": "json_schema", "json_schema": {"schema": {"not": {"type": "string"}}}}
    assert compiler.for_request(response_format=lenient) is not None  # unsupported keyword ignored
    with pytest.raises(ValueError, match=r"tools\[0\]\.function\.name"):
        compiler.for_request(tools=[{"type": "function", "function": {"name": "a b"}}], tool_choice="required")
    assert compiler.for_request(tools=TOOLS, tool_choice="none") is None
    assert compiler.for_request(response_format={"type": "text"}) is None
    with pytest.raises(ValueError, match="json_whitespace"):
        compiler.for_request(response_format={"type": "json_object"}, whitespace="pretty")
    with pytest.raises(ValueError, match="vocab_size"):
        GrammarTokenizer(compiler.gtok.tokenizer, 10)


# --- ids by construction, one call when asked, a section within its budget, compact JSON ---------------------

SB, SE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CB, AB, CE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


def _marker_bias(tok, gtok, **bias):
    """Logit biases on the named markers (call_begin=, section_end=) and on whitespace-only tokens
    (whitespace=)."""
    out = np.zeros(gtok.vocab_size)
    ids = {"call_begin": [tok.special_tokens[CB]], "section_end": [tok.special_tokens[SE]],
           "section_begin": [tok.special_tokens[SB]],
           "whitespace": [i for i in range(tok.num_base) if not tok.decode_bytes([i]).strip()]}
    for k, b in bias.items():
        out[ids[k]] += b
    return out


def test_call_ids_count_on_from_the_conversation_calls(tok, gtok, compiler):
    """IDX is fixed by the grammar: call i of a section is functions.NAME:{call_offset + i}, whatever the
    model would write; the digits of any other index are refused."""
    rng = np.random.default_rng(4)
    bias = _marker_bias(tok, gtok, call_begin=1.0)  # several calls per section
    for offset in (0, 3, 17):
        g = compiler.for_request(tools=TOOLS, tool_choice="required", **({"call_offset": offset} if offset else {}))
        counts = []
        for _ in range(6):
            ids, _ = decode(g.matcher(), gtok, rng, bias)
            calls = _check_calls(tok.decode(ids), set(SCHEMAS))
            assert [c["id"] for c in calls] == [f"functions.{c['function']['name']}:{offset + i}"
                                                for i, c in enumerate(calls)]
            counts.append(len(calls))
        assert max(counts) > 1  # parallel sections were drawn, so the counter was seen to count
    for wrong in ("functions.add:1", "functions.add:30", "functions.add:4", "functions.add:03"):
        m = compiler.for_request(tools=TOOLS, tool_choice="required", call_offset=3).matcher()
        text = SB + CB + wrong
        assert not all(m.accept(t) for t in tok.encode(text, allow_special=True)), wrong
    named = compiler.for_request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}},
                                 call_offset=5)
    assert _accepts(named, tok, SB + CB + 'functions.add:5' + AB + '{"a":1,"b":2}' + CE + SE)
    assert not _accepts(named, tok, SB + CB + 'functions.add:0' + AB + '{"a":1,"b":2}' + CE + SE)


def _allowed(m, gtok) -> set[int]:
    row = np.zeros(gtok.words, dtype=np.int32)
    m.fill_bitmask(row)
    return set(np.nonzero(unpack_bits(row, gtok.vocab_size))[0].tolist())


def test_one_call_when_not_parallel_then_only_the_end(tok, gtok, compiler):
    """parallel_tool_calls false: after one call the section must end, then only a stop token may follow;
    for "required" and for "auto" once the model opens a section (text before it is free)."""
    call = CB + "functions.add:0" + AB + '{"a":1,"b":2}' + CE
    end, stops = tok.special_tokens[SE], set(tok.stop_ids)
    for choice, head in (("auto", "Let me add. "), ("required", "")):
        g = compiler.for_request(tools=TOOLS, tool_choice=choice, parallel=False)
        m = g.matcher()
        assert all(m.accept(t) for t in tok.encode(head + SB + call, allow_special=True))
        assert _allowed(m, gtok) == {end}, choice
        assert m.accept(end) and _allowed(m, gtok) == stops
        assert not _accepts(g, tok, head + SB + call + call.replace(":0", ":1") + SE)
    # parallel: another call may follow (its index one up), and "auto" may also end without any call
    g = compiler.for_request(tools=TOOLS, tool_choice="auto", call_offset=2)
    call = call.replace(":0", ":2")
    assert _accepts(g, tok, "Let me add. " + SB + call + call.replace(":2", ":3") + SE)
    assert _accepts(g, tok, "No tool needed.")
    assert not _accepts(g, tok, "No tool needed." + CE)  # markers outside a section are refused
    rng = np.random.default_rng(5)
    for _ in range(10):  # sampled: free text, then (when the model opens one) a one-call section
        ids, _ = decode(g.matcher(), gtok, rng, _marker_bias(tok, gtok, section_begin=4.0))
        content, calls = tool_calls.parse(tok.decode(ids))
        assert [c["id"] for c in calls] == [f"functions.{c['function']['name']}:{2 + i}" for i, c in enumerate(calls)]


def test_a_parallel_section_closes_within_its_budget(tok, gtok, compiler):
    """A model that always wants another call: with max_tokens as the budget the section ends (with a stop
    token after it) within max_tokens, before a call it has no room for; without a budget it runs on to
    MAX_PARALLEL_CALLS calls."""
    from k2jax.serving.grammar import MAX_PARALLEL_CALLS

    rng = np.random.default_rng(6)
    bias = _marker_bias(tok, gtok, call_begin=30.0)
    add = TOOLS[1:2]  # bounded arguments: a call takes 15 to 25 tokens
    for budget in (60, 90, 160):
        g = compiler.for_request(tools=add, tool_choice="required", max_tokens=budget)
        for _ in range(4):
            ids, stop = decode(g.matcher(), gtok, rng, bias)
            assert len(ids) <= budget and ids[-1] == tok.special_tokens[SE], (budget, len(ids))
            calls = _check_calls(tok.decode(ids), {"add"})
            assert len(calls) > 1 or budget < 100, (budget, len(ids))  # room for several calls: they came
    ids, _ = decode(compiler.for_request(tools=add, tool_choice="required").matcher(), gtok, rng, bias)
    assert len(_check_calls(tok.decode(ids), {"add"})) == MAX_PARALLEL_CALLS


WHITESPACE_RUN = re.compile(r"[\r\n\t]|  ")


def test_compact_json_whitespace_by_default(tok, gtok, compiler):
    """The JSON of response_format and of tool arguments has no whitespace between its tokens by default,
    even from a model that favours whitespace; json_whitespace "spaced" allows one space after ':' and ',',
    "any" any JSON whitespace (at most 16 characters per gap)."""
    rng = np.random.default_rng(7)
    bias = _marker_bias(tok, gtok, whitespace=6.0)
    schema = SCHEMAS["search"]
    rf = {"type": "json_schema", "json_schema": {"schema": schema}}
    for _ in range(5):
        text = tok.decode(decode(compiler.for_request(response_format=rf).matcher(), gtok, rng, bias)[0])
        jsonschema.validate(json.loads(text), schema)
        assert not re.search(r"\s", _outside_strings(text)), text
        ids, _ = decode(compiler.for_request(tools=TOOLS, tool_choice="required").matcher(), gtok, rng, bias)
        for c in _check_calls(tok.decode(ids), set(SCHEMAS)):
            args = c["function"]["arguments"]
            assert not re.search(r"\s", _outside_strings(args)), args
        spaced = compiler.for_request(response_format=rf, whitespace="spaced")
        text = tok.decode(decode(spaced.matcher(), gtok, rng, bias)[0])
        assert not _loose(text) and re.search(r"[:,] ", _outside_strings(text)), text
    obj = compiler.for_request(response_format={"type": "json_object"})
    assert _accepts(obj, tok, '{"a":[1,2],"b":{"c":null}}')
    assert not _accepts(obj, tok, '{"a": 1}')
    spaced = compiler.for_request(response_format={"type": "json_object"}, whitespace="spaced")
    assert _accepts(spaced, tok, '{"a": [1, 2], "b":{"c":null}}')
    for loose in ('{ "a": 1}', '{"a":  1}', '{"a":\r1}', '{"a" : 1}', '{"a": [1 ,2]}', '{"a": 1\n}'):
        assert not _accepts(obj, tok, loose) and not _accepts(spaced, tok, loose), loose
    loose = compiler.for_request(response_format={"type": "json_object"}, whitespace="any")
    assert _accepts(loose, tok, '{ "a" :\r\n 1 }')
    texts = [tok.decode(decode(loose.matcher(), gtok, rng, bias + _close_bias(tok, gtok))[0]) for _ in range(5)]
    assert any(_loose(t) for t in texts)  # the looser grammar is what the bound removes


def _loose(text: str) -> bool:
    """Whether JSON text has whitespace outside its strings other than one space after ':' or ','."""
    outside = _outside_strings(text)
    return bool(WHITESPACE_RUN.search(outside) or re.search(r"[^:,] ", outside))


def _outside_strings(text: str) -> str:
    """JSON text with its string literals blanked out (spaces inside strings are the model's own text)."""
    return re.sub(r'"(\\.|[^"\\])*"', '""', text)


def _close_bias(tok, gtok):
    bias = np.zeros(gtok.vocab_size)
    for piece in ("}", "]", '"', "0", ","):
        bias[tok.encode(piece)] = 4.0
    return bias
