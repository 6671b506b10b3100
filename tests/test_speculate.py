"""Speculative decoding's two pieces: k2jax.runtime.speculate.NgramProposer against a plain double-loop
reference written here (random token lists over a small alphabet, and hand cases), and the draft
verification of k2jax.runtime.sampling.sample_rows against its definition: greedy rows accept exactly the
argmax; sampling rows accept with probability p(draft) and their tokens keep the no-draft distribution
(chi-square against softmax(logits / T), truncated), and a call without drafts equals one with draft -1."""

import jax
import numpy as np
import pytest

from k2jax.runtime import speculate
from k2jax.runtime.sampling import sample_rows
from k2jax.runtime.speculate import NgramProposer
from tests.test_sampling import ref_distribution, rows_for

SAMPLE = jax.jit(sample_rows)


# ---- the n-gram proposer ----

def ref_propose(tokens, k, max_n, min_n, window):
    """Straight from the definition: over the last `window` tokens, for n from max_n down to min_n, the
    latest start i < L - n whose n ids equal the last n ids; the (at most k) ids after it."""
    t = list(tokens)[-window:]
    L = len(t)
    if k <= 0:
        return []
    for n in range(max_n, min_n - 1, -1):
        if n >= L:
            continue
        for i in range(L - n - 1, -1, -1):  # latest first; i = L - n is the suffix itself
            if t[i:i + n] == t[L - n:]:
                return t[i + n:i + n + k]
    return []


@pytest.mark.parametrize("min_n,max_n", [(1, 1), (1, 3), (2, 3), (2, 2), (3, 5)])
def test_ngram_matches_the_reference_on_random_lists(min_n, max_n):
    rng = np.random.RandomState(min_n * 10 + max_n)
    for window in (8192, 12, max_n + 1):
        p = NgramProposer(max_n=max_n, min_n=min_n, window=window)
        for _ in range(400):
            # 4 symbols: short lists repeat often, so matches of every length occur (and misses too)
            tokens = rng.randint(0, 4, size=rng.randint(0, 41)).tolist()
            k = rng.randint(0, 6)
            want = ref_propose(tokens, k, max_n, min_n, window)
            got = p.propose(tokens, k)
            assert got == want, f"tokens={tokens} k={k} window={window}: {got} != {want}"
            assert all(isinstance(t, int) for t in got)


def test_ngram_reference_sees_both_hits_and_misses():
    # the random comparison above is only meaningful if the reference gives both outcomes often
    rng = np.random.RandomState(0)
    outs = [ref_propose(rng.randint(0, 4, size=rng.randint(0, 41)).tolist(), 3, 3, 2, 8192) for _ in range(300)]
    assert 30 < sum(bool(o) for o in outs) < 290


def test_ngram_hand_cases():
    assert NgramProposer().propose([1, 2, 3, 4, 1, 2, 3], 4) == [4, 1, 2, 3]
    assert NgramProposer().propose([1, 2, 3, 4, 1, 2, 3], 2) == [4, 1]
    # the earlier occurrence may overlap the suffix: [5, 5, 5] at 0 is followed by the last 5 only
    assert NgramProposer(max_n=3, min_n=1).propose([5, 5, 5, 5], 3) == [5]
    # the latest earlier occurrence wins
    assert NgramProposer(max_n=2, min_n=2).propose([1, 2, 7, 1, 2, 8, 1, 2], 1) == [8]
    # the longest suffix wins over a later, shorter one
    toks = [1, 2, 3, 5, 9, 2, 3, 6, 1, 2, 3]
    assert NgramProposer(max_n=3, min_n=2).propose(toks, 1) == [5]
    assert NgramProposer(max_n=2, min_n=2).propose(toks, 1) == [6]
    # no match, too short, k <= 0
    assert NgramProposer(max_n=3, min_n=1).propose([1, 2, 3, 4], 3) == []
    assert NgramProposer().propose([1, 2], 3) == []
    assert NgramProposer().propose([], 3) == []
    assert NgramProposer().propose([1, 2, 3, 4, 1, 2, 3], 0) == []
    assert NgramProposer().propose([1, 2, 3, 4, 1, 2, 3], -1) == []
    # numpy input works the same
    assert NgramProposer().propose(np.array([1, 2, 3, 4, 1, 2, 3]), 4) == [4, 1, 2, 3]


def test_ngram_searches_only_the_window():
    toks = [1, 2, 3, 9, 9, 9, 9, 1, 2]
    assert NgramProposer(max_n=2, min_n=2, window=100).propose(toks, 2) == [3, 9]
    assert NgramProposer(max_n=2, min_n=2, window=9).propose(toks, 2) == [3, 9]  # exactly the whole list
    # the only earlier [1, 2] is outside the last 8 tokens
    assert NgramProposer(max_n=2, min_n=2, window=8).propose(toks, 2) == []
    assert NgramProposer(max_n=2, min_n=2, window=5).propose(toks, 2) == []


@pytest.mark.parametrize("min_n,max_n", [(0, 3), (-1, 2), (3, 2), (2, 1)])
def test_ngram_rejects_bad_sizes(min_n, max_n):
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(max_n=max_n, min_n=min_n)


@pytest.mark.parametrize("window", [0, -2, 3])
def test_ngram_rejects_a_window_no_longer_than_max_n(window):
    with pytest.raises(ValueError, match=f"window \\({window} tokens\\)"):
        NgramProposer(max_n=3, min_n=1, window=window)


def test_make():
    assert speculate.make(None) is None
    p = speculate.make("ngram", max_n=4, min_n=1, window=64)
    assert isinstance(p, NgramProposer) and (p.max_n, p.min_n, p.window) == (4, 1, 64)
    assert speculate.make("ngram").propose([1, 2, 3, 4, 1, 2, 3], 4) == [4, 1, 2, 3]
    with pytest.raises(ValueError, match="'eagle'"):
        speculate.make("eagle")
    with pytest.raises(ValueError):
        speculate.make("ngram", min_n=0)


# ---- draft verification in sample_rows ----

LOGITS = np.array([2.0, 1.2, 0.6, 0.1, -0.4, -1.0], np.float32)  # V = 6, every id well represented
V = LOGITS.size
N = 20000  # rows, one seed each: one draw per row
SMALL_B = 60  # the batch of the other tests: one shape, so one compilation each with and without drafts
CHI2_CRIT = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}  # chi-square at p = 0.001, by dof


def ref_probs(logits, temperature, top_k=0):
    """softmax(logits / T), restricted to the top_k best ids and renormalised (test_sampling's reference)."""
    return ref_distribution(logits, {"temperature": temperature, "top_k": top_k})


def chi2(counts, probs):
    """Pearson's statistic over the ids `probs` allows (an observed id outside them is checked apart)."""
    n = counts.sum()
    on = probs > 0
    e = n * probs[on]
    return float(((counts[on] - e) ** 2 / e).sum())


# (name, draft id, temperature, top_k): the likeliest id, an unlikely one, one that top_k excludes, and a
# temperature that is not 1
DRAFT_CASES = [
    ("likeliest", 0, 1.0, 0),
    ("unlikely", 5, 1.0, 0),
    ("excluded_by_top_k", 4, 1.0, 3),
    ("likeliest_T0.7", 0, 0.7, 0),
]


@pytest.mark.parametrize("name,draft,temperature,top_k", DRAFT_CASES, ids=[c[0] for c in DRAFT_CASES])
def test_sampling_rows_keep_the_no_draft_distribution(name, draft, temperature, top_k):
    want = ref_probs(LOGITS, temperature, top_k)
    rows = rows_for([dict(temperature=temperature, top_k=top_k, seed=i) for i in range(N)], step=3)
    out = jax.tree.map(np.asarray, SAMPLE(np.tile(LOGITS, (N, 1)), rows, draft_B=np.full(N, draft, np.int32)))
    tokens, acc = out["tokens"], out["accepted"]
    assert acc.dtype == bool and acc.shape == (N,)
    counts = np.bincount(tokens, minlength=V)
    assert (counts[want == 0] == 0).all(), f"drew ids the truncation excludes: {counts}"

    # the token is distributed as without a draft: rejection sampling against a point mass
    dof = int((want > 0).sum()) - 1
    stat = chi2(counts, want)
    assert stat < CHI2_CRIT[dof], f"chi2 {stat:.1f} >= {CHI2_CRIT[dof]} ({dof} dof): {counts / N} vs {want}"

    # the draft is accepted with probability p(draft), and a rejected draft is never the token (it is
    # removed before the redraw), so accepted <=> token == draft
    p_d = want[draft]
    se = np.sqrt(p_d * (1 - p_d) / N)
    assert abs(acc.mean() - p_d) <= 4 * se, f"acceptance {acc.mean():.4f} vs p(draft) {p_d:.4f}"
    np.testing.assert_array_equal(acc, tokens == draft)
    if p_d == 0:
        assert not acc.any()

    # the test can fail: the statistic against a wrong distribution is far above the critical value
    # (the draft's probability doubled; for an excluded draft, the untruncated softmax)
    if p_d > 0:
        wrong = want.copy()
        wrong[draft] *= 2
        wrong /= wrong.sum()
    else:
        wrong = ref_probs(LOGITS, temperature)
    wrong_dof = int((wrong > 0).sum()) - 1
    assert chi2(counts, wrong) > 5 * CHI2_CRIT[wrong_dof]


def test_draws_with_a_draft_are_reproducible():
    # the same seed and step give the same token and verdict wherever the row sits in the batch
    settings = [dict(temperature=1.0, seed=s, step=9) for s in range(SMALL_B)]
    draft = np.arange(SMALL_B, dtype=np.int32) % V
    logits = np.tile(LOGITS, (SMALL_B, 1))
    a = jax.tree.map(np.asarray, SAMPLE(logits, rows_for(settings), draft_B=draft))
    b = jax.tree.map(np.asarray, SAMPLE(logits, rows_for(settings[::-1]), draft_B=draft[::-1].copy()))
    np.testing.assert_array_equal(a["tokens"], b["tokens"][::-1])
    np.testing.assert_array_equal(a["accepted"], b["accepted"][::-1])
    assert a["accepted"].any() and not a["accepted"].all()


def greedy_case(mixed):
    """Random logits (distinct per row), drafts: the argmax, another id, or -1, in turn; `mixed` adds a
    sampling row, which sends the batch through the draw branch (greedy rows are then decided there)."""
    B = SMALL_B
    rng = np.random.RandomState(7)
    logits = rng.randn(B, V).astype(np.float32) * 2
    best = logits.argmax(-1)
    draft = np.where(np.arange(B) % 3 == 0, best, np.where(np.arange(B) % 3 == 1, (best + 1 + rng.randint(
        0, V - 1, size=B)) % V, -1)).astype(np.int32)
    settings = [dict() for _ in range(B)]
    if mixed:
        settings[-1] = dict(temperature=1.0, seed=3)
    return logits, best, draft, rows_for(settings)


@pytest.mark.parametrize("mixed", [False, True], ids=["all_greedy", "with_a_sampling_row"])
def test_greedy_rows_accept_exactly_the_argmax(mixed):
    logits, best, draft, rows = greedy_case(mixed)
    out = jax.tree.map(np.asarray, SAMPLE(logits, rows, draft_B=draft))
    g = slice(0, len(best) - 1) if mixed else slice(None)  # the greedy rows
    np.testing.assert_array_equal(out["tokens"][g], best[g])  # the argmax whatever the draft
    np.testing.assert_array_equal(out["accepted"][g], (draft == best)[g])
    assert not out["accepted"][g][draft[g] == -1].any()
    assert out["accepted"][g].any() and not out["accepted"][g].all()  # both verdicts occur


def test_a_sampling_row_that_keeps_one_id():
    # top_k = 1: p(argmax) = 1, so the argmax draft is always accepted and any other never (no redraw of an
    # empty distribution)
    B = SMALL_B
    rows = rows_for([dict(temperature=1.0, top_k=1, seed=s) for s in range(B)])
    draft = np.where(np.arange(B) % 2 == 0, 0, 3).astype(np.int32)
    out = jax.tree.map(np.asarray, SAMPLE(np.tile(LOGITS, (B, 1)), rows, draft_B=draft))
    assert (out["tokens"] == 0).all()
    np.testing.assert_array_equal(out["accepted"], draft == 0)


def test_no_draft_equals_draft_minus_one():
    B = SMALL_B
    rng = np.random.RandomState(11)
    logits = (rng.randn(B, V) * 2).astype(np.float32)
    kinds = [dict(temperature=1.0), dict(temperature=0.7, top_k=4), dict(temperature=1.2, top_p=0.8),
             dict(temperature=1.0, min_p=0.1), dict()]  # the last greedy
    rows = rows_for([dict(kinds[i % len(kinds)], seed=i, step=i % 7) for i in range(B)])
    plain = jax.tree.map(np.asarray, SAMPLE(logits, rows))
    assert "accepted" not in plain
    none = jax.tree.map(np.asarray, SAMPLE(logits, rows, draft_B=np.full(B, -1, np.int32)))
    assert set(none) == set(plain) | {"accepted"}
    assert not none["accepted"].any()
    for k in plain:
        np.testing.assert_array_equal(none[k], plain[k], err_msg=k)
    # the rows did sample: many tokens are not their row's argmax
    assert (plain["tokens"] != logits.argmax(-1)).sum() > 10
