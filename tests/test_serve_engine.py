"""The serving engine in-process over the paged cache: batching, prefix reuse, preemption, the pool's
limits, no recompiles, the float8 cache, and sharded steps. Outputs are checked against k2jax.generate on
each prompt alone (greedy, float32), which the parity tests tie to transformers."""

import dataclasses
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k2jax
from k2jax.ops.paged import quantize_latents
from k2jax.runtime import compiles
from k2jax.runtime.engine import Engine, Request, SamplingParams, generate_one
from k2jax.runtime.scheduler import STALL_FILL
from k2jax.testing import random_params
from tests.conftest import CONFIGS

CFG = k2jax.K2Config.from_hf_config(CONFIGS / "tiny.json")
PAGE = 8
N = 8  # tokens per request in these tests


@pytest.fixture(scope="module")
def model_params():
    return k2jax.K2Model(CFG, jnp.float32), random_params(CFG, jnp.float32, seed=3)


@pytest.fixture(scope="module")
def solo(model_params):
    """Greedy output of generate on one prompt alone (cached per prompt)."""
    model, params = model_params
    memo = {}

    def run(prompt, n=N):
        key = (tuple(prompt), n)
        if key not in memo:
            memo[key] = [int(t) for t in k2jax.generate(model, params, [prompt], n, max_len=64)[0][0]]
        return memo[key]

    return run


def _engine(model_params, **kw):
    model, params = model_params
    args = dict(max_batch=4, max_len=64, prefill_chunk=16, page_size=PAGE, kv_tokens=4096) | kw
    return Engine(model, params, **args)


def _run(eng, prompts, n=N, **sp):
    """Submit all prompts at once and step until every one finished -> (token ids, events) per prompt."""
    events = {i: [] for i in range(len(prompts))}
    reqs = [Request(list(p), SamplingParams(max_tokens=n, **sp), events[i].append) for i, p in enumerate(prompts)]
    eng.submit(*reqs)
    while any(not (e and e[-1].finish_reason) for e in events.values()):
        eng.step()
    return [[t for e in events[i] for t in e.token_ids] for i in range(len(prompts))], events


def _prompts(seed, lengths):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, CFG.vocab_size, n).tolist() for n in lengths]


def _record_shapes(eng):
    shapes = []
    step = eng.runner.step
    eng.runner.step = lambda shape, batch: shapes.append(shape) or step(shape, batch)
    return shapes


def _record_fed(eng):
    """[(shape, tokens fed per row)] of each runner step."""
    steps = []
    step = eng.runner.step
    eng.runner.step = lambda shape, batch: steps.append((shape, batch.count.tolist())) or step(shape, batch)
    return steps


def _long_prompt_beside_a_decode(eng, solo) -> int:
    """A short prompt's request starts decoding, then a 50-token prompt arrives; both run to the end and
    equal generate's outputs. -> engine steps taken."""
    short, long = _prompts(6, (5, 50))
    ev = {0: [], 1: []}
    eng.submit(Request(short, SamplingParams(max_tokens=N), ev[0].append))
    eng.step()  # the short prompt's chunk: it decodes from now on
    eng.submit(Request(long, SamplingParams(max_tokens=N), ev[1].append))
    n_steps = 1
    while not all(e and e[-1].finish_reason for e in ev.values()):
        eng.step()
        n_steps += 1
    assert [t for e in ev[0] for t in e.token_ids] == solo(short)
    assert [t for e in ev[1] for t in e.token_ids] == solo(long)
    return n_steps


def test_ragged_steps_take_every_row_in_one_call(model_params, solo):
    """The default engine on one device: each engine step is one ragged call. A burst of three prompts
    arriving together is prefilled in one call (whole blocks of 16 tokens: 1 + 2 + 1 blocks), then one call
    per token over the decoding rows. Every output equals generate on its prompt alone."""
    eng = _engine(model_params, idle_chunk=64)
    assert eng.ragged
    steps = _record_fed(eng)
    prompts = _prompts(0, (5, 21, 9))
    got, _ = _run(eng, prompts)
    for i, p in enumerate(prompts):
        assert got[i] == solo(p), i
    shape, fed = steps[0]
    assert fed == [5, 21, 9, 0] and (shape.blocks * shape.block, shape.decode) == (64, 4)
    assert all(sh.rows == 4 for sh, _ in steps)
    assert [f for _, f in steps[1:N]] == [[1, 1, 1, 0]] * (N - 1)  # all three decode from the second step
    assert len(steps) == N and all(sh.blocks == 0 for sh, _ in steps[1:])
    assert len(set(eng.sched.shapes())) == 3 + 1  # decode sizes 1, 2, 4; one chunk region (64 tokens at least)


def test_ragged_chunks_are_bounded_by_the_budget(model_params, solo):
    """A lone prompt is prefilled idle_chunk tokens at a time; a prompt arriving while another request
    decodes takes at most prefill_chunk tokens per step, in the same call as the decoding row."""
    eng = _engine(model_params, idle_chunk=32)
    steps = _record_fed(eng)
    long = _prompts(5, (50,))[0]
    got, _ = _run(eng, [long])
    assert got[0] == solo(long)
    assert [f[0] for _, f in steps[:2]] == [32, 18]

    steps.clear()
    n_steps = _long_prompt_beside_a_decode(eng, solo)
    beside = [f for _, f in steps[1:] if 1 in f and max(f) > 1]
    assert beside and max(max(f) for f in beside) == 16  # beside a decoding row: prefill_chunk at most
    # one call per engine step, but the last: it only reads the tokens of the step before (overlap)
    assert len(steps) == n_steps - 1


def test_a_burst_is_prefilled_in_one_batch_and_decodes_over_buckets_of_live_rows(model_params, solo):
    """Three requests submitted together while nothing decodes: one batched first chunk (a bucket of 4 rows,
    one spare), the long prompt's second chunk while the others decode, then decodes over buckets of the live
    rows as requests finish. Every output equals generate on its prompt alone. (The rectangular steps: a
    mesh's.)"""
    eng = _engine(model_params, ragged=False)
    shapes = _record_shapes(eng)
    prompts = _prompts(0, (5, 21, 9))
    got, _ = _run(eng, prompts)
    for i, p in enumerate(prompts):
        assert got[i] == solo(p), i
    assert (shapes[0].rows, shapes[0].tokens, shapes[0].read_pages) == (4, 16, 0)  # all three at once
    later = [s for s in shapes if s.tokens > 1 and s.read_pages > 0]
    assert [(s.rows, s.tokens) for s in later] == [(1, 16)]  # the long prompt's last 5 tokens
    # 2 decoding while it prefills, then all 3 (a bucket of 4), then the long one alone: it started a step late
    assert [s.rows for s in shapes if s.tokens == 1] == [2] + [4] * (N - 2) + [1]


def test_a_lone_prompt_takes_idle_chunks_and_a_prompt_beside_decodes_takes_prefill_chunks(model_params, solo):
    """While nothing decodes, a lone prompt is prefilled idle_chunk tokens at a time (its first chunk, then
    a later one over the cached prefix); a prompt arriving while another request decodes takes chunks of at
    most prefill_chunk, so the decoding row waits at most one such chunk per token. Outputs equal generate.
    (The rectangular steps.)"""
    eng = _engine(model_params, idle_chunk=32, ragged=False)
    shapes = _record_shapes(eng)
    long = _prompts(5, (50,))[0]
    got, _ = _run(eng, [long])
    assert got[0] == solo(long)
    assert [(s.tokens, s.read_pages > 0) for s in shapes if s.tokens > 1] == [(32, False), (32, True)]

    shapes.clear()
    _long_prompt_beside_a_decode(eng, solo)
    prefills = [s.tokens for s in shapes[1:] if s.tokens > 1]
    assert prefills and max(prefills) == 16, shapes  # beside a decoding row: prefill_chunk at most
    # the idle engine default: 4 x prefill_chunk, at most max_len
    assert _engine(model_params).idle_chunk == 64 and _engine(model_params, max_len=40).idle_chunk == 40


def test_chunks_beside_decodes_are_cut_to_one_first_chunks_time(model_params, solo):
    """With the steps' times known (here a table in which a later chunk costs more the more it re-reads), a
    prompt arriving while another request decodes is prefilled in chunks cut so that each engine step (its
    chunk and the decode) takes no longer than STALL_FILL of a first chunk of prefill_chunk tokens alone,
    or, where nothing fits, the quickest chunk. Outputs still equal generate's; without the bound
    (stall_bound=False) there are no smaller sizes and nothing is timed."""
    eng = _engine(model_params, max_len=128, prefill_chunk=16, min_chunk=1, ragged=False)
    assert eng.sched.later_sizes == [2, 4, 8, 16, 64]  # down to an eighth of prefill_chunk
    assert _engine(model_params, max_len=128, prefill_chunk=16,
                   ragged=False).sched.later_sizes == [16, 64]  # min_chunk 64

    def cost(shape):  # seconds: a first chunk by its tokens; a later one also by the pages it re-reads
        if shape.tokens == 1:
            return 0.002 * shape.rows
        return 0.001 * shape.tokens * (1 + shape.read_pages / 4)

    eng.sched.step_s = {sh: cost(sh) for sh in eng.sched.timed_shapes()}
    budget = eng.sched.stall_budget_s()
    assert budget == 0.016  # the first chunk of 16 tokens
    steps = []
    run = eng.runner.step
    eng.runner.step = lambda shape, batch: steps[-1].append(shape) or run(shape, batch)
    short, long = _prompts(8, (5, 50))
    ev = {0: [], 1: []}
    eng.submit(Request(short, SamplingParams(max_tokens=40), ev[0].append))
    steps.append([])
    eng.step()  # the short prompt's chunk: it decodes from now on
    eng.submit(Request(long, SamplingParams(max_tokens=N), ev[1].append))
    while not all(e and e[-1].finish_reason for e in ev.values()):
        steps.append([])
        eng.step()
    assert [t for e in ev[1] for t in e.token_ids] == solo(long)
    assert [t for e in ev[0] for t in e.token_ids] == solo(short, 40)
    beside = [st for st in steps[1:] if any(s.tokens > 1 for s in st) and any(s.tokens == 1 for s in st)]
    assert len(beside) > 50 // 16 + 1  # more steps than whole chunks would take
    for st in beside:  # later chunks fit (a first one cannot here: its smallest size, 16 tokens, is the budget)
        if any(s.tokens > 1 and s.read_pages > 0 for s in st):
            assert sum(map(cost, st)) <= STALL_FILL * budget + 1e-9, st
    sizes = {s.tokens for st in beside for s in st if s.tokens > 1 and s.read_pages > 0}
    assert sizes & {2, 4, 8}, sizes  # later chunks cut below prefill_chunk

    plain = _engine(model_params, max_len=128, prefill_chunk=16, stall_bound=False, ragged=False)
    assert plain.sched.later_sizes == [16, 64] and plain.sched.timed_shapes() == []


def test_a_burst_arriving_over_time_at_an_idle_engine_is_gathered_into_one_prefill(model_params):
    """batch_wait_s: requests 50 ms apart (as over HTTP) reach an idle running engine; its first step
    prefills all three together."""
    eng = _engine(model_params, batch_wait_s=2.0)
    steps = _record_fed(eng)
    done, got = threading.Event(), []
    thread = threading.Thread(target=eng.run, daemon=True)
    thread.start()
    try:
        for i in range(3):
            eng.submit(Request([5 + i, 6, 7], SamplingParams(max_tokens=2),
                               lambda e: got.append(e) or (e.finish_reason and len(got) >= 6 and done.set())))
            time.sleep(0.05)
        assert done.wait(300)
    finally:
        eng.stop()
        thread.join(60)
    assert steps[0][1] == [3, 3, 3, 0], steps  # all three in the first prefill
    assert sum(e.finish_reason == "length" for e in got) == 3


def test_prefix_reuse_is_exact(model_params, solo):
    """A prompt whose first pages are cached skips them: with a full-page hit (the whole prompt but its last
    token), a partial hit (a shared first page, then different tokens), and a hit on pages that were evicted
    and recomputed, the greedy output equals the output without reuse."""
    eng = _engine(model_params, kv_tokens=8 * PAGE * 4)  # 8 pages per slot: evictions under load
    base = _prompts(1, (33,))[0]  # 4 full pages and a token
    got, ev = _run(eng, [base])
    assert got[0] == solo(base) and ev[0][-1].cached_tokens == 0
    # full hit: the same prompt again reuses its 4 full pages (32 tokens)
    got, ev = _run(eng, [base])
    assert got[0] == solo(base) and ev[0][-1].cached_tokens == 32
    # partial hit: the first page shared, then other tokens
    other = base[:PAGE] + _prompts(2, (20,))[0]
    got, ev = _run(eng, [other])
    assert got[0] == solo(other) and ev[0][-1].cached_tokens == PAGE
    # evict: fill the pool with other prompts, then the base prompt's pages are gone and recomputed
    _run(eng, _prompts(3, (60, 60, 60, 60)), n=2)
    hits = eng.pool.hits
    got, ev = _run(eng, [base])
    assert got[0] == solo(base)
    assert ev[0][-1].cached_tokens < 32 and eng.pool.hits - hits == ev[0][-1].cached_tokens
    got, ev = _run(eng, [base])  # and cached again
    assert got[0] == solo(base) and ev[0][-1].cached_tokens == 32


def test_preemption_loses_nothing(model_params, solo):
    """A pool too small for the offered load: requests are preempted (pages freed, recomputed later), every
    request completes with its output alone, and no page leaks."""
    eng = _engine(model_params, kv_tokens=12 * PAGE, prefix_cache=False)  # 12 pages for 4 rows of up to 7
    prompts = _prompts(4, (30, 25, 40, 9, 17, 33))
    got, ev = _run(eng, prompts, n=12)
    for i, p in enumerate(prompts):
        assert got[i] == solo(p, 12), i
        assert ev[i][-1].finish_reason == "length"
    assert eng.sched.preemptions > 0
    assert eng.pool.free_count() == eng.pool.num_pages - eng.pool.shards  # every page back, trash pages apart
    assert eng.pool.in_use_count() == 0


def test_a_request_larger_than_the_pool_is_refused(model_params):
    eng = _engine(model_params, kv_tokens=4 * PAGE)
    with pytest.raises(ValueError, match="exceeds the KV cache pool"):
        eng.submit(Request(list(range(2, 30)), SamplingParams(max_tokens=8), lambda e: None))
    eng.submit(Request(list(range(2, 20)), SamplingParams(max_tokens=8), lambda e: None))  # fits: accepted


def test_no_recompiles_after_warm_up(model_params):
    """After warm_up, requests of random lengths and settings arriving and leaving compile nothing."""
    compiles.install()
    eng = _engine(model_params, max_len=48)
    eng.warm_up()
    before = compiles.count()
    # the ragged steps' time model is measured (its prefix-reading steps compile nothing new) and then used
    assert set(eng.sched.ragged_s) == set(eng.sched.timed_shapes()) != set()
    assert all(base > 0 and per_token >= 0 for base, per_token in eng.sched.ragged_s.values())
    rng = np.random.default_rng(5)
    pending = []
    for wave in range(4):
        for _ in range(int(rng.integers(1, 5))):
            p = rng.integers(2, CFG.vocab_size, int(rng.integers(1, 40))).tolist()
            n = int(rng.integers(1, 48 - len(p) + 1))
            sp = SamplingParams(max_tokens=n, temperature=float(rng.choice([0, 0.7])), seed=int(rng.integers(9)),
                                top_k=int(rng.choice([0, 5])), frequency_penalty=float(rng.choice([0, 0.5])))
            done = []
            eng.submit(Request(p, sp, done.append))
            pending.append(done)
        for _ in range(int(rng.integers(1, 6))):
            eng.step()
    while any(not (d and d[-1].finish_reason) for d in pending):
        eng.step()
    assert compiles.count() == before, f"{compiles.count() - before} compilations after warm-up"


def test_a_slots_sampling_settings_are_sent_once_and_a_reused_slot_takes_the_new_ones(model_params, solo):
    """The settings live on the device per slot: sent when a request takes the slot, not with every step. One
    slot serves a sampled request, then a greedy one: each gives generate's tokens for its own settings. With
    no grammar row, a step's mask is the one already on the device."""
    model, params = model_params
    eng = _engine(model_params, max_batch=1)
    sent, masks = [], []
    put, step = eng.runner.set_sampling, eng.runner.step
    eng.runner.set_sampling = lambda settings: (sent.append(sorted(settings)) if settings else None) or put(settings)
    eng.runner.step = lambda shape, batch: masks.append(isinstance(batch.bitmask, jax.Array)) or step(shape, batch)
    a, b = _prompts(8, (6, 9))
    got_a = _run(eng, [a], temperature=1.0, seed=11)[0][0]
    got_b = _run(eng, [b])[0][0]
    want_a = [int(t) for t in k2jax.generate(model, params, [a], N, max_len=64, temperature=1.0, seed=11)[0][0]]
    assert got_a == want_a and got_a != solo(a)  # sampled with its own seed, not greedy
    assert got_b == solo(b)  # the slot no longer samples
    assert sent == [[0], [0]], sent  # once per request, though each ran N steps
    assert len(masks) >= 2 * N and all(masks)


def e4m3_round_trip(x):
    """An e4m3 round trip written out in float64: a scale amax / 448 per token, 3 mantissa bits rounded half
    to even, exponents clipped at e4m3's smallest normal (2^-6; subnormals step 2^-9)."""
    x = np.asarray(x, np.float64)
    s = np.maximum(np.abs(x).max(-1, keepdims=True), 1e-12) / 448.0
    y = x / s
    q = 2.0 ** (np.maximum(np.floor(np.log2(np.maximum(np.abs(y), 2.0**-9))), -6) - 3)
    return np.clip(np.round(y / q) * q, -448, 448) * s


def test_float8_cache_quantization_equals_an_e4m3_round_trip():
    """Each token's ckv (first R values) and k_pe (the rest) quantized on their own scale, as an e4m3 round
    trip written out in float64."""
    R = 48
    x = np.random.default_rng(0).standard_normal((4, 6, 64)) * np.logspace(-3, 2, 6)[None, :, None]
    x[0, 0, 3] = 40.0  # one outlier sets its token's ckv scale
    x[..., R:] *= 0.01  # k_pe of another range
    q, s = quantize_latents(jnp.asarray(x, jnp.float32), R)
    q = np.asarray(q.astype(jnp.float32), np.float64)
    got = np.concatenate([q[..., :R] * np.asarray(s)[..., :1], q[..., R:] * np.asarray(s)[..., 1:]], -1)
    x32 = np.asarray(x, np.float32)
    want = np.concatenate([e4m3_round_trip(x32[..., :R]), e4m3_round_trip(x32[..., R:])], -1)
    np.testing.assert_allclose(np.asarray(s)[..., 0], np.abs(x32[..., :R]).max(-1) / 448, rtol=1e-6)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-30)
    assert not np.allclose(got, x, rtol=1e-3)  # lossy: really rounded to 3 mantissa bits


def test_float8_engine_halves_the_pool_and_serves(model_params, solo):
    model, params = model_params
    f8 = _engine(model_params, kv_cache_dtype="float8", kv_tokens=512)
    f32 = _engine(model_params, kv_cache_dtype="float32", kv_tokens=512)
    nbytes = lambda e: sum(x.nbytes for x in jax.tree.leaves(e.runner.state["pages"]))  # noqa: E731
    scales = sum(x.nbytes for x in jax.tree.leaves(f8.runner.state["scales"]))
    assert nbytes(f8) * 4 == nbytes(f32)
    assert scales == CFG.num_hidden_layers * f8.pool.num_pages * PAGE * 2 * 4  # two float32 scales per token
    prompt = [5, 6, 7, 8]
    ids, _, reason = generate_one(f8, prompt, SamplingParams(max_tokens=6))
    assert reason == "length" and len(ids) == 6
    assert ids[0] == solo(prompt)[0]  # the first token comes from the prefill's own latents


@pytest.mark.parametrize("ragged", [False, True], ids=["rectangular", "ragged"])
@pytest.mark.parametrize("spec", ["expert=8", "data=2,expert=4", "expert=4,tensor=2"])
def test_sharded_engine_equals_one_device(model_params, solo, spec, ragged):
    """The server's steps with slots and pages split over the batch's mesh axes (and a lone request
    replicated; a ragged step: one segment per shard, a step's lone chunk spread over them all): the same
    outputs as one device."""
    model, params = model_params
    mesh = k2jax.make_mesh(spec)
    sharded = jax.device_put(params, k2jax.param_shardings(CFG, mesh, warn=False))
    eng = Engine(model, sharded, max_batch=4, max_len=64, prefill_chunk=16, page_size=PAGE, kv_tokens=8 * 256,
                 mesh=mesh, ragged=ragged)
    assert eng.max_batch == {"expert=8": 8, "data=2,expert=4": 8, "expert=4,tensor=2": 4}[spec]  # whole shards
    spread = []  # the rows whose lone chunk a step spread over the shards
    if ragged:
        assert {s.shards for s in eng.sched.shapes()} == {eng.pool.shards}
        plan = eng.sched.plan_ragged

        def spy():
            call = plan()
            spread.append(None if call is None else call.spread)
            return call

        eng.sched.plan_ragged = spy
    prompts = _prompts(6, (5, 21, 9, 30, 2, 12, 7, 16, 3))
    with k2jax.use_mesh(mesh):
        got, _ = _run(eng, prompts)
        lone, _ = _run(eng, prompts[:1])
    for i, p in enumerate(prompts):
        assert got[i] == solo(p), i
    assert lone[0] == solo(prompts[0])
    assert not ragged or any(b is not None for b in spread)  # a lone prompt's chunk, spread


@pytest.mark.parametrize("flags", [dict(max_batch=8, max_len=4096, prefill_chunk=512),
                                   dict(max_batch=16, max_len=8192, prefill_chunk=256, idle_chunk=4096),
                                   dict(max_batch=64, max_len=32768, prefill_chunk=1024)])
def test_a_handful_of_programs_whatever_the_settings(model_params, flags):
    """Ragged steps: decode-only sizes (powers of two from an eighth of the slots up) and chunk regions (powers of two from
    64 tokens up to the idle chunk), never a product with cache lengths: at most 12 programs at these
    settings, where the rectangular steps take several times as many."""
    ragged = _engine(model_params, kv_tokens=flags["max_len"], **flags)
    rect = _engine(model_params, kv_tokens=flags["max_len"], ragged=False, **flags)
    n = len(set(ragged.sched.shapes()))
    assert n <= 12, ragged.programs_cause()
    assert len(set(rect.sched.shapes())) >= 3 * n


def test_a_handful_of_programs_on_a_mesh(model_params):
    """On a mesh of 8 data-parallel shards the ragged steps' sizes are each segment's: still a handful of
    programs (2 slots a shard decode in sizes 1 and 2), where the rectangular steps take several times as
    many."""
    model, params = model_params
    mesh = k2jax.make_mesh("data=2,expert=4")
    sharded = jax.device_put(params, k2jax.param_shardings(CFG, mesh, warn=False))
    flags = dict(max_batch=16, max_len=8192, prefill_chunk=256, idle_chunk=4096, page_size=PAGE, kv_tokens=8 * 8192)
    ragged = Engine(model, sharded, mesh=mesh, **flags)
    rect = Engine(model, sharded, mesh=mesh, ragged=False, **flags)
    shapes = set(ragged.sched.shapes())
    assert {s.shards for s in shapes} == {8} and {s.decode for s in shapes} == {1, 2}
    assert len(shapes) <= 12, ragged.programs_cause()
    assert len(set(rect.sched.shapes())) >= 3 * len(shapes)


# --- speculative decoding (n-gram drafts verified in the ragged step) -------------------------------------------
def _spec_engine(model_params, **kw):
    return _engine(model_params, speculative="ngram", num_speculative_tokens=3, prompt_lookup=(1, 3), **kw)


class _Scripted:
    """A proposer whose drafts a test chooses: fn(tokens) -> the ids to draft after them."""

    def __init__(self, fn):
        self.fn = fn

    def propose(self, tokens, k):
        return list(self.fn(tokens))[:k]


def test_speculative_decoding_gives_the_same_greedy_tokens(model_params, solo):
    """Prompt-lookup drafts, verified in one step with the decoding rows: every output equals generate on its
    prompt alone (greedy, float32), some drafts were accepted, and every step shape is one of the scheduler's."""
    eng = _spec_engine(model_params)
    shapes = _record_shapes(eng)
    prompts = _prompts(0, (5, 9, 3, 12))
    prompts[0] = prompts[0] * 3
    n = 40  # the random model's outputs fall into short cycles, which the lookup predicts
    got, _ = _run(eng, prompts, n=n)
    for i, p in enumerate(prompts):
        assert got[i] == solo(p, n), i
    m = eng.metrics
    assert any(sh.verify for sh in shapes) and set(shapes) <= set(eng.sched.shapes())
    assert m.spec_verified > 0 and 0 < m.spec_accepted <= m.spec_drafted
    assert "k2jax_spec_decode_accepted_tokens_total" in m.render()


@pytest.mark.parametrize("right", [True, False], ids=["accept_all", "accept_none"])
def test_scripted_drafts_are_all_accepted_or_all_rejected(model_params, solo, right):
    """Drafts that are the model's own continuation are all accepted (up to 1 + 3 tokens a step); drafts that
    never are cost steps but change nothing: the output is generate's either way."""
    p, n = _prompts(8, (6,))[0], 16
    want = solo(p, n)
    eng = _spec_engine(model_params)
    eng.proposer = _Scripted(lambda toks: [t if right else (t + 1) % CFG.vocab_size for t in want[len(toks) - len(p):]])
    steps = _record_fed(eng)
    got, _ = _run(eng, [p], n=n)
    assert got[0] == want
    m = eng.metrics
    assert m.spec_drafted > 0
    if right:
        assert m.spec_accepted == m.spec_drafted and len(steps) == 1 + -(-(n - 1) // 4)  # the prefill, then 4 a step
    else:
        assert m.spec_accepted == 0 and len(steps) == n


def test_penalised_and_grammar_rows_ride_in_verifying_steps_as_plain_rows(demo_vocab):
    """A penalised request counts its own tokens and a grammar's mask follows each token, so neither drafts;
    they still decode in the verifying steps beside a row that drafts, their one token a step sampled with
    their counts and mask. Every output is the engine's without speculation, the penalty and the grammar
    changed theirs, and drafts were verified while both decoded."""
    tok, model, params, grammars = demo_vocab
    rng = np.random.default_rng(7)
    prompts = [rng.integers(2, model.cfg.vocab_size, 7).tolist(), rng.integers(2, model.cfg.vocab_size, 9).tolist(), rng.integers(2, model.cfg.vocab_size, 6).tolist()]
    settings = [{}, dict(frequency_penalty=0.8), dict(grammar={"response_format": {"type": "json_object"}})]

    def run(speculative, plain=False):
        kw = dict(speculative="ngram", num_speculative_tokens=3) if speculative else {}
        eng = Engine(model, params, grammars=grammars, max_batch=4, max_len=64, prefill_chunk=16, page_size=PAGE,
                     kv_tokens=4096, **kw)
        if speculative:  # the first row's drafts: its own continuation (only a free row is asked)
            eng.proposer = _Scripted(lambda toks: want[0][len(toks) - len(prompts[0]):])
        steps = _record_fed(eng)
        events = {i: [] for i in range(3)}
        eng.submit(*[Request(list(p), SamplingParams(max_tokens=24, **({} if plain else sp)), events[i].append)
                     for i, (p, sp) in enumerate(zip(prompts, settings))])
        while any(not (e and e[-1].finish_reason) for e in events.values()):
            eng.step()
        return [[t for e in ev for t in e.token_ids] for ev in events.values()], steps, eng.metrics

    want, _, _ = run(False)
    got, steps, m = run(True)
    assert got == want
    assert run(False, plain=True)[0][1:] != [want[1], want[2]]  # the penalty and the grammar changed their outputs
    # verifying steps (a row fed drafts) in which the other two rows each decoded a token
    both = [fed for sh, fed in steps if sh.verify and fed[0] > 1 and fed[1] == 1 and fed[2] == 1]
    assert both and m.spec_accepted > 0


def test_drafts_are_fed_only_where_their_step_pays(model_params, solo):
    """With the steps' times known, a row drafts only where its expected output per second beats a plain
    decode: a verifying step 10x a decode's gets no drafts (the row's acceptance is still learnt from the
    drafts it would have fed), a nearly free one gets them (until the steps' measured times take over). The
    output is the same either way."""
    p = _prompts(0, (9,))[0]
    for cost, verifies in ((10.0, False), (1e-6, True)):
        eng = _spec_engine(model_params)
        eng.spec_step_s = {sh: (cost if sh.verify else 1.0) for sh in eng.sched.shapes() if sh.blocks == 0}
        shapes = _record_shapes(eng)
        ev = []
        req = Request(p, SamplingParams(max_tokens=40), ev.append)
        eng.submit(req)
        while not (ev and ev[-1].finish_reason):
            eng.step()
        assert [t for e in ev for t in e.token_ids] == solo(p, 40)
        assert any(sh.verify for sh in shapes) == verifies, cost
        assert req.seq.spec_trials > 0 and req.seq.accept_rate > 0.5  # it cycles: most would be accepted
        assert (eng.metrics.spec_accepted > 0) == verifies


def test_step_times_are_followed_on_one_process_only(model_params):
    """The drafts follow the steps' times, and under jax.distributed every process must draft alike: one
    process follows the times its steps take, a process in step with others (sync) keeps the times it
    started with (process 0's, from warm_up)."""

    class Sync:  # a lone process in step with nobody: what k2jax.serving.multihost.StepSync answers
        stopped = False

        def __call__(self, new, cancels):
            return new, cancels

    p = _prompts(0, (9,))[0]
    for sync in (None, Sync()):
        eng = _spec_engine(model_params, sync=sync)
        start = {sh: 1.0 for sh in eng.sched.shapes() if sh.blocks == 0}
        eng.spec_step_s = dict(start)
        _run(eng, [p], n=12)
        assert (eng.spec_step_s == start) == (sync is not None), sync


def test_speculation_overlaps_the_steps_where_no_row_drafts(model_params, solo):
    """With speculative decoding, a step where no row drafts is still sent before the step before's tokens
    are read (overlap), its row's token fed from the device. Once the row's lookup finds drafts (in its tokens
    known: the last one is not read yet), its tokens are read first, its drafts verified in a step read at
    once, and overlap resumes when the drafts stop. The output is generate's."""
    from k2jax.runtime.layout import FROM_LAST

    p, n = _prompts(9, (6,))[0], 24
    want = solo(p, n)
    eng = _spec_engine(model_params)
    # the row's own continuation, but only while its output is 8 to 13 tokens long
    eng.proposer = _Scripted(lambda toks: want[len(toks) - len(p):] if 8 <= len(toks) - len(p) < 14 else [])
    log = []
    step, emit = eng.runner.step, eng._emit
    eng.runner.step = lambda shape, batch: log.append(("send", shape.verify, batch.tokens[batch.valid].tolist())) \
        or step(shape, batch)
    eng._emit = lambda call, out: log.append(("read",)) or emit(call, out)
    got, _ = _run(eng, [p], n=n)
    assert got[0] == want
    verify = [i for i, e in enumerate(log) if e[0] == "send" and e[1]]
    assert verify and eng.metrics.spec_accepted > 0
    for i in verify:  # read before anything else is sent; the drafting row's tokens all known
        assert log[i + 1] == ("read",) and FROM_LAST not in log[i][2]
    overlapped = [i for i, e in enumerate(log) if e[0] == "send" and e[2] == [FROM_LAST]]
    assert min(overlapped) < verify[0] and max(overlapped) > verify[-1]
    def in_flight(i):  # steps sent and not read when log[i] is sent
        return sum(e[0] == "send" for e in log[:i]) - sum(e[0] == "read" for e in log[:i])

    assert {in_flight(i) for i in overlapped} == {1} and {in_flight(i) for i in verify} == {0}


def test_decode_and_verifying_steps_are_timed_on_real_tokens_written_to_the_trash_page(model_params, solo):
    """warm_up times each decode-only and verifying step on rows that feed real tokens, as serving fills them
    (a padding token reads no routed expert, so padding alone would time a step as if its rows chose none):
    one token per decoding row, or a row's token and its drafts, 1 + num_speculative_tokens each. They write
    only into the trash page, and a request served afterwards gets its usual tokens."""
    from k2jax.runtime.layout import TRASH_PAGE

    eng = _spec_engine(model_params)  # 3 drafts: rows of up to 4 tokens
    before = jax.tree.map(np.asarray, eng.runner.state["pages"])
    fed = []
    step = eng.runner.step
    eng.runner.step = lambda shape, batch: fed.append((shape, batch.count.copy(), batch.valid.copy())) or step(
        shape, batch)
    eng.warm_up()
    timed = {shape: (count, valid) for shape, count, valid in fed if shape.blocks == 0 and not shape.spread}
    assert {sh.verify for sh in timed} == {False, True} and timed.keys() == eng.spec_step_s.keys()
    for shape, (count, valid) in timed.items():
        each = 4 if shape.verify else 1
        want = [min(each, shape.decode - r * each) for r in range(-(-shape.decode // each))]
        assert count[:len(want)].tolist() == want and not count[len(want):].any(), shape
        assert valid.sum() == shape.decode, shape
    for g, pages in eng.runner.state["pages"].items():
        keep = np.arange(pages.shape[1]) != TRASH_PAGE
        np.testing.assert_array_equal(np.asarray(pages)[:, keep], before[g][:, keep], err_msg=g)
        assert (np.asarray(pages)[:, TRASH_PAGE] != before[g][:, TRASH_PAGE]).any(), g
    p = _prompts(0, (9,))[0]
    got, _ = _run(eng, [p], n=20)
    assert got[0] == solo(p, 20)


def test_speculation_on_a_mesh_keeps_the_greedy_tokens(model_params, solo):
    """On a mesh of 8 data-parallel shards a verifying step has one segment per shard (each its rows' tokens
    and drafts): the same greedy tokens as one device without speculation, and drafts accepted."""
    model, params = model_params
    mesh = k2jax.make_mesh("data=2,expert=4")
    sharded = jax.device_put(params, k2jax.param_shardings(CFG, mesh, warn=False))
    eng = Engine(model, sharded, mesh=mesh, max_batch=4, max_len=64, prefill_chunk=16, page_size=PAGE,
                 kv_tokens=8 * 256, speculative="ngram", num_speculative_tokens=3, prompt_lookup=(1, 3))
    shapes = _record_shapes(eng)
    prompts = _prompts(0, (5, 9, 3, 12))
    prompts[0] = prompts[0] * 3
    n = 40
    with k2jax.use_mesh(mesh):
        got, _ = _run(eng, prompts, n=n)
    for i, p in enumerate(prompts):
        assert got[i] == solo(p, n), i
    assert any(sh.verify for sh in shapes) and {sh.shards for sh in shapes} == {8}
    assert 0 < eng.metrics.spec_accepted <= eng.metrics.spec_drafted


def test_speculation_needs_ragged_steps_and_a_sane_draft_count(model_params):
    with pytest.raises(ValueError, match="needs ragged steps"):
        _engine(model_params, ragged=False, speculative="ngram", num_speculative_tokens=3)
    with pytest.raises(ValueError, match="num_speculative_tokens must be in"):
        _engine(model_params, speculative="ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="'eagle' is not known"):
        _engine(model_params, speculative="eagle", num_speculative_tokens=3)
    eng = _engine(model_params, max_batch=8, speculative="ngram", num_speculative_tokens=4)
    assert eng.sched.verify_sizes == [2, 4, 8, 16, 32, 40] and "6 verifying sizes up to 40" in eng.programs_cause()


def test_generate_takes_speculative_decoding(model_params):
    """k2jax.generate(speculative="ngram"): the same greedy tokens and lengths as without, drafts accepted."""
    model, params = model_params
    prompts = _prompts(0, (5, 9, 3, 12))
    prompts[0] = prompts[0] * 3
    want = k2jax.generate(model, params, prompts, 40, max_len=64, stop_tokens=[7])
    t = {}
    got = k2jax.generate(model, params, prompts, 40, max_len=64, stop_tokens=[7], speculative="ngram",
                         num_speculative_tokens=3, timings=t)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    assert 0 < t["accepted"] <= t["drafted"] and t["steps"] <= 40
    # on a mesh of 8 data-parallel shards (the 4 prompts in 8 slots): the same tokens
    mesh = k2jax.make_mesh("data=2,expert=4")
    t = {}
    got = k2jax.generate(model, params, prompts, 40, max_len=64, stop_tokens=[7], speculative="ngram",
                         num_speculative_tokens=3, timings=t, mesh=mesh)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    assert 0 < t["accepted"] <= t["drafted"]


def test_overlap_sends_each_step_before_reading_the_one_before_and_feeds_its_tokens_on_the_device(
        model_params, solo):
    """With overlap (the default) each ragged step is sent before the step before's tokens are read, and a
    decoding row's token is fed as FROM_LAST (taken from the device), never by the host. The outputs are
    generate's, each prompt alone, and the engine without overlap feeds the real tokens and reads each step's
    tokens before sending the next."""
    from k2jax.runtime.layout import FROM_LAST

    prompts = _prompts(21, (5, 12, 23))

    def run(overlap):
        eng = _engine(model_params, overlap=overlap)
        log = []
        step, emit = eng.runner.step, eng._emit
        eng.runner.step = lambda shape, batch: log.append(("send", batch.tokens[batch.valid].tolist())) or step(
            shape, batch)
        eng._emit = lambda call, out: log.append(("read",)) or emit(call, out)
        got, _ = _run(eng, prompts)
        return got, log

    for overlap in (True, False):
        got, log = run(overlap)
        assert got == [solo(p) for p in prompts], overlap
        sends = [e[1] for e in log if e[0] == "send"]
        fed_last = sum(t == FROM_LAST for s in sends for t in s)
        if overlap:
            # every read but the last comes after the next step is sent
            assert [e[0] for e in log[:2]] == ["send", "send"]
            assert all(log[i - 1][0] == "send" for i in range(1, len(log) - 1) if log[i][0] == "read")
            # each decoding row's token: N - 1 per request (the first comes from its prompt's last chunk)
            assert fed_last == len(prompts) * (N - 1)
        else:
            assert [e[0] for e in log] == ["send", "read"] * (len(log) // 2)
            assert fed_last == 0


def test_overlap_changes_no_output(model_params, solo):
    """Sampled, penalised, stopped, one-token and prompt-scoring requests, with preemption in a small pool:
    the same tokens, finish reasons and scores with and without overlap. A row stopped by its step's token
    was fed once more for nothing: that output is dropped, and every page comes back."""
    prompts = _prompts(22, (30, 25, 9, 17, 33, 6))
    stop_at = solo(prompts[2], 12)[4]  # its 5th greedy token stops it
    params = [dict(temperature=0.9, seed=5), dict(frequency_penalty=0.7, presence_penalty=0.3),
              dict(stop_ids=(stop_at,)), dict(max_tokens=1), dict(temperature=1.0, top_k=5, seed=9),
              dict(max_tokens=0, prompt_logprobs=2)]

    def run(overlap):
        eng = _engine(model_params, kv_tokens=12 * PAGE, prefix_cache=False, overlap=overlap)
        events = {i: [] for i in range(len(prompts))}
        eng.submit(*[Request(list(p), SamplingParams(**({"max_tokens": 12} | kw)), events[i].append)
                     for i, (p, kw) in enumerate(zip(prompts, params))])
        while any(not (e and e[-1].finish_reason) for e in events.values()):
            eng.step()
        eng.step()  # anything still sent is read
        assert eng.pool.in_use_count() == 0 and not eng.busy()
        out = [([t for e in ev for t in e.token_ids], ev[-1].finish_reason,
                 [x for e in ev for x in (e.prompt_logprobs or [])]) for ev in events.values()]
        return out, eng.sched.preemptions

    (on, pre_on), (off, pre_off) = run(True), run(False)
    assert pre_on > 0 and pre_off > 0
    assert [o[:2] for o in on] == [o[:2] for o in off]
    # the scores: the same ids; their values up to float32 rounding (the steps batch the rows differently)
    for a, b in zip(on[5][2], off[5][2]):
        assert a["token_id"] == b["token_id"] and [t for t, _ in a["top"]] == [t for t, _ in b["top"]]
        np.testing.assert_allclose([a["logprob"], *(v for _, v in a["top"])],
                                   [b["logprob"], *(v for _, v in b["top"])], atol=1e-4)
    assert on[2][0] == solo(prompts[2], 12)[:5] and on[2][1] == "stop"
    assert len(on[3][0]) == 1 and on[3][1] == "length"
    assert on[5][0] == [] and len(on[5][2]) == len(prompts[5]) - 1


@pytest.fixture(scope="module")
def demo_vocab():
    """The tiny model over the demo tokenizer's vocabulary, and a grammar compiler for it: (tokenizer, model,
    params, grammars)."""
    from k2jax.serving.grammar import GrammarCompiler, GrammarTokenizer
    from k2jax.synthetic import demo_tokenizer

    tok = demo_tokenizer()
    cfg = CFG.replace(vocab_size=tok.vocab_size)
    return (tok, k2jax.K2Model(cfg, jnp.float32), random_params(cfg, jnp.float32, seed=4),
            GrammarCompiler(GrammarTokenizer(tok, cfg.vocab_size)))


def test_overlap_stays_on_beside_grammar_rows_and_their_masks_follow_the_tokens_read(demo_vocab):
    """Rows with a grammar (JSON, greedy and sampled) beside plain rows: with overlap every row's token is
    still fed from the device, and a step where a grammar row samples is sent as its model pass alone, its
    masks made after the step before's tokens are read (Runner.send, then Runner.sample). The tokens equal
    the rectangular steps', whose masks are made before the step is sent, and the grammar rows' outputs are
    JSON prefixes the independent decoder reads to the end once they finish."""
    import json

    from k2jax.runtime.layout import FROM_LAST

    tok, model, params, grammars = demo_vocab
    cfg = model.cfg
    rng = np.random.default_rng(23)
    prompts = [rng.integers(2, cfg.vocab_size, n).tolist() for n in (7, 19, 11, 4)]
    json_object = {"response_format": {"type": "json_object"}}
    params_of = [dict(max_tokens=30, grammar=json_object), dict(max_tokens=12),
                 dict(max_tokens=30, grammar=json_object, temperature=1.0, seed=3), dict(max_tokens=16)]

    def run(**kw):
        eng = Engine(model, params, grammars=grammars, max_batch=4, max_len=64, prefill_chunk=16, page_size=PAGE,
                     kv_tokens=4096, **kw)
        log = []
        step, send, sample = eng.runner.step, eng.runner.send, eng.runner.sample
        eng.runner.step = lambda shape, b: log.append(("step",)) or step(shape, b)
        eng.runner.send = lambda shape, b: log.append(("send", b.tokens[b.valid].tolist())) or send(shape, b)
        eng.runner.sample = lambda sent, mask: log.append(("sample", eng._pending == [])) or sample(sent, mask)
        events = {i: [] for i in range(len(prompts))}
        eng.submit(*[Request(list(p), SamplingParams(**kw), events[i].append)
                     for i, (p, kw) in enumerate(zip(prompts, params_of))])
        while any(not (e and e[-1].finish_reason) for e in events.values()):
            eng.step()
        eng.step()
        assert eng.pool.in_use_count() == 0 and not eng.busy()
        return [([t for e in ev for t in e.token_ids], ev[-1].finish_reason) for ev in events.values()], log

    want, _ = run(ragged=False)
    got, log = run()
    assert got == want
    sends = [e[1] for e in log if e[0] == "send"]
    assert len(sends) >= 20 and not [e for e in log if e[0] == "step"]  # a grammar row sampled in every step
    # each sampler runs after the step before's tokens were read
    assert [e[1] for e in log if e[0] == "sample"] == [True] * len(sends)
    # with grammar rows live, every decoding row's token came from the device: a step fed all four so
    assert max(sum(t == FROM_LAST for t in s) for s in sends) == 4
    for ids, finish in (got[0], got[2]):
        text = tok.decode(ids)
        if finish == "stop":
            assert isinstance(json.JSONDecoder().raw_decode(text.lstrip())[0], dict), text
        else:
            assert finish == "length" and len(ids) == 30 and text.lstrip().startswith("{"), text
    assert got[0][0] != got[2][0] and all(len(g[0]) > 0 for g in got)


def test_a_ragged_steps_pass_then_sampler_equals_the_whole_step(model_params):
    """The runtime runs a plain ragged step as two programs, the model's pass (Runner.send) and the sampler
    (Runner.sample, its grammar mask given only then); the whole step is one program (`lower(whole=True)`,
    what the TPU compile measures). A sampled row under a mask and a greedy one: the same tokens, logprobs,
    pages and last tokens."""
    from k2jax.runtime.layout import Feed, lay_out
    from k2jax.runtime.runner import ragged_host_batch

    eng = _engine(model_params)
    runner, V = eng.runner, CFG.vocab_size
    shape = next(s for s in eng.sched.shapes() if s.blocks and s.decode and not s.verify and not s.spread)
    runner.compile([shape])
    runner.set_sampling({0: eng._row_settings(SamplingParams(temperature=1.0, seed=3, logprobs=3)),
                         1: eng._row_settings(SamplingParams(logprobs=2))})
    batch = ragged_host_batch(shape, V)
    for k, v in lay_out(shape, {0: Feed(tuple(range(40, 45)), 0, (1,)), 1: Feed((7,), 0, (2,))}).items():
        getattr(batch, k)[...] = v
    batch.prompt_len[:2] = (5, 1)
    batch.reset[:2] = True
    mask = np.full_like(batch.bitmask, -1)
    mask[0] = np.random.default_rng(1).integers(-2**31, 2**31, mask.shape[1], dtype=np.int64).astype(np.int32)
    whole = runner.lower(shape, whole=True).compile()
    state, want = whole(runner._params_for(shape), jax.tree.map(jnp.copy, runner.state),
                        dataclasses.replace(batch, bitmask=mask))
    got = runner.sample(runner.send(shape, batch), mask)
    np.testing.assert_array_equal(got["tokens"], want["tokens"])
    allowed = np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:V]
    assert allowed[int(got["tokens"][0])] and not allowed.all()
    for k in ("logprob", "top_logprobs", "prompt_logprob"):
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(runner.state["last"], state["last"])
    np.testing.assert_array_equal(runner.state["last"][:2], got["tokens"][:2])
    for a, b in zip(jax.tree.leaves(runner.state["pages"]), jax.tree.leaves(state["pages"])):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_a_failed_step_ends_every_request_and_refuses_new_ones(model_params):
    """A step that raises stops the engine thread: the running and the waiting requests end with "abort",
    on_fail is told why, and submit raises EngineStopped from then on."""
    from k2jax.runtime.requests import EngineStopped

    eng = _engine(model_params, max_batch=1)
    told = []
    eng.on_fail = told.append

    def broken(*_):
        raise RuntimeError("device lost")

    eng.runner.step = eng.runner.send = broken
    events = {i: [] for i in range(3)}
    eng.submit(*[Request(p, SamplingParams(max_tokens=4), events[i].append)
                 for i, p in enumerate(_prompts(5, (3, 4, 5)))])
    thread = threading.Thread(target=eng.run)
    thread.start()
    thread.join(60)
    assert not thread.is_alive()
    assert [[e.finish_reason for e in ev] for ev in events.values()] == [["abort"]] * 3
    assert told == ["RuntimeError: device lost"] and eng.failed == told[0]
    with pytest.raises(EngineStopped, match="device lost"):
        eng.submit(Request([5], SamplingParams(max_tokens=2), lambda e: None))
