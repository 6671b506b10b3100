"""`k2jax serve` as users meet it: the command started as a subprocess on a loopback port (a small random FP8
checkpoint written here, float32 weights so argmax is stable), driven by the official `openai` client, sync
and async, streaming and not. Every greedy answer is checked against k2jax.generate on the same prompt alone.
One server for the module."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import openai
import pytest

from tests.serve_util import Solo, free_port, metric, running, serve_argv, write_model

MAX_BATCH, MAX_LEN, CHUNK, QUEUE = 8, 96, 32, 24


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
    return tok.decode([i for i in ids if i < tok.vocab_size])


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
    want = solo(tok.apply_chat_template(msgs), 8, tok.stop_ids)
    assert r.choices[0].token_ids == want
    assert r.choices[0].message.content == text_of(tok, [t for t in want if t not in tok.stop_ids])
    assert r.choices[0].finish_reason == ("stop" if want[-1] in tok.stop_ids else "length")
    assert r.usage.prompt_tokens == len(tok.apply_chat_template(msgs))


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
    ("completions", {"model": "tiny", "prompt": [1, 2], "n": 2}, 400, "n"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, 400, "messages"),
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
