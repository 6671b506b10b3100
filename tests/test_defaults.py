"""The paths a user takes by default, which the feature tests (always passing a mask, a stop token or a
setting) would not reach: sampling with no top_k / top_p, the explicit "no cut" values top_k = V and
top_p = 1, and generate with no stop tokens. (Convert with no --layers and load with no dtype are the
default calls of tests/test_convert.py::test_equals_load_hf_bit_exact.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k2jax import K2Config, K2Model, generate
from k2jax.runtime.sampling import default_rows, sample_rows, set_row, sorted_cutoff
from k2jax.testing import random_params
from tests.conftest import CONFIGS

V = 1000


def _spread_logits():
    """One row spread over 30 nats, one dominated by a single id: tails of tiny probability, which float32's
    running mass reaches 1.0 before it has counted them."""
    return jnp.stack([jnp.linspace(0.0, -30.0, V), jnp.zeros(V).at[7].set(12.0)])


def _kept(x, top_k, top_p):
    """How many ids of each row the top_k / top_p cut keeps."""
    B = x.shape[0]
    cut = sorted_cutoff(x, jnp.full((B,), top_k, jnp.int32), jnp.full((B,), top_p, jnp.float32))
    return np.asarray((x >= cut[:, None]).sum(-1))


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (V, 1.0), (-1, 1.0)])
def test_no_cut_keeps_every_id(top_k, top_p):
    assert list(_kept(_spread_logits(), top_k, top_p)) == [V, V]


def test_no_cut_samples_the_full_softmax():
    """top_k = V (or 0 = all), top_p = 1: each row draws from softmax(logits / temperature) with its key
    fold_in(PRNGKey(seed), step), the same draw as jax.random.categorical with that key."""
    logits = jnp.tile(_spread_logits(), (32, 1)) * 0.1  # a flatter spread: the tail gets drawn
    B = logits.shape[0]
    for top_k in (V, 0):
        rows = default_rows(B)
        for i in range(B):
            set_row(rows, i, temperature=0.7, top_k=top_k, top_p=1.0, seed=i, step=3)
        got = np.asarray(sample_rows(logits, rows)["tokens"])
        want = [int(jax.random.categorical(jax.random.fold_in(jax.random.PRNGKey(i), 3), logits[i] / 0.7))
                for i in range(B)]
        np.testing.assert_array_equal(got, want)


def test_cuts_still_cut():
    """The fix for top_p = 1 leaves real cuts alone: top_k keeps k ids, a top_p < 1 keeps the smallest set."""
    x = _spread_logits()
    assert _kept(x, 5, 1.0)[0] == 5
    kept = _kept(x, 0, 0.5)
    p = np.asarray(jax.nn.softmax(x[0]))
    assert kept[0] == int(np.searchsorted(np.cumsum(p), 0.5) + 1) and kept[1] == 1


def test_generate_defaults_no_stop_tokens():
    """Sampling with only a temperature and no stop tokens: every row runs to max_new_tokens, all ids in the
    vocabulary, reproducible from the seed."""
    cfg = K2Config.from_hf_config(CONFIGS / "tiny.json")
    model, params = K2Model(cfg), random_params(cfg)
    prompts = [[5, 6, 7], [42]]
    tokens, lengths = generate(model, params, prompts, 5, temperature=1.0, seed=3)
    assert list(lengths) == [5, 5]
    assert tokens.min() >= 0 and tokens.max() < cfg.vocab_size
    np.testing.assert_array_equal(generate(model, params, prompts, 5, temperature=1.0, seed=3)[0], tokens)
