"""The serving engine in-process: the float8 latent cache (e4m3 with a per-token scale) against the
unquantized cache on the same decode step, and the float8 engine's cache bytes and output."""

import jax
import jax.numpy as jnp
import numpy as np

import k2jax
from k2jax.inference.cache import pad_to_cache
from k2jax.serving import device as dev
from k2jax.serving.engine import Engine, Request, SamplingParams, generate_one
from k2jax.testing import random_params
from tests.conftest import CONFIGS


def kv_cache_logit_error(cfg, params, dtype, prompt_len=24, seed=0):
    """Logits of one decode step after a prompt, with the prefill's latents kept in `dtype` vs quantized to
    e4m3 with a per-token scale: -> (max |difference|, std of the logits)."""
    model = k2jax.K2Model(cfg, dtype)
    tokens = jnp.asarray(np.random.default_rng(seed).integers(2, cfg.vocab_size, (1, prompt_len)), jnp.int32)
    pos = jnp.arange(prompt_len)[None]
    _, entries = model.apply({"params": params}, tokens, pos, jnp.ones_like(tokens, bool), method=k2jax.K2Model.prefill)
    cache = pad_to_cache(entries, prompt_len + 1)
    fp8 = jax.tree.map(lambda x: (lambda q, s: (q.astype(jnp.float32) * s[..., None]).astype(dtype))(*dev.quantize(x)),
                       cache)
    valid = jnp.ones((1, prompt_len + 1), bool)
    step = lambda c: model.apply({"params": params}, tokens[:, -1:], pos[:, -1:] + 1, valid, c, prompt_len,  # noqa
                                 method=k2jax.K2Model.decode)[0][0, 0]
    ref, got = step(cache), step(fp8)
    return float(jnp.max(jnp.abs(ref - got))), float(jnp.std(ref))


def test_float8_cache_logit_error_is_small():
    cfg = k2jax.K2Config.from_hf_config(CONFIGS / "tiny.json")
    params = random_params(cfg, jnp.bfloat16)
    err, std = kv_cache_logit_error(cfg, params, jnp.bfloat16)
    assert 0 < err < 0.1 * std, (err, std)  # measured ~2-3% of the logits' spread on this config


def test_float8_engine_halves_the_cache_and_serves():
    cfg = k2jax.K2Config.from_hf_config(CONFIGS / "tiny.json")
    params = random_params(cfg, jnp.float32)
    model = k2jax.K2Model(cfg, jnp.float32)
    nbytes = lambda e: sum(x.nbytes for x in jax.tree.leaves(e.cache))  # noqa: E731
    f8 = Engine(model, params, max_batch=2, max_len=32, prefill_chunk=16, kv_cache_dtype="float8")
    bf = dev.slot_cache(cfg, 2, 32, jnp.float32, "bfloat16")
    latents = sum(x.nbytes for x in jax.tree.leaves(f8.cache) if x.ndim == 4)
    assert latents * 2 == sum(x.nbytes for x in jax.tree.leaves(bf))
    # plus two float32 scales per token and layer: for K2's 576-wide latent, 0.507x the bf16 cache
    assert nbytes(f8) - latents == cfg.num_hidden_layers * 2 * 33 * 2 * 4
    f8.warm_up()
    ids, _, reason = generate_one(f8, [5, 6, 7, 8], SamplingParams(max_tokens=6))
    want, _ = k2jax.generate(model, params, [[5, 6, 7, 8]], 6)
    assert reason == "length" and len(ids) == 6
    assert ids[0] == int(want[0][0])  # the first token comes from the prefill's own latents


def e4m3_round_trip(x):
    """An e4m3 round trip written out in float64: a per-token scale amax / 448, 3 mantissa bits rounded half
    to even, exponents clipped at e4m3's smallest normal (2^-6; subnormals step 2^-9)."""
    x = np.asarray(x, np.float64)
    s = np.maximum(np.abs(x).max(-1, keepdims=True), 1e-12) / 448.0
    y = x / s
    q = 2.0 ** (np.maximum(np.floor(np.log2(np.maximum(np.abs(y), 2.0**-9))), -6) - 3)
    return np.clip(np.round(y / q) * q, -448, 448) * s


def test_float8_cache_quantization_equals_an_e4m3_round_trip():
    # tokens of very different ranges, as ckv and k_pe of a real model have (each is quantized on its own)
    x = np.random.default_rng(0).standard_normal((4, 6, 64)) * np.logspace(-3, 2, 6)[None, :, None]
    x[0, 0, 3] = 40.0  # one outlier sets its token's scale
    q, s = dev.quantize(jnp.asarray(x, jnp.float32))
    got = np.asarray(q.astype(jnp.float32), np.float64) * np.asarray(s, np.float64)[..., None]
    want = e4m3_round_trip(np.asarray(x, np.float32))
    np.testing.assert_allclose(np.asarray(s), np.abs(np.asarray(x, np.float32)).max(-1) / 448, rtol=1e-6)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-30)
    assert not np.allclose(got, x, rtol=1e-3)  # lossy: really rounded to 3 mantissa bits


def test_a_burst_is_prefilled_in_one_batch_and_decodes_over_buckets_of_live_rows():
    """Three requests submitted together while nothing decodes: one batched prefill (a bucket of 4 rows, one
    spare; the long prompt takes a second chunk); then the decodes run over 2 of the 4 slots, all 4 (in
    place) and 1, as requests join and finish. Every output equals generate on its prompt alone."""
    cfg = k2jax.K2Config.from_hf_config(CONFIGS / "tiny.json")
    params = random_params(cfg, jnp.float32, seed=3)
    model = k2jax.K2Model(cfg, jnp.float32)
    eng = Engine(model, params, max_batch=4, max_len=48, prefill_chunk=16)
    shapes = []
    for name in ("_prefill_first", "_prefill_next", "_decode_rows", "_decode"):
        step = getattr(eng, name)
        setattr(eng, name, lambda *a, _s=step, _n=name: shapes.append((_n, a[3].shape)) or _s(*a))
    rng = np.random.default_rng(0)
    jobs = [(rng.integers(2, cfg.vocab_size, n).tolist(), m) for n, m in ((5, 9), (21, 6), (9, 5))]
    got = {}
    for i, (p, m) in enumerate(jobs):
        got[i] = []
        eng.submit(Request(p, SamplingParams(max_tokens=m), lambda e, i=i: got[i].extend(e.token_ids)))
    while any(eng.slots) or eng.waiting or eng._inbox:
        eng.step()
    for i, (p, m) in enumerate(jobs):
        want, _ = k2jax.generate(model, params, [p], 9)  # one max_new_tokens: fewer compiles; greedy is a prefix
        assert got[i] == [int(t) for t in want[0][:m]], i
    assert shapes[0] == ("_prefill_first", (4, 16))  # all three at once
    assert [s for s in shapes if s[0] == "_prefill_next"] == [("_prefill_next", (1, 16))]  # the long prompt's
    # last 5 tokens, while the others decode
    decodes = [s for s in shapes if s[0].startswith("_decode")]
    assert decodes[:2] == [("_decode_rows", (2,)), ("_decode", (4,))]
    assert set(decodes) == {("_decode_rows", (2,)), ("_decode", (4,)), ("_decode_rows", (1,))}


def test_a_burst_arriving_over_time_at_an_idle_engine_is_gathered_into_one_prefill():
    """batch_wait_s: requests 50 ms apart (as over HTTP, where a burst comes in over milliseconds) reach an
    idle engine that is running; the first step prefills all three together."""
    import threading
    import time

    cfg = k2jax.K2Config.from_hf_config(CONFIGS / "tiny.json")
    params = random_params(cfg, jnp.float32, seed=3)
    model = k2jax.K2Model(cfg, jnp.float32)
    eng = Engine(model, params, max_batch=4, max_len=48, prefill_chunk=16, batch_wait_s=2.0)
    shapes = []
    first = eng._prefill_first
    eng._prefill_first = lambda *a: shapes.append(a[3].shape) or first(*a)
    done = threading.Event()
    got = []
    thread = threading.Thread(target=eng.run, daemon=True)
    thread.start()
    try:
        for i in range(3):
            eng.submit(Request([5 + i, 6, 7], SamplingParams(max_tokens=2),
                               lambda e: got.append(e) or (e.finish_reason and len(got) >= 6 and done.set())))
            time.sleep(0.05)
        assert done.wait(120)
    finally:
        eng.stop()
        thread.join(60)
    assert shapes[0] == (4, 16), shapes  # all three in the first prefill
    assert sum(e.finish_reason == "length" for e in got) == 3
