"""`k2jax serve` as users meet it: the command started as a subprocess on a loopback port (a small random FP8
checkpoint written here, float32 weights so argmax is stable), driven by the official `openai` client, sync
and async, streaming and not. Every greedy answer is checked against k2jax.generate on the same prompt alone.
One server for the module (tests that need their own flags are in test_serve_ops.py)."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import time

import httpx
import openai
import pytest

from tests.serve_util import Solo, chat_ids, free_port, metric, running, serve_argv, write_model

MAX_BATCH, MAX_LEN, CHUNK, QUEUE = 8, 256, 32, 24


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="module")
def server(files):
    ckpt, tok = files
    port = free_port()
    argv = serve_argv(ckpt, tok, port, "--max-batch", str(MAX_BATCH), "--max-len", str(MAX_LEN),
                      "--prefill-chunk", str(CHUNK), "--max-queue", str(QUEUE))
    with running([argv], port):
        yield port


@pytest.fixture(scope="module")
def solo(files):
    return Solo(files[0])


@pytest.fixture(scope="module")
def tok(files):
    from k2jax.tokenizer import KimiTokenizer

    return KimiTokenizer.from_dir(files[1])


def client(port, **kw):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", **kw)


def aclient(port, **kw):
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", **kw)


def text_of(tok, ids):
    """The text of generated ids as the server gives it by default (skip_special_tokens: no specials)."""
    return tok.decode([i for i in ids if i < tok.num_base])


def prompt(seed, n):
    r = random.Random(seed)
    return [r.randrange(2, 1000) for _ in range(n)]


GREEDY = {"temperature": 0}
NO_EOS = {"ignore_eos": True}


def test_models_and_a_completion_equal_to_generate(server, solo, tok):
    c = client(server)
    assert [m.id for m in c.models.list().data] == ["tiny"]
    p = prompt(0, 11)
    r = c.completions.create(model="tiny", prompt=p, max_tokens=12, extra_body=NO_EOS, **GREEDY)
    want = solo(p, 12)
    assert r.choices[0].token_ids == want
    assert r.choices[0].text == text_of(tok, want)
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (11, 12, 23)
    # a text prompt goes through the tokenizer
    r = c.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=6, extra_body=NO_EOS, **GREEDY)
    assert r.choices[0].token_ids == solo(tok.encode("The quick brown fox"), 6)


def test_chat_uses_the_kimi_template(server, solo, tok):
    msgs = [{"role": "user", "content": "Write code"}]
    r = client(server).chat.completions.create(model="tiny", messages=msgs, max_tokens=8, **GREEDY)
    want = solo(chat_ids(tok, msgs), 8, tok.stop_ids)
    assert r.choices[0].token_ids == want
    assert r.choices[0].message.content == text_of(tok, [t for t in want if t not in tok.stop_ids])
    assert r.choices[0].finish_reason == ("stop" if want[-1] in tok.stop_ids else "length")
    assert r.usage.prompt_tokens == len(chat_ids(tok, msgs))


def _expected(solo, tok, p, n, stop_ids=(), stop=()):
    """What the server must answer, worked out from the solo tokens: (ids, text, finish_reason)."""
    ids = solo(p, n)
    out = []
    for t in ids:
        out.append(t)
        if t in stop_ids:
            return out, text_of(tok, out[:-1]), "stop"
        text = text_of(tok, out)
        cuts = [text.find(s) for s in stop if s in text]
        if cuts:
            return out, text[:min(cuts)], "stop"
    return out, text_of(tok, out), "stop" if len(out) < n else "length"


def _spanning_stop(solo, tok, p, n):
    """A stop string that spans two tokens of p's greedy output (its tail of one, head of the next)."""
    ids = solo(p, n)
    for k in range(2, len(ids) - 1):
        a, b = text_of(tok, ids[:k]), text_of(tok, ids[:k + 1])
        if len(b) - len(a) >= 2 and len(a) >= 2 and "\ufffd" not in b[len(a) - 2:] and \
                len(a) - 1 > len(text_of(tok, ids[:k - 1])):
            s = a[-1:] + b[len(a):len(a) + 1]
            if s not in a:
                return s
    return None


def test_16_staggered_concurrent_requests_match_generate_without_recompiling(server, solo, tok):
    cases = []
    for i in range(16):
        p = prompt(100 + i, [1, 5, 13, 31, 32, 33, 47, 64][i % 8] + i // 8)
        n = [1, 3, 8, 17, 24, 5, 12, 20][i % 8]
        kind = i % 4
        stop_ids, stop = (), ()
        if kind == 1 and n > 2:
            stop_ids = (solo(p, n)[n // 2],)  # stops early on an id from its own output
        elif kind == 2 and n > 3:
            s = _spanning_stop(solo, tok, p, n)
            stop = (s,) if s else ()
        cases.append((p, n, stop_ids, stop))
    assert sum(bool(c[3]) for c in cases) >= 2, "the test needs stop strings that span tokens"
    before = metric(server, "k2jax_compilations_total")

    async def one(c, i, case):
        p, n, stop_ids, stop = case
        await asyncio.sleep(0.07 * i)
        body = NO_EOS | {"stop_token_ids": list(stop_ids)}
        r = await c.completions.create(model="tiny", prompt=p, max_tokens=n, stop=list(stop) or None,
                                       extra_body=body, **GREEDY)
        return r.choices[0]

    async def main():
        async with aclient(server) as c:
            return await asyncio.gather(*(one(c, i, case) for i, case in enumerate(cases)))

    for (p, n, stop_ids, stop), got in zip(cases, asyncio.run(main())):
        ids, text, reason = _expected(solo, tok, p, n, stop_ids, stop)
        assert (got.token_ids, got.text, got.finish_reason) == (ids, text, reason), (len(p), n, stop_ids, stop)
        for s in stop:
            assert s not in got.text
    assert metric(server, "k2jax_compilations_total") == before, "a request recompiled the engine"


def test_streaming_concatenates_to_the_non_streamed_answer(server, tok):
    c = client(server)
    p = prompt(7, 20)
    whole = c.completions.create(model="tiny", prompt=p, max_tokens=20, extra_body=NO_EOS, **GREEDY)
    chunks = list(c.completions.create(model="tiny", prompt=p, max_tokens=20, stream=True, extra_body=NO_EOS,
                                       stream_options={"include_usage": True}, **GREEDY))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole.choices[0].text
    assert [t for ch in chunks if ch.choices for t in ch.choices[0].token_ids] == whole.choices[0].token_ids
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 20 and chunks[-1].usage.prompt_tokens == 20

    msgs = [{"role": "user", "content": "Kimi is a large language model"}]
    whole = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, **GREEDY)
    parts = list(c.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, stream=True, **GREEDY))
    assert "".join(ch.choices[0].delta.content or "" for ch in parts) == whole.choices[0].message.content
    assert parts[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_sse_wire_format_ends_with_done(server):
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"http://127.0.0.1:{server}/v1/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines) and lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] in ("stop", "length")


def test_stops_and_limits(server, solo, tok):
    c = client(server)
    p = prompt(3, 9)
    ids = solo(p, 16)
    # a stop id: finish "stop", the id counted in usage but not in the text
    r = c.completions.create(model="tiny", prompt=p, max_tokens=16, extra_body=NO_EOS | {"stop_token_ids": [ids[4]]},
                             **GREEDY)
    cut = ids.index(ids[4]) + 1
    assert r.choices[0].finish_reason == "stop" and r.choices[0].token_ids == ids[:cut]
    assert r.choices[0].text == text_of(tok, ids[:cut - 1]) and r.usage.completion_tokens == cut
    # a stop string: cut from the text, which ends where it began
    full = text_of(tok, ids)
    s = full[len(full) // 2:len(full) // 2 + 3]
    r = c.completions.create(model="tiny", prompt=p, max_tokens=16, stop=[s], extra_body=NO_EOS, **GREEDY)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == full[:full.find(s)]
    # max_tokens 1: the prefill's token only
    r = c.completions.create(model="tiny", prompt=p, max_tokens=1, extra_body=NO_EOS, **GREEDY)
    assert r.choices[0].token_ids == ids[:1] and r.choices[0].finish_reason == "length"
    # the whole cache: prompt + max_tokens == max_len is allowed
    r = c.completions.create(model="tiny", prompt=p, max_tokens=MAX_LEN - len(p), extra_body=NO_EOS, **GREEDY)
    assert r.usage.completion_tokens == MAX_LEN - len(p) and r.choices[0].token_ids[:16] == ids


def test_sampling_is_reproducible_from_the_seed(server):
    c = client(server)
    kw = dict(model="tiny", prompt=prompt(9, 8), max_tokens=12, temperature=0.9, top_p=0.9,
              extra_body=NO_EOS | {"top_k": 50})
    a, b = (c.completions.create(seed=5, **kw).choices[0].token_ids for _ in range(2))
    other = c.completions.create(seed=6, **kw).choices[0].token_ids
    assert a == b and a != other


def test_disconnect_frees_its_slot(server):
    before = metric(server, "k2jax_requests_finished_total")
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": MAX_LEN - 3, "stream": True, "temperature": 0,
            "ignore_eos": True}
    with httpx.stream("POST", f"http://127.0.0.1:{server}/v1/completions", json=body, timeout=60) as r:
        it = r.iter_lines()
        next(l for l in it if l.startswith("data: "))
        assert metric(server, "k2jax_slots_in_use") == 1
    for _ in range(100):  # the server notices at its next step
        if metric(server, "k2jax_slots_in_use") == 0:
            break
        time.sleep(0.05)
    assert metric(server, "k2jax_slots_in_use") == 0
    assert metric(server, "k2jax_requests_finished_total") == before + 1
    assert metric(server, "k2jax_generation_tokens_total") > 0


BAD = [  # (path, raw body or JSON, status, param)
    ("completions", b"{not json", 400, None),
    ("completions", {"model": "tiny"}, 400, "prompt"),
    ("chat/completions", {"model": "tiny"}, 400, "messages"),
    ("completions", {"model": "tiny", "prompt": [1, 2], "max_tokens": -1}, 400, "max_tokens"),
    ("completions", {"model": "tiny", "prompt": [1, 2], "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"model": "tiny", "prompt": [1, 2], "max_tokens": MAX_LEN}, 400, "max_tokens"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6},
     400, "max_tokens"),
    ("completions", {"model": "tiny", "prompt": [1, 2], "temperature": -0.5}, 400, "temperature"),
    ("completions", {"model": "tiny", "prompt": [1, 2], "top_p": 0}, 400, "top_p"),
    ("completions", {"model": "tiny", "prompt": [1, 2], "top_p": 1.5}, 400, "top_p"),
    ("completions", {"model": "tiny", "prompt": [3] * (MAX_LEN + 5)}, 400, "prompt"),
    ("completions", {"model": "gpt-4", "prompt": [1, 2]}, 404, "model"),
    ("completions", {"model": "tiny", "prompt": [1, 2], "n": 0}, 400, "n"),
    ("completions", {"model": "tiny", "prompt": [1, 2], "suffix": "x"}, 400, "suffix"),
    ("completions", {"model": "tiny", "prompt": [1, 2], "best_of": 3}, 400, "best_of"),
    ("completions", {"model": "tiny", "prompt": [1, 2], "no_such_field": 1}, 400, "no_such_field"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "echo": True}, 400,
     "echo"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ("completions", {"model": "tiny", "prompt": [1, 5000]}, 400, "prompt"),
]


@pytest.mark.parametrize("path,body,status,param", BAD, ids=[f"{b[3]}-{i}" for i, b in enumerate(BAD)])
def test_bad_request_gets_its_4xx_and_the_server_keeps_serving(server, path, body, status, param):
    url = f"http://127.0.0.1:{server}/v1/{path}"
    r = httpx.post(url, content=body if isinstance(body, bytes) else json.dumps(body),
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"] == "invalid_request_error"
    if param:
        assert param.split("[")[0] in err["message"]
    ok = client(server).completions.create(model="tiny", prompt=[5, 6], max_tokens=2, **GREEDY)
    assert len(ok.choices[0].token_ids) >= 1


def test_the_openai_client_raises_on_a_bad_request(server):
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client(server).completions.create(model="tiny", prompt=[1], top_p=2.0)
    with pytest.raises(openai.NotFoundError):
        client(server).completions.create(model="nope", prompt=[1])


def test_full_queue_answers_429_with_retry_after(server):
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 40, "temperature": 0, "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(timeout=120) as c:
            return await asyncio.gather(*(c.post(f"http://127.0.0.1:{server}/v1/completions", json=body)
                                          for _ in range(MAX_BATCH + QUEUE + 16)))

    rs = asyncio.run(main())
    busy = [r for r in rs if r.status_code == 429]
    assert busy and all(r.headers["retry-after"].isdigit() for r in busy)
    assert busy[0].json()["error"]["code"] == "queue_full"
    assert all(r.status_code in (200, 429) for r in rs)
    assert all(len(r.json()["choices"][0]["token_ids"]) == 40 for r in rs if r.status_code == 200)


def test_load_200_requests_from_32_clients(server, solo):
    pool = [prompt(1000 + k, 1 + (7 * k) % 60) for k in range(20)]
    jobs = [(k, pool[k % 20], 1 + (k * 7) % 16) for k in range(200)]  # 200 distinct (prompt, max_tokens)
    results: dict[int, list[int]] = {}

    async def worker(c, q):
        while q:
            k, p, n = q.pop()
            r = await c.completions.create(model="tiny", prompt=p, max_tokens=n, extra_body=NO_EOS, **GREEDY)
            assert k not in results
            results[k] = (r.choices[0].token_ids, r.choices[0].finish_reason, r.usage.completion_tokens)

    async def main():
        q = list(reversed(jobs))
        async with aclient(server, max_retries=50) as c:  # a full queue's 429s are retried after Retry-After
            await asyncio.gather(*(worker(c, q) for _ in range(32)))

    asyncio.run(main())
    assert sorted(results) == list(range(200))
    for k, p, n in jobs:
        ids, reason, used = results[k]
        assert ids == solo(p, n) and reason == "length" and used == n, k


QUANT_PROMPTS = [prompt(30, 5), prompt(31, 11), prompt(32, 16)]  # one length bucket of generate: one compile


def test_int4_weights_server_equals_generate_on_the_same_quantized_params(files, solo):
    """--quant int4 on the FP8 checkpoint: the routed experts requantized to INT4 groups of 32 and held so
    on device; the server answers what k2jax.generate gives on load_hf(quant="int4")'s params (and not what
    the dequantized weights give, so --quant really reached the loader)."""
    ckpt, tok = files
    int4 = Solo(ckpt, quant="int4")
    want = [int4(p, 10) for p in QUANT_PROMPTS]
    assert want != [solo(p, 10) for p in QUANT_PROMPTS], "INT4 experts change no greedy token: a blind test"
    port = free_port()
    argv = serve_argv(ckpt, tok, port, "--quant", "int4", "--max-batch", "2", "--max-len", "64",
                      "--prefill-chunk", "16")
    with running([argv], port):
        async def main():
            async with aclient(port) as c:
                rs = await asyncio.gather(*(c.completions.create(model="tiny", prompt=p, max_tokens=10,
                                                                 extra_body=NO_EOS, **GREEDY) for p in QUANT_PROMPTS))
                return [r.choices[0].token_ids for r in rs]

        assert asyncio.run(main()) == want


# --- OpenAI fields: seeds, n, prompt lists, echo, logprobs ------------------------------------------------

SAMPLED = {"temperature": 1.0, "max_tokens": 12}


def choice_seed(seed, i):
    """The seed of choice i, as the README documents it: seed + i * 0x9E3779B97F4A7C15, mod 2^63."""
    return (seed + i * 0x9E3779B97F4A7C15) % 2**63


def test_sampling_without_a_seed_differs_and_with_one_repeats(server):
    c = client(server)
    kw = dict(model="tiny", prompt=prompt(21, 6), extra_body=NO_EOS, **SAMPLED)
    a, b = (c.completions.create(**kw).choices[0].token_ids for _ in range(2))
    assert a != b, "two unseeded temperature-1 requests gave the same tokens: the seed is not random"
    a, b = (c.completions.create(seed=123, **kw).choices[0].token_ids for _ in range(2))
    assert a == b


def test_n_choices_equal_single_requests_with_the_derived_seeds(server):
    c = client(server)
    kw = dict(model="tiny", prompt=prompt(22, 7), extra_body=NO_EOS, **SAMPLED)
    r = c.completions.create(n=3, seed=77, **kw)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    got = [ch.token_ids for ch in r.choices]
    want = [c.completions.create(seed=choice_seed(77, i), **kw).choices[0].token_ids for i in range(3)]
    assert got == want and len({tuple(g) for g in got}) == 3
    assert r.usage.completion_tokens == 36 and r.usage.prompt_tokens == 7
    # streamed: each choice's chunks carry its index and add up to the same tokens
    chunks = list(c.completions.create(n=3, seed=77, stream=True, **kw))
    streamed = {i: [t for ch in chunks for x in ch.choices if x.index == i for t in x.token_ids] for i in range(3)}
    assert [streamed[i] for i in range(3)] == want
    assert sorted(x.index for ch in chunks for x in ch.choices if x.finish_reason) == [0, 1, 2]
    # chat too
    msgs = [{"role": "user", "content": "Write code"}]
    r = c.chat.completions.create(model="tiny", messages=msgs, n=2, seed=5, temperature=1.0, max_tokens=6)
    one = c.chat.completions.create(model="tiny", messages=msgs, seed=choice_seed(5, 1), temperature=1.0,
                                    max_tokens=6)
    assert r.choices[1].message.content == one.choices[0].message.content and len(r.choices) == 2


def test_a_list_of_prompts_gives_their_choices_in_order(server, solo, tok):
    c = client(server)
    ps = [prompt(23, 5), prompt(24, 9), prompt(25, 3)]
    r = c.completions.create(model="tiny", prompt=ps, n=2, max_tokens=6, extra_body=NO_EOS, **GREEDY)
    assert [ch.token_ids for ch in r.choices] == [solo(p, 6) for p in ps for _ in range(2)]
    assert r.usage.prompt_tokens == 17 and r.usage.completion_tokens == 36
    texts = ["The quick brown fox", "Kimi is a large"]
    r = c.completions.create(model="tiny", prompt=texts, max_tokens=4, extra_body=NO_EOS, **GREEDY)
    assert [ch.token_ids for ch in r.choices] == [solo(tok.encode(t), 4) for t in texts]


def test_echo_puts_the_prompt_before_the_completion(server, tok):
    c = client(server)
    plain = c.completions.create(model="tiny", prompt="The quick", max_tokens=5, extra_body=NO_EOS, **GREEDY)
    r = c.completions.create(model="tiny", prompt="The quick", max_tokens=5, echo=True, extra_body=NO_EOS, **GREEDY)
    assert r.choices[0].text == "The quick" + plain.choices[0].text
    ids = prompt(26, 4)
    r = c.completions.create(model="tiny", prompt=ids, max_tokens=3, echo=True, extra_body=NO_EOS, **GREEDY)
    assert r.choices[0].text.startswith(tok.decode(ids))
    parts = list(c.completions.create(model="tiny", prompt="The quick", max_tokens=5, echo=True, stream=True,
                                      extra_body=NO_EOS, **GREEDY))
    assert "".join(p.choices[0].text for p in parts) == "The quick" + plain.choices[0].text


def log_softmax_ref(solo, p, ids):
    """log_softmax of K2Model.apply's float32 logits over prompt + output, at the positions that predicted
    each output token: [len(ids), V]."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    logits = solo.model.apply({"params": solo.params}, jnp.asarray([list(p) + list(ids)], jnp.int32))[0]
    ref = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))[len(p) - 1:len(p) - 1 + len(ids)]
    assert [int(t) for t in ref.argmax(-1)] == list(ids)  # the reference is the model the server runs (greedy)
    return ref


def test_logprobs_equal_a_log_softmax_of_the_model_logits(server, solo, tok):
    import numpy as np

    c, k = client(server), 5
    p = prompt(27, 9)
    ids = solo(p, 8)
    ref = log_softmax_ref(solo, p, ids)
    r = c.completions.create(model="tiny", prompt=p, max_tokens=8, logprobs=k, extra_body=NO_EOS, **GREEDY)
    got = r.choices[0].logprobs
    assert got.tokens == [tok.decode([t]) for t in ids]
    np.testing.assert_allclose(got.token_logprobs, [ref[i, t] for i, t in enumerate(ids)], atol=1e-4)
    for i in range(len(ids)):
        top = np.argsort(-ref[i])[:k]
        assert set(got.top_logprobs[i]) == {tok.decode([int(t)]) for t in top}
        for t in top:
            assert got.top_logprobs[i][tok.decode([int(t)])] == pytest.approx(float(ref[i, t]), abs=1e-4)
    # chat: the same per token, top_logprobs in order, and bytes that name the token ids
    msgs = [{"role": "user", "content": "Write code"}]
    p = chat_ids(tok, msgs)
    ids = solo(p, 6, tok.stop_ids)
    ref = log_softmax_ref(solo, p, ids)
    r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, logprobs=True, top_logprobs=k,
                                  **GREEDY)
    content = r.choices[0].logprobs.content
    assert [bytes(e.bytes) for e in content] == [tok.decode_bytes([t]) for t in ids]
    for i, e in enumerate(content):
        assert e.logprob == pytest.approx(float(ref[i, ids[i]]), abs=1e-4)
        top = np.argsort(-ref[i])[:k]
        assert [bytes(x.bytes) for x in e.top_logprobs] == [tok.decode_bytes([int(t)]) for t in top]
        np.testing.assert_allclose([x.logprob for x in e.top_logprobs], ref[i, top], atol=1e-4)


# --- other endpoints -----------------------------------------------------------------------------------

def test_tokenize_and_detokenize(server, tok):
    url = f"http://127.0.0.1:{server}"
    r = httpx.post(f"{url}/tokenize", json={"model": "tiny", "prompt": "The quick brown fox",
                                            "return_token_strs": True}).json()
    ids = tok.encode("The quick brown fox")
    assert r == {"count": len(ids), "max_model_len": MAX_LEN, "tokens": ids,
                 "token_strs": [tok.decode([i]) for i in ids]}
    msgs = [{"role": "user", "content": "hi"}]
    r = httpx.post(f"{url}/tokenize", json={"messages": msgs}).json()
    assert r["tokens"] == chat_ids(tok, msgs) and r["token_strs"] is None
    assert httpx.post(f"{url}/detokenize", json={"tokens": ids}).json() == {"prompt": "The quick brown fox"}
    bad = httpx.post(f"{url}/detokenize", json={"tokens": [1, 10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    bad = httpx.post(f"{url}/tokenize", json={"prompt": "x", "messages": msgs})
    assert bad.status_code == 400


def test_model_by_id_and_version(server):
    c = client(server)
    m = c.models.retrieve("tiny")
    assert m.id == "tiny" and m.owned_by == "k2jax"
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-4")
    import k2jax

    assert httpx.get(f"http://127.0.0.1:{server}/version").json() == {"version": k2jax.__version__}


def test_latency_histograms_in_metrics(server):
    c = client(server)
    before = metric(server, "k2jax_e2e_request_latency_seconds_count")
    itl = metric(server, "k2jax_inter_token_latency_seconds_count")
    queue = metric(server, "k2jax_request_queue_time_seconds_count")
    c.completions.create(model="tiny", prompt=[5, 6], max_tokens=5, extra_body=NO_EOS, **GREEDY)
    assert metric(server, "k2jax_e2e_request_latency_seconds_count") == before + 1
    assert metric(server, "k2jax_inter_token_latency_seconds_count") == itl + 4  # 5 tokens, 4 gaps
    assert metric(server, "k2jax_request_queue_time_seconds_count") == queue + 1
    assert metric(server, 'k2jax_e2e_request_latency_seconds_bucket{le="+Inf"}') == before + 1


def test_a_non_streaming_client_that_disconnects_frees_its_slot_within_a_step(server):
    """A plain (non-streamed) request whose client goes away: the server sees the connection close and the
    slot is free at the next engine step, long before max_tokens."""
    body = json.dumps({"model": "tiny", "prompt": [5, 6, 7], "max_tokens": MAX_LEN - 3, "temperature": 0,
                       "ignore_eos": True}).encode()
    tokens0 = metric(server, "k2jax_generation_tokens_total")
    s = socket.create_connection(("127.0.0.1", server))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
              b"%d\r\n\r\n" % len(body) + body)
    t0 = time.time()
    while metric(server, "k2jax_slots_in_use") < 1:
        assert time.time() - t0 < 30
    s.close()
    steps = metric(server, "k2jax_step_seconds_count")
    t0 = time.time()
    while metric(server, "k2jax_slots_in_use") > 0:
        assert time.time() - t0 < 5, "the slot stayed taken after the client left"
    # the steps run after the close (read right after it) until the slot was free: the one in flight, the
    # one that frees it, and any the metrics requests above took to answer
    assert metric(server, "k2jax_step_seconds_count") - steps <= 4
    assert metric(server, "k2jax_generation_tokens_total") - tokens0 < MAX_LEN - 3
