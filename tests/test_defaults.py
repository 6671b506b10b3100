"""The paths a user takes by default, which the feature tests (always passing a mask, a stop token or a
setting) would not reach: sampling with no top_k / top_p, the explicit "no cut" values top_k = V and
top_p = 1, and generate with no stop tokens. (Convert with no --layers and load with no dtype are the
default calls of tests/test_convert.py::test_equals_load_hf_bit_exact.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k2jax import K2Config, K2Model, generate
from k2jax.inference.generate import filter_logits, sample
from k2jax.testing import random_params
from tests.conftest import CONFIGS

V = 1000


def _spread_logits():
    """One row spread over 30 nats, one dominated by a single id: tails of tiny probability, which float32's
    running mass reaches 1.0 before it has counted them."""
    return jnp.stack([jnp.linspace(0.0, -30.0, V), jnp.zeros(V).at[7].set(12.0)])


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (V, 1.0), (V, None)])
def test_no_cut_keeps_every_id(top_k, top_p):
    x = filter_logits(_spread_logits(), 1.0, top_k, 1.0 if top_p is None else top_p)
    assert bool(jnp.all(jnp.isfinite(x))), f"{int((~jnp.isfinite(x)).sum())} of {x.size} ids cut"


def test_no_cut_samples_the_full_softmax():
    """top_k = V, top_p = 1: the same draw as jax.random.categorical on logits / temperature, key for key."""
    logits = jnp.tile(_spread_logits(), (64, 1)) * 0.1  # a flatter spread: the tail gets drawn
    for seed in range(4):
        key = jax.random.PRNGKey(seed)
        want = jax.random.categorical(key, logits / 0.7, axis=-1)
        np.testing.assert_array_equal(sample(logits, key, 0.7, V, 1.0), want)
        np.testing.assert_array_equal(sample(logits, key, 0.7, 0, 1.0), want)


def test_cuts_still_cut():
    """The fix for top_p = 1 leaves real cuts alone: top_k keeps k ids, a top_p < 1 keeps the smallest set."""
    x = _spread_logits()
    assert int(jnp.isfinite(filter_logits(x, 1.0, 5, 1.0)).sum(-1)[0]) == 5
    kept = np.asarray(jnp.isfinite(filter_logits(x, 1.0, 0, 0.5)).sum(-1))
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
