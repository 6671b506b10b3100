"""The training loss under every combination of masks: loss_and_metrics's loss and target count against the
cross-entropy computed independently (plain Python targets, numpy log-softmax of K2Model.apply's logits), and
against transformers' loss where the oracle can express it; the same for make_train_step's metrics on one
device and on data=2,expert=4."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from k2jax import K2Model, load_hf, make_train_step
from k2jax.sharding import make_mesh
from k2jax.train import loss_and_metrics
from tests.test_train import HF_CFG

B, T = 2, 10


def _cases():
    rng = np.random.default_rng(3)
    ids = rng.integers(1, HF_CFG["vocab_size"], (B, T))
    left_pad = np.ones((B, T), np.int32)
    left_pad[1, :4] = 0
    prompt = np.ones((B, T), np.int32)
    prompt[0, :3] = 0
    prompt[1, :6] = 0
    single = np.ones((B, T), np.int32)
    single[1, :-1] = 0  # row 1: one real token, so nothing to predict
    empty = np.ones((B, T), np.int32)
    empty[1] = 0  # row 1: all padding
    return {
        "no masks": (ids, None, None),
        "loss_mask only": (ids, prompt, None),
        "attention_mask only": (ids, None, left_pad),
        "both": (ids, prompt, left_pad),
        "single real token": (ids, None, single),
        "all padding": (ids, None, empty),
    }


CASES = _cases()


def expected_targets(loss_mask, attention_mask):
    """[B, T] weights, written out position by position: position t predicts token t+1 iff both are real
    tokens and token t+1 is a target; the last position predicts nothing."""
    real = np.ones((B, T), bool) if attention_mask is None else attention_mask.astype(bool)
    target = np.ones((B, T), bool) if loss_mask is None else loss_mask.astype(bool)
    w = np.zeros((B, T), np.float64)
    for b in range(B):
        for t in range(T - 1):
            w[b, t] = real[b, t] and real[b, t + 1] and target[b, t + 1]
    return w


def independent_ce(logits, ids, w):
    """Token-mean cross-entropy in float64 from the model's own logits [B, T, V]."""
    x = np.asarray(logits, np.float64)
    logp = x - x.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    labels = np.concatenate([ids[:, 1:], np.zeros((B, 1), ids.dtype)], 1)
    nll = -np.take_along_axis(logp, labels[..., None], -1)[..., 0]
    return (nll * w).sum() / w.sum(), labels


def batch_of(ids, loss_mask, attention_mask):
    batch = {"tokens": jnp.asarray(ids, jnp.int32)}
    if loss_mask is not None:
        batch["loss_mask"] = jnp.asarray(loss_mask)
    if attention_mask is not None:
        batch["attention_mask"] = jnp.asarray(attention_mask)
    return batch


@pytest.fixture(scope="module")
def model_params(tmp_path_factory, oracle):
    d = tmp_path_factory.mktemp("mask_ref")
    oracle.run({"config": HF_CFG, "seed": 11, "save": {"dir": str(d), "format": "hf"},
                "inputs": {"input_ids": CASES["no masks"][0]}})
    cfg, params = load_hf(d)
    return cfg, params


@functools.lru_cache
def _loss_fn(cfg):
    return jax.jit(lambda p, b: loss_and_metrics(K2Model(cfg), p, b, loss_chunk=4))


@functools.lru_cache
def _logits_fn(cfg):
    return jax.jit(lambda p, t, a: K2Model(cfg).apply({"params": p}, t, None, a))


def _want(cfg, params, case):
    ids, loss_mask, attention_mask = CASES[case]
    w = expected_targets(loss_mask, attention_mask)
    attn = None if attention_mask is None else jnp.asarray(attention_mask)
    ce, labels = independent_ce(_logits_fn(cfg)(params, jnp.asarray(ids, jnp.int32), attn), ids, w)
    return w, ce, labels


@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_metrics_every_mask_combination(model_params, oracle, case):
    cfg, params = model_params
    ids, loss_mask, attention_mask = CASES[case]
    w, want_ce, labels = _want(cfg, params, case)
    loss, metrics = _loss_fn(cfg)(params, batch_of(ids, loss_mask, attention_mask))
    assert float(metrics["tokens"]) == w.sum()
    np.testing.assert_allclose(float(loss), want_ce, rtol=2e-6)
    # transformers on the same weights and targets. A row that is all padding has no key to attend to: the
    # reference's output there is not defined (and no target reads it), so only the real row goes to it.
    rows = [0] if case == "all padding" else list(range(B))
    req = {"input_ids": ids[rows], "labels": np.where(w[rows] > 0, labels[rows], -100)}
    if attention_mask is not None:
        req["attention_mask"] = attention_mask[rows]
    ref = oracle.run({"config": HF_CFG, "seed": 11, "grad": req})
    np.testing.assert_allclose(float(loss), ref["loss"], rtol=1e-5)


def test_no_masks_has_no_phantom_target(model_params):
    """With tokens only, each row of T tokens has exactly T-1 targets (the last position predicts nothing)."""
    cfg, params = model_params
    _, metrics = _loss_fn(cfg)(params, {"tokens": jnp.asarray(CASES["no masks"][0], jnp.int32)})
    assert float(metrics["tokens"]) == B * (T - 1)


@pytest.mark.parametrize("mesh_spec", [None, "data=2,expert=4"])
def test_train_step_metrics_every_mask_combination(model_params, mesh_spec):
    """make_train_step's metrics are the loss of the params it was given, before the update."""
    cfg, params = model_params
    mesh = None if mesh_spec is None else make_mesh(mesh_spec)
    step = make_train_step(K2Model(cfg), optax.sgd(0.0), mesh, loss_chunk=4)
    placed = step.place(params)
    for case, (ids, loss_mask, attention_mask) in CASES.items():
        w, want_ce, _ = _want(cfg, params, case)
        p = jax.tree.map(jnp.copy, placed)  # the step donates its inputs
        _, _, metrics = step(p, step.init(p), batch_of(ids, loss_mask, attention_mask))
        assert float(metrics["tokens"]) == w.sum(), case
        np.testing.assert_allclose(float(metrics["loss"]), want_ce, rtol=2e-5, err_msg=case)
