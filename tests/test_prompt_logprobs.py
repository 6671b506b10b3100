"""Prompt logprobs, against transformers' log-softmax on the same weights (the oracle):

- the blocked op (k2jax.ops.logprobs) equals numpy's log-softmax of the same logits;
- `k2jax.generate(..., prompt_logprobs=k)` and the engine, over prompts split into chunks and after a prefix-cache
  hit, in float32 (within 1e-4) and bfloat16 (beside the model's own bfloat16 forward);
- `k2jax serve` as a client meets it (the `openai` client on a loopback port): completions' echo with logprobs
  (max_tokens 0 and 1, text and token-id prompts, streamed and not), vLLM's prompt_logprobs on completions and
  chat, /tokenizer_info; and the bad requests that stay 400s.
"""

import json
import urllib.request

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k2jax import K2Config, K2Model, generate
from k2jax.ops import logprobs as lp_ops
from tests.conftest import CONFIGS

TINY = K2Config.from_hf_config(CONFIGS / "tiny.json")
TOL = 1e-4  # float32


def _log_softmax(logits):
    x = np.asarray(logits, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _want(logits_TV, prompt):
    """Prompt token p's logprob (p >= 1) from a full forward's logits: position p - 1 predicts it."""
    lsm = _log_softmax(logits_TV)
    return np.array([lsm[p - 1, prompt[p]] for p in range(1, len(prompt))])


def test_blocked_scores_equal_numpy_log_softmax(monkeypatch):
    rng = np.random.default_rng(0)
    B, T, D, V, J = 2, 12, 16, 50, 5
    h = rng.normal(size=(B, T, D)).astype(np.float32)
    head = rng.normal(size=(D, V)).astype(np.float32)
    targets = rng.integers(0, V, (B, T)).astype(np.int32)
    targets[0, 3] = targets[1, -1] = -1
    lsm = _log_softmax(np.einsum("btd,dv->btv", h, head))
    monkeypatch.setattr(lp_ops, "ROWS_PER_BLOCK", 8)  # blocks of 4 positions x 2 rows: three blocks
    assert lp_ops._block(B, T) == 4
    got = jax.jit(lp_ops.token_logprobs, static_argnums=3)(h, head, targets, J)
    ref = lp_ops.token_logprobs_reference(h, head, targets, J)
    has = targets >= 0
    own = np.take_along_axis(lsm, np.maximum(targets, 0)[..., None], -1)[..., 0]
    for out in (got, ref):
        np.testing.assert_allclose(np.asarray(out["logprob"])[has], own[has], atol=TOL)
        assert (np.asarray(out["logprob"])[~has] == 0).all() and (np.asarray(out["rank"])[~has] == 0).all()
        np.testing.assert_array_equal(np.asarray(out["rank"])[has], 1 + (lsm > own[..., None]).sum(-1)[has])
        np.testing.assert_array_equal(out["top_ids"], np.argsort(-lsm, -1, kind="stable")[..., :J])
        np.testing.assert_allclose(out["top_logprobs"], -np.sort(-lsm, -1)[..., :J], atol=TOL)


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory, oracle):
    """A random tiny checkpoint the oracle wrote, loaded; -> (dir, cfg, params)."""
    import k2jax

    d = tmp_path_factory.mktemp("hf")
    oracle.run({"config": TINY.to_hf_config(), "seed": 5, "save": {"dir": str(d), "format": "hf"},
                "inputs": {"input_ids": [[1, 2]]}})
    cfg, params = k2jax.load_hf(d)
    return d, cfg, params


def test_generate_prompt_logprobs_equal_transformers(tiny_hf, oracle):
    d, cfg, params = tiny_hf
    prompts = [list(range(3, 40)), [7, 8, 9, 10, 7, 8], [11]]
    tokens, lengths, scores = generate(K2Model(cfg), params, prompts, 2, prompt_logprobs=3)
    assert scores["logprob"].shape == (3, 37) and scores["top_ids"].shape == (3, 37, 3)
    for b, p in enumerate(prompts):
        logits = oracle.run({"load": str(d), "inputs": {"input_ids": [p]}})["logits"][0]
        lsm = _log_softmax(logits)
        assert np.isnan(scores["logprob"][b, 0]) and scores["rank"][b, 0] == 0
        np.testing.assert_allclose(scores["logprob"][b, 1:len(p)], _want(logits, p), atol=TOL)
        assert np.isnan(scores["logprob"][b, len(p):]).all()
        for q in range(1, len(p)):
            np.testing.assert_array_equal(scores["top_ids"][b, q], np.argsort(-lsm[q - 1])[:3])
            assert scores["rank"][b, q] == 1 + (lsm[q - 1] > lsm[q - 1, p[q]]).sum()
        # the generated tokens are what they are without prompt logprobs
        alone, _ = generate(K2Model(cfg), params, prompts, 2)
        np.testing.assert_array_equal(alone, tokens)


def test_bfloat16_prompt_logprobs_follow_the_models_own_forward(tiny_hf):
    _, cfg, params = tiny_hf
    p16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x, params)
    model = K2Model(cfg, jnp.bfloat16)
    prompt = list(range(50, 90))
    _, _, scores = generate(model, p16, [prompt], 1, prompt_logprobs=0)
    want = _want(model.apply({"params": p16}, jnp.asarray([prompt]))[0], prompt)
    f32 = _want(K2Model(cfg).apply({"params": params}, jnp.asarray([prompt]))[0], prompt)
    err = np.abs(scores["logprob"][0, 1:] - want).max()
    assert err < 0.02, err  # the same bfloat16 forward, run in one step instead of one call
    assert np.abs(want - f32).max() > err / 10  # (the tolerance is bfloat16's, not a loose float32 one)


def test_engine_scores_every_chunk_and_a_cached_prompt(tiny_hf, oracle):
    from k2jax.runtime.engine import Engine, Request, SamplingParams

    d, cfg, params = tiny_hf
    eng = Engine(K2Model(cfg), params, max_batch=2, max_len=128, prefill_chunk=16, page_size=8,
                 stall_bound=False)
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, cfg.vocab_size, 45)]
    want = _want(oracle.run({"load": str(d), "inputs": {"input_ids": [prompt]}})["logits"][0], prompt)

    def run(params):
        events = []
        eng.submit(Request(list(prompt), params, events.append))
        while not (events and events[-1].finish_reason):
            eng.step()
        return events

    plain = run(SamplingParams(max_tokens=2))  # its pages go to the prefix cache
    again = run(SamplingParams(max_tokens=2))
    assert again[-1].cached_tokens == 40 and plain[-1].cached_tokens == 0  # five full pages reused
    for max_tokens in (0, 2):
        events = run(SamplingParams(max_tokens=max_tokens, prompt_logprobs=2))
        scored = [e for e in events if e.prompt_logprobs is not None]
        assert len(scored) == 1 and events[-1].cached_tokens == 0  # recomputed whole, so every position
        entries = scored[0].prompt_logprobs
        assert [e["token_id"] for e in entries] == prompt[1:]
        np.testing.assert_allclose([e["logprob"] for e in entries], want, atol=TOL)
        assert all(len(e["top"]) == 2 for e in entries)
        out = [t for e in events for t in e.token_ids]
        if max_tokens == 0:
            assert out == [] and events[-1].finish_reason == "length"
        else:
            assert out == [t for e in plain for t in e.token_ids]
    with pytest.raises(ValueError, match="max_tokens"):
        eng.check(prompt, SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match="prompt_logprobs"):
        eng.check(prompt, SamplingParams(max_tokens=1, prompt_logprobs=21))


def test_engine_scores_a_prompt_spread_over_the_shards(tiny_hf, oracle):
    """On a mesh of data-parallel shards a lone prompt's chunks are spread over every shard's segment, so its
    tokens are not consecutive in the step's flat batch: each position's score is still its own."""

    import k2jax
    from k2jax.runtime.engine import Engine, Request, SamplingParams

    d, cfg, params = tiny_hf
    mesh = k2jax.make_mesh("data=2,expert=4")
    sharded = jax.device_put(params, k2jax.param_shardings(cfg, mesh, warn=False))
    eng = Engine(K2Model(cfg), sharded, max_batch=8, max_len=128, prefill_chunk=16, page_size=8, mesh=mesh,
                 kv_tokens=8 * 128, stall_bound=False)
    spread = []
    plan = eng.sched.plan_ragged
    eng.sched.plan_ragged = lambda: (lambda c: spread.append(c is not None and c.spread is not None) or c)(plan())
    prompt = [int(t) for t in np.random.default_rng(2).integers(0, cfg.vocab_size, 45)]
    want = _want(oracle.run({"load": str(d), "inputs": {"input_ids": [prompt]}})["logits"][0], prompt)
    events = []
    with k2jax.use_mesh(mesh):
        eng.submit(Request(list(prompt), SamplingParams(max_tokens=1, prompt_logprobs=2), events.append))
        while not (events and events[-1].finish_reason):
            eng.step()
    assert any(spread)
    entries = next(e for e in events if e.prompt_logprobs is not None).prompt_logprobs
    assert [e["token_id"] for e in entries] == prompt[1:]
    np.testing.assert_allclose([e["logprob"] for e in entries], want, atol=TOL)


# --- over the API ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.serve_util import free_port, running, serve_argv, write_model

    root = tmp_path_factory.mktemp("served")
    ckpt, tok = write_model(root)
    port = free_port()
    with running([serve_argv(ckpt, tok, port, "--max-len", "256", "--max-batch", "4", "--prefill-chunk", "32")],
                 port):
        yield port, ckpt, tok


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{server[0]}/v1", api_key="x", max_retries=0)


def _oracle_lp(oracle, ckpt, ids):
    return _want(oracle.run({"load": str(ckpt), "inputs": {"input_ids": [ids]}})["logits"][0], ids)


def _tokenize(port, text):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/tokenize", json.dumps({"prompt": text}).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as r:
        return json.load(r)["tokens"]


TEXT = "The quick brown fox jumps over the lazy dog, and then the dog sleeps in the warm sun all day long."


def test_echo_with_logprobs_equals_transformers(server, client, oracle):
    port, ckpt, _ = server
    ids = _tokenize(port, TEXT)
    assert len(ids) > 32  # more than one prompt chunk
    want = _oracle_lp(oracle, ckpt, ids)
    for max_tokens in (0, 1):
        r = client.completions.create(model="tiny", prompt=TEXT, max_tokens=max_tokens, echo=True, logprobs=2,
                                      temperature=0)
        c = r.choices[0]
        lp = c.logprobs
        assert len(lp.tokens) == len(ids) + max_tokens and c.text.startswith(TEXT)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
        np.testing.assert_allclose(lp.token_logprobs[1:len(ids)], want, atol=TOL)
        assert all(2 <= len(t) <= 3 and lp.tokens[i + 1] in t for i, t in enumerate(lp.top_logprobs[1:len(ids)]))
        assert lp.text_offset == sorted(lp.text_offset)
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == max_tokens
        assert c.finish_reason == "length" or max_tokens == 1
    # lm-evaluation-harness's request: token ids, a batch of prompts, one generated token, served twice (the
    # second time from the prefix cache: the scores are the same)
    short = ids[:20]
    for _ in range(2):
        r = client.completions.create(model="tiny", prompt=[ids, short], max_tokens=1, echo=True, logprobs=1,
                                      temperature=0, seed=1234)
        got = sorted(r.choices, key=lambda c: c.index)
        np.testing.assert_allclose(got[0].logprobs.token_logprobs[1:len(ids)], want, atol=TOL)
        np.testing.assert_allclose(got[1].logprobs.token_logprobs[1:20], want[:19], atol=TOL)


def test_streamed_echo_equals_the_whole_answer(client):
    kw = dict(model="tiny", prompt=TEXT, max_tokens=3, echo=True, logprobs=1, temperature=0)
    whole = client.completions.create(**kw).choices[0]
    text, lp = "", {"tokens": [], "token_logprobs": [], "text_offset": []}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                for k in lp:
                    lp[k] += getattr(c.logprobs, k)
    assert text == whole.text
    assert lp["tokens"] == whole.logprobs.tokens and lp["text_offset"] == whole.logprobs.text_offset
    assert lp["token_logprobs"] == whole.logprobs.token_logprobs


def test_vllm_prompt_logprobs_on_completions_and_chat(server, client, oracle):
    port, ckpt, tok = server
    ids = _tokenize(port, TEXT)
    want = _oracle_lp(oracle, ckpt, ids)
    r = client.completions.create(model="tiny", prompt=TEXT, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 3})
    pl = r.choices[0].model_extra["prompt_logprobs"]
    assert pl[0] is None and len(pl) == len(ids)
    for q in range(1, len(ids)):
        entry = pl[q]
        assert str(ids[q]) in entry and 3 <= len(entry) <= 4
        assert abs(entry[str(ids[q])]["logprob"] - want[q - 1]) < TOL
        assert sorted(v["rank"] for v in entry.values())[:3] == [1, 2, 3]
    # chat: at the response's top level, for the prompt the chat template made
    from k2jax.tokenizer import KimiTokenizer
    from tests.serve_util import chat_ids

    msgs = [{"role": "user", "content": "Say something about foxes."}]
    chat = chat_ids(KimiTokenizer.from_dir(tok), msgs)
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, temperature=0,
                                       extra_body={"prompt_logprobs": 0})
    pl = r.model_extra["prompt_logprobs"]
    assert len(pl) == len(chat) and r.usage.prompt_tokens == len(chat)
    np.testing.assert_allclose([pl[q][str(chat[q])]["logprob"] for q in range(1, len(chat))],
                               _oracle_lp(oracle, ckpt, chat), atol=TOL)


def test_tokenizer_info(server):
    with urllib.request.urlopen(f"http://127.0.0.1:{server[0]}/tokenizer_info") as r:
        info = json.load(r)
    assert info["eos_token"] == "[EOS]" and info["model_max_length"] == 256 and "{%" in info["chat_template"]


@pytest.mark.parametrize("body, field", [
    ({"prompt": "hi", "echo": True, "logprobs": 21}, "logprobs"),
    ({"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "hi", "prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt": "hi", "prompt_logprobs": "3"}, "prompt_logprobs"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 0, "echo": True}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": -1, "echo": True, "logprobs": 1}, "max_tokens"),
])
def test_bad_requests_are_400s_naming_the_field(client, body, field):
    import openai

    extra = {k: v for k, v in body.items() if k != "prompt"}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=body["prompt"], extra_body=extra)
    assert e.value.status_code == 400 and e.value.body["param"] == field, e.value.body
