"""k2jax.runtime.sampling against a plain numpy reference written here (loops over rows): each transform
alone and together, exact penalties, min_tokens, bitmask, greedy, logprobs and top logprobs, draw
frequencies, reproducible keys, mixed batches == rows alone, no recompilation, the full vocabulary size."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k2jax.runtime import sampling
from k2jax.runtime.sampling import (MAX_LOGIT_BIAS, MAX_STOP_IDS, MAX_TOP_LOGPROBS, default_rows, mark_prompt,
                                      process_logits, sample_rows, selected_cutoff, set_row, sorted_cutoff,
                                      update_counts)
from k2jax.runtime import compiles

SAMPLE = jax.jit(sample_rows)
PROCESS = jax.jit(process_logits)


# ---- the numpy reference: one row at a time, straight from the definitions ----

def ref_processed(logits_V, s, counts_V, prompt_V, words_W=None):
    """Processed float32 logits of one row with settings `s` (set_row's keyword arguments)."""
    x = logits_V.astype(np.float32).copy()
    V = x.shape[0]
    for t, b in dict(s.get("logit_bias", {})).items():
        x[t] += np.float32(b)
    if s.get("step", 0) < s.get("min_tokens", 0):
        for t in s.get("stop_ids", ()):
            x[t] = -np.inf
    if words_W is not None:
        for v in range(V):
            if not (int(words_W[v // 32]) >> (v % 32)) & 1:
                x[v] = -np.inf
    r = np.float32(s.get("repetition_penalty", 1.0))
    for v in range(V):
        if prompt_V[v] or counts_V[v] > 0:
            x[v] = x[v] / r if x[v] > 0 else x[v] * r
    freq, pres = np.float32(s.get("frequency_penalty", 0.0)), np.float32(s.get("presence_penalty", 0.0))
    return x - (freq * counts_V.astype(np.float32) + pres * (counts_V > 0))


def ref_log_softmax(x, temperature):
    z = x.astype(np.float64) / (temperature if temperature > 0 else 1.0)
    m = z.max()
    return z - (m + np.log(np.exp(z - m).sum()))


def ref_distribution(x, s):
    """The probabilities a sampling row draws from: softmax(x / t), cut by top_k, top_p, min_p (vLLM's
    definitions), renormalised. float64 [V]."""
    z = x.astype(np.float64) / s["temperature"]
    p = np.exp(z - z.max())
    p /= p.sum()
    keep = np.ones(len(z), bool)
    k = s.get("top_k", 0)
    if 0 < k < len(z):
        keep &= z >= np.sort(z)[::-1][k - 1]
    top_p = s.get("top_p", 1.0)
    if top_p < 1:
        q = np.where(keep, p, 0.0)
        q /= q.sum()
        order = np.argsort(-z, kind="stable")
        before = np.cumsum(q[order]) - q[order]
        kept_sorted = (before < top_p) & keep[order]
        assert np.min(np.abs(before[keep[order]] - top_p)) > 1e-4, "a top_p boundary too close to call"
        keep &= z >= z[order][kept_sorted].min()
    if s.get("min_p", 0.0) > 0:
        keep &= p >= s["min_p"] * p.max()
    out = np.where(keep, p, 0.0)
    return out / out.sum()


def rows_for(settings, **common):
    rows = default_rows(len(settings))
    for i, s in enumerate(settings):
        set_row(rows, i, **{**common, **s})
    return rows


def history(B, V, seed=0):
    """Random output counts and prompt masks."""
    rng = np.random.RandomState(seed)
    counts = (rng.rand(B, V) < 0.1) * rng.randint(1, 4, (B, V))
    return counts.astype(np.int32), rng.rand(B, V) < 0.1


# ---- settings ----

def test_default_rows_and_set_row():
    rows = default_rows(3)
    assert rows["stop_ids"].shape == (3, MAX_STOP_IDS) and rows["bias_ids"].shape == (3, MAX_LOGIT_BIAS)
    assert rows["seed"].dtype == np.uint32 and rows["temperature"].dtype == np.float32
    assert (rows["n_top"] == MAX_TOP_LOGPROBS).all() and (rows["repetition"] == 1).all()
    set_row(rows, 1, temperature=0.5, top_k=-1, seed=-1, stop_ids=[7, 8], logit_bias={5: -100, 6: 2.5},
            min_tokens=4, step=2)
    assert rows["top_k"][1] == 0 and rows["seed"][1] == 2**32 - 1 and rows["temperature"][1] == 0.5
    assert list(rows["stop_ids"][1, :3]) == [7, 8, -1] and list(rows["bias_ids"][1, :3]) == [5, 6, -1]
    assert list(rows["bias_vals"][1, :2]) == [-100, 2.5]
    set_row(rows, 1)  # every field of the row is rewritten: back to the defaults
    for k, v in default_rows(3).items():
        np.testing.assert_array_equal(rows[k][1], v[1], err_msg=k)


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.1), "temperature"), (dict(top_k=-2), "top_k"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"), (dict(min_p=1.1), "min_p"), (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(min_tokens=-1), "min_tokens"), (dict(step=-1), "step"), (dict(top_logprobs=21), "top_logprobs"),
    (dict(stop_ids=range(MAX_STOP_IDS + 1)), "stop_ids"), (dict(stop_ids=[-3]), "stop_ids"),
    (dict(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}), "logit_bias"),
    (dict(logit_bias=[(3, 1.0), (3, 2.0)]), "logit_bias"), (dict(logit_bias={3: 101.0}), "logit_bias"),
    (dict(logit_bias={50: 1.0}, vocab_size=50), "logit_bias"), (dict(seed=1.5), "seed"),
])
def test_set_row_rejects_bad_settings(kwargs, field):
    with pytest.raises(ValueError, match=field):
        set_row(default_rows(2), 0, **kwargs)


# ---- the transforms ----

def test_penalties_give_the_exact_adjusted_logits():
    logits = np.array([[2.0, -1.0, 0.5, -3.0, 1.0, 4.0]], np.float32)
    counts = np.array([[2, 0, 1, 0, 0, 0]], np.int32)  # output so far: id 0 twice, id 2 once
    prompt = np.array([[False, True, False, False, False, True]])  # ids 1 and 5 in the prompt
    rows = rows_for([dict(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)])
    got = np.asarray(PROCESS(logits, rows, counts, prompt))
    # id 0: 2/2 - 0.5*2 - 0.25; id 1: -1*2; id 2: 0.5/2 - 0.5 - 0.25; id 3, 4 unseen; id 5: 4/2 (prompt only)
    np.testing.assert_array_equal(got, [[1.0 - 1.0 - 0.25, -2.0, 0.25 - 0.75, -3.0, 1.0, 2.0]])


@pytest.mark.parametrize("name, settings, use_mask", [
    ("bias", dict(logit_bias={3: 5.0, 17: -100.0, 290: 0.5}), False),
    ("min_tokens", dict(min_tokens=3, step=1, stop_ids=[4, 9]), False),
    ("min_tokens ended", dict(min_tokens=3, step=3, stop_ids=[4, 9]), False),
    ("bitmask", dict(), True),
    ("repetition", dict(repetition_penalty=1.7), False),
    ("frequency", dict(frequency_penalty=0.8), False),
    ("presence", dict(presence_penalty=-1.2), False),
    ("all", dict(logit_bias={3: 5.0, 11: -2.0}, min_tokens=5, step=2, stop_ids=[4], repetition_penalty=1.3,
                 frequency_penalty=0.4, presence_penalty=0.6), True),
])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_transforms_match_the_reference(name, settings, use_mask, temperature):
    B, V = 4, 300  # V not a multiple of 32: the bitmask's last word is part padding
    rng = np.random.RandomState(1)
    logits = (rng.randn(B, V) * 3).astype(np.float32)
    counts, prompt = history(B, V)
    words = rng.randint(-2**31, 2**31 - 1, (B, -(-V // 32)), dtype=np.int64).astype(np.int32) if use_mask else None
    s = dict(settings, temperature=temperature, seed=3)
    rows = rows_for([s] * B)
    got = np.asarray(PROCESS(logits, rows, counts, prompt, words))
    out = jax.tree.map(np.asarray, SAMPLE(logits, rows, counts, prompt, words))
    for b in range(B):
        want = ref_processed(logits[b], s, counts[b], prompt[b], None if words is None else words[b])
        np.testing.assert_allclose(got[b], want, rtol=1e-6, atol=1e-6, err_msg=f"{name}, row {b}")
        lp = ref_log_softmax(want, temperature)
        tok = out["tokens"][b]
        assert np.isfinite(want[tok]), f"{name}: drew an excluded id"
        if temperature == 0:
            assert tok == np.argmax(want)
        np.testing.assert_allclose(out["logprob"][b], lp[tok], atol=1e-5)
        order = np.argsort(-lp, kind="stable")[:MAX_TOP_LOGPROBS]
        np.testing.assert_array_equal(out["top_ids"][b], order)
        np.testing.assert_allclose(out["top_logprobs"][b], lp[order], atol=1e-5)
    assert not out["all_masked"].any()


def test_min_tokens_suppresses_stop_ids_until_the_step():
    V = 50
    logits = np.tile(np.linspace(0, 1, V, dtype=np.float32), (6, 1))  # id 49 is the best, 48 next
    rows = rows_for([dict(min_tokens=3, step=t, stop_ids=[49, 2]) for t in range(6)])
    tokens = np.asarray(SAMPLE(logits, rows)["tokens"])
    np.testing.assert_array_equal(tokens, [48, 48, 48, 49, 49, 49])


def test_a_row_with_every_id_masked_is_defined():
    B, V = 3, 100
    logits = np.random.RandomState(2).randn(B, V).astype(np.float32)
    words = np.full((B, 4), -1, np.int32)
    words[0] = 0  # row 0: the grammar allows nothing
    rows = rows_for([dict(temperature=1.0, top_p=0.5), dict(), dict(temperature=1.0)])
    for r in (rows, rows_for([dict(), dict(), dict()])):  # a sampling batch and a greedy one
        out = jax.tree.map(np.asarray, SAMPLE(logits, r, None, None, words))
        assert out["tokens"][0] == 0 and out["logprob"][0] == -np.inf and out["all_masked"].tolist() == [1, 0, 0]
        assert not np.isnan(out["top_logprobs"]).any() and not np.isnan(out["logprob"]).any()
        assert np.isfinite(out["logprob"][1:]).all()


def test_top_logprobs_are_cut_to_the_rows_count():
    logits = np.random.RandomState(3).randn(3, 80).astype(np.float32)
    rows = rows_for([dict(top_logprobs=3), dict(top_logprobs=0), dict()])
    out = jax.tree.map(np.asarray, SAMPLE(logits, rows))
    lp = ref_log_softmax(logits[0], 0)
    np.testing.assert_array_equal(out["top_ids"][0, :3], np.argsort(-lp)[:3])
    assert (out["top_ids"][0, 3:] == -1).all() and (out["top_logprobs"][0, 3:] == -np.inf).all()
    assert (out["top_ids"][1] == -1).all() and (out["top_ids"][2] >= 0).all()
    # no row wants any: the selection is skipped, the tokens stay the same
    none = rows_for([dict(top_logprobs=0)] * 3)
    out2 = jax.tree.map(np.asarray, SAMPLE(logits, none))
    assert (out2["top_ids"] == -1).all()
    np.testing.assert_array_equal(out2["tokens"], out["tokens"])
    np.testing.assert_allclose(out2["logprob"], out["logprob"], atol=1e-6)


# ---- draws ----

DRAW_V = 100
CONFIGS = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=4),
    dict(temperature=1.0, top_p=0.8),  # settled by the 64 best ids
    dict(temperature=1.0, min_p=0.15),
    dict(temperature=1.3, top_k=6, top_p=0.9, min_p=0.05),
    dict(temperature=1.0, top_k=80),  # above TOP_K_SELECT: sorted
    dict(temperature=8.0, top_p=0.9),  # flat: the 64 best hold < 0.9, sorted
]


@pytest.mark.parametrize("config", CONFIGS, ids=[str(c) for c in CONFIGS])
def test_draw_frequencies_match_the_truncated_distribution(config):
    N = 4000  # rows: one seed each
    x = (np.random.RandomState(4).randn(DRAW_V) * 2.5).astype(np.float32)
    want = ref_distribution(x, config)
    rows = rows_for([dict(config, seed=i) for i in range(N)], step=7)
    tokens = np.asarray(SAMPLE(np.tile(x, (N, 1)), rows)["tokens"])
    freq = np.bincount(tokens, minlength=DRAW_V) / N
    assert (freq[want == 0] == 0).all(), f"drew excluded ids {np.flatnonzero((freq > 0) & (want == 0))}"
    tol = 5 * np.sqrt(want * (1 - want) / N) + 2e-3
    bad = np.flatnonzero(np.abs(freq - want) > tol)
    assert bad.size == 0, f"ids {bad}: frequencies {freq[bad]} vs probabilities {want[bad]}"
    assert (want > 0).sum() > 1  # the test can see a filter that keeps too few


def test_same_seed_and_step_same_token_other_seeds_differ():
    x = np.zeros((1, DRAW_V), np.float32)  # uniform: the key alone decides
    rows = rows_for([dict(temperature=1.0, seed=5, step=2)] * 3 + [dict(temperature=1.0, seed=s, step=2)
                                                                   for s in range(6, 38)])
    tokens = np.asarray(SAMPLE(np.tile(x, (35, 1)), rows)["tokens"])
    assert tokens[0] == tokens[1] == tokens[2]
    assert len(set(tokens[3:].tolist())) > 15, "different seeds draw (nearly) the same tokens"
    steps = rows_for([dict(temperature=1.0, seed=5, step=t) for t in range(35)])
    assert len(set(np.asarray(SAMPLE(np.tile(x, (35, 1)), steps)["tokens"]).tolist())) > 15


def test_mixed_rows_equal_each_row_alone():
    V = 120
    rng = np.random.RandomState(5)
    settings = [
        dict(),
        dict(repetition_penalty=1.5, presence_penalty=0.5),
        dict(temperature=0.9, seed=1, top_k=5),
        dict(temperature=1.1, seed=2, top_p=0.7, frequency_penalty=1.0),
        dict(temperature=6.0, seed=3, top_p=0.95),  # forces the sort for the whole batch
        dict(temperature=0.6, seed=4, min_p=0.1, logit_bias={7: 8.0}),
        dict(min_tokens=9, step=2, stop_ids=[0, 1, 2], top_logprobs=5),
        dict(temperature=1.0, seed=9, top_k=70, step=11),
    ]
    B = len(settings)
    logits = (rng.randn(B, V) * 2).astype(np.float32)
    counts, prompt = history(B, V, seed=6)
    words = np.full((B, 4), -1, np.int32)
    words[3, 0] = 0x0F0F0F0F
    together = jax.tree.map(np.asarray, SAMPLE(logits, rows_for(settings), counts, prompt, words))
    for b, s in enumerate(settings):
        alone = jax.tree.map(np.asarray, SAMPLE(logits[b:b + 1], rows_for([s]), counts[b:b + 1], prompt[b:b + 1],
                                                words[b:b + 1]))
        for k in ("tokens", "top_ids", "all_masked"):
            np.testing.assert_array_equal(together[k][b], alone[k][0], err_msg=f"row {b}: {k}")
        for k in ("logprob", "top_logprobs"):
            np.testing.assert_allclose(together[k][b], alone[k][0], rtol=1e-6, err_msg=f"row {b}: {k}")


def test_selected_cutoff_equals_the_sort_where_it_settles():
    B, V = 64, 500
    rng = np.random.RandomState(7)
    x = (rng.randn(B, V) * rng.choice([0.3, 2.0, 6.0], (B, 1))).astype(np.float32)
    x[:4, -50:] = -np.inf  # some masked ids
    top_k = rng.choice([0, 1, 5, 64, 65, 300, 500, 600], B).astype(np.int32)
    top_p = rng.choice([1.0, 0.3, 0.9, 0.99], B).astype(np.float32)
    vals, _ = jax.lax.top_k(jnp.asarray(x), 64)
    lse = jax.scipy.special.logsumexp(jnp.asarray(x), axis=-1)
    cut, settled = map(np.asarray, selected_cutoff(vals, lse, top_k, top_p, V))
    plain = np.asarray(sorted_cutoff(jnp.asarray(x), top_k, top_p))
    assert 8 < settled.sum() < B - 8, "both kinds of rows are needed for the test to mean anything"
    keep_fast = x[settled] >= cut[settled][:, None]
    keep_plain = x[settled] >= plain[settled][:, None]
    np.testing.assert_array_equal(keep_fast, keep_plain)
    # the unsettled rows are the ones the selection cannot decide: a top_k over 64, or a flat top_p
    assert ((top_k[~settled] > 64) & (top_k[~settled] < V) | (top_p[~settled] < 1)).all()


# ---- counts and prompt ----

def test_update_counts_and_mark_prompt():
    B, V = 3, 10
    counts = update_counts(jnp.zeros((B, V), jnp.int32), np.array([4, 4, 9]), np.array([True, False, True]))
    counts = update_counts(counts, np.array([4, 1, 9]), np.array([True, True, True]))
    want = np.zeros((B, V), np.int32)
    want[0, 4], want[1, 1], want[2, 9] = 2, 1, 2
    np.testing.assert_array_equal(counts, want)
    tokens = np.array([[3, 3, 7], [0, 5, 6], [2, 2, 2]])
    valid = np.array([[True, True, True], [False, True, True], [True, False, False]])
    mask = np.asarray(mark_prompt(jnp.zeros((B, V), bool), tokens, valid))
    want = np.zeros((B, V), bool)
    for b in range(B):
        for t, ok in zip(tokens[b], valid[b]):
            want[b, t] |= ok
    np.testing.assert_array_equal(mask, want)


# ---- compilation and scale ----

def test_changing_settings_does_not_recompile():
    B, V = 4, 200
    logits = np.random.RandomState(8).randn(B, V).astype(np.float32)
    counts, prompt = history(B, V)
    fn = jax.jit(sample_rows)
    compiles.install()
    start = compiles.count()
    jax.block_until_ready(fn(logits, default_rows(B), counts, prompt))
    before = compiles.count()
    assert before > start
    for s in [dict(temperature=0.5, top_k=3), dict(temperature=2.0, top_p=0.5, seed=9, step=4),
              dict(repetition_penalty=1.2, min_p=0.3, temperature=1.0, logit_bias={1: 3.0}, top_logprobs=2),
              dict(min_tokens=5, stop_ids=[1, 2, 3], frequency_penalty=-1.0, top_k=150, temperature=1.0)]:
        jax.block_until_ready(fn(logits, rows_for([s] * B), counts, prompt))
    assert compiles.count() == before, f"{compiles.count() - before} compilations for new settings"


def test_full_vocabulary_batch_runs_and_its_time():
    B, V = 4, 163840
    flat = np.random.RandomState(9).randn(B, V).astype(np.float32) * 2
    peaked = flat.copy()
    peaked[:, :10] += 25.0  # ten ids hold nearly all the mass: the 64 best settle top_p
    counts, prompt = jnp.zeros((B, V), jnp.int32), jnp.zeros((B, V), bool)
    fn = jax.jit(sample_rows)
    top_p = rows_for([dict(), dict(temperature=1.0, top_p=0.9, seed=1), dict(temperature=0.7, top_k=40), dict()])
    times = {}
    for name, logits, rows in (("greedy", flat, default_rows(B)), ("top_p settled by the 64 best", peaked, top_p),
                               ("top_p with the sort", flat, top_p)):
        logits = jnp.asarray(logits)
        out = jax.block_until_ready(fn(logits, rows, counts, prompt))
        t0 = time.perf_counter()
        for _ in range(3):
            out = jax.block_until_ready(fn(logits, rows, counts, prompt))
        times[name] = (time.perf_counter() - t0) / 3
        tokens = np.asarray(out["tokens"])
        assert ((tokens >= 0) & (tokens < V)).all()
        np.testing.assert_array_equal(tokens[[0, 3]], np.asarray(logits)[[0, 3]].argmax(-1))
    print(f"\nsample_rows B={B} V={V} ({jax.default_backend()}), ms per call: "
          + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in times.items()))


def test_module_constants():
    assert (MAX_TOP_LOGPROBS, MAX_LOGIT_BIAS, MAX_STOP_IDS) == (20, 300, 16)
    assert sampling.TOP_K_SELECT >= MAX_TOP_LOGPROBS


def test_top_values_in_rounds_equal_a_stable_sort():
    rng = np.random.RandomState(10)
    x = rng.randint(0, 40, (5, 300)).astype(np.float32)  # many ties
    x[0, :290] = -np.inf  # fewer finite values than asked for
    vals, ids = map(np.asarray, sampling.top_values(jnp.asarray(x), 50))
    for b in range(5):
        order = np.argsort(-x[b], kind="stable")[:50]
        np.testing.assert_array_equal(vals[b], x[b, order])
        finite = np.isfinite(vals[b])
        np.testing.assert_array_equal(ids[b][finite], order[finite])
