"""k2jax.train: gradients against transformers' backward, overfitting a batch on 1 and 8 devices, router
statistics against the reference's routing, aux-loss-free balancing, optimizer-state placement."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from k2jax import K2Config, K2Model, init_params, load_hf
from k2jax.checkpoint import names as release_names
from k2jax.nn.model import abstract_params
from k2jax.sharding import make_mesh
from k2jax.train import BIAS_PATH, loss_and_metrics, make_train_step, next_token_targets, token_nll
from tests.conftest import CONFIGS

# DeepSeek-V3's grouped routing, one dense block then two MoE blocks; the oracle's random bias changes choices.
HF_CFG = dict(vocab_size=96, hidden_size=64, intermediate_size=112, moe_intermediate_size=24, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=24, q_lora_rank=32, qk_nope_head_dim=16,
              qk_rope_head_dim=8, v_head_dim=12, n_shared_experts=1, n_routed_experts=16, num_experts_per_tok=4,
              n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
              rms_norm_eps=1e-6, rope_theta=50000.0, max_position_embeddings=131072, tie_word_embeddings=False,
              rope_scaling={"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                            "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})
B, T = 2, 12
STEPS = 50
OVERFIT = 0.2  # after STEPS AdamW steps the loss on the fixed batch is below this fraction of its start


def _fetch(tree, path):
    for k in path:
        tree = tree[k]
    return tree


# ------------------------------------------------------------------------------- against transformers
@pytest.fixture(scope="module")
def reference(tmp_path_factory, oracle):
    d = tmp_path_factory.mktemp("train_ref")
    rng = np.random.default_rng(5)
    ids = rng.integers(0, 96, (B, T))
    attn = np.ones((B, T), np.int64)
    attn[1, :3] = 0  # left padding
    loss_mask = np.ones((B, T), np.int64)
    loss_mask[0, :5] = 0  # a prompt
    labels, weights = (np.asarray(a) for a in next_token_targets(jnp.asarray(ids), jnp.asarray(loss_mask),
                                                                 jnp.asarray(attn)))
    out = oracle.run({"config": HF_CFG, "seed": 11, "save": {"dir": str(d), "format": "hf"},
                      "inputs": {"input_ids": ids, "attention_mask": attn}, "capture": True,
                      "grad": {"input_ids": ids, "labels": np.where(weights > 0, labels, -100),
                               "loss_mask": weights, "attention_mask": attn}})
    cfg, params = load_hf(d)
    batch = {"tokens": jnp.asarray(ids, jnp.int32), "loss_mask": jnp.asarray(loss_mask),
             "attention_mask": jnp.asarray(attn)}
    return dict(cfg=cfg, params=params, out=out, batch=batch)


@functools.lru_cache
def grad_fn(cfg, remat):
    model = K2Model(cfg, remat=remat)
    return jax.jit(jax.value_and_grad(lambda p, b: loss_and_metrics(model, p, b, loss_chunk=5), has_aux=True))


@pytest.mark.parametrize("remat", ["none", "save_matmuls"])
def test_gradients_match_transformers(reference, remat):
    cfg, out = reference["cfg"], reference["out"]
    (loss, metrics), grads = grad_fn(cfg, remat)(reference["params"], reference["batch"])
    np.testing.assert_allclose(loss, out["loss"], rtol=1e-5)
    assert float(metrics["tokens"]) == 7 + 8  # targets: row 0 tokens 5..11, row 1 tokens 4..11 (3 padded)
    flat = {tuple(k.key for k in p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(grads)}
    hf_names = [k[len("grad."):] for k in out if k.startswith("grad.")]
    assert set(hf_names) == set(release_names.expected_names(cfg)) - {f"model.layers.{i}.mlp.gate.e_score_correction_bias"
                                                          for i in range(1, 3)}
    for name in hf_names:
        t = release_names.resolve(name, cfg)
        np.testing.assert_allclose(t.transform.inverse(flat[t.leaf][t.index]), out[f"grad.{name}"],
                                   atol=1e-4, rtol=1e-4, err_msg=name)
    assert not np.any(flat[BIAS_PATH])  # the correction bias gets no gradient


def test_padding_is_isolated(reference):
    """Left padding: what the padded slots hold changes neither the loss nor any gradient, and they are
    never targets."""
    cfg, batch = reference["cfg"], dict(reference["batch"])
    results = []
    for fill in (0, 95):
        batch["tokens"] = reference["batch"]["tokens"].at[1, :3].set(fill)
        results.append(grad_fn(cfg, "none")(reference["params"], batch))
    (loss0, m0), g0 = results[0]
    (loss1, m1), g1 = results[1]
    np.testing.assert_array_equal(loss0, loss1)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), g0, g1)


def test_router_statistics_match_transformers(reference):
    """load [L, E] and bias_changed [L] from the reference's own routing; the balance loss from the formula
    on the reference's router logits and choices."""
    cfg, out = reference["cfg"], reference["out"]
    alpha = 0.3
    _, m = jax.jit(lambda p, b: loss_and_metrics(K2Model(cfg), p, b, balance_alpha=alpha))(
        reference["params"], reference["batch"])
    E, K = cfg.n_routed_experts, cfg.num_experts_per_tok
    want_load, want_changed, want_bal = [], [], 0.0
    for i in range(cfg.num_dense_layers, cfg.num_hidden_layers):
        idx = out[f"layers.{i}.mlp.gate.topk_idx"].reshape(B, T, K)
        chosen = (idx[..., None] == np.arange(E)).any(-2)  # [B, T, E]
        want_load.append(chosen.sum((0, 1)))
        want_changed.append(out[f"layers.{i}.mlp.gate.bias_changes_choice"])
        s = 1 / (1 + np.exp(-out[f"layers.{i}.mlp.gate.logits"].reshape(B, T, E).astype(np.float64)))
        f = chosen.mean(1) * E / K
        p = (s / s.sum(-1, keepdims=True)).mean(1)
        want_bal += (f * p).sum(-1).mean()
    np.testing.assert_array_equal(m["load"], np.stack(want_load))
    np.testing.assert_allclose(m["bias_changed"], want_changed, rtol=1e-6)
    assert min(want_changed) > 0.05, "the reference's bias should change some choices"
    np.testing.assert_allclose(m["balance_loss"], alpha * want_bal, rtol=1e-5)


# ---------------------------------------------------------------------------------------------- pieces
def test_token_nll_chunks_equal_log_softmax():
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    h = jax.random.normal(k1, (2, 11, 8))
    head = jax.random.normal(k2, (8, 40))
    y = jax.random.randint(k3, (2, 11), 0, 40)
    want = -jnp.take_along_axis(jax.nn.log_softmax(h @ head), y[..., None], -1)[..., 0]
    for chunk in (1, 4, 11, 64):  # 4: a padded last chunk
        np.testing.assert_allclose(token_nll(h, head, y, chunk), want, rtol=1e-5, atol=1e-5)
    g = jax.grad(lambda hd: token_nll(h, hd, y, 4).sum())(head)
    g_want = jax.grad(lambda hd: -jnp.take_along_axis(jax.nn.log_softmax(h @ hd), y[..., None], -1).sum())(head)
    np.testing.assert_allclose(g, g_want, rtol=1e-5, atol=1e-5)


def test_next_token_targets():
    tokens = jnp.array([[5, 6, 7, 8]])
    labels, w = next_token_targets(tokens, jnp.array([[1, 1, 0, 1]]), jnp.array([[0, 1, 1, 1]]))
    np.testing.assert_array_equal(labels, [[6, 7, 8, 0]])
    np.testing.assert_array_equal(w, [[0, 0, 1, 0]])  # padding predicts nothing; token 2 is not a target
    _, w = next_token_targets(tokens)  # no masks: every position but the last predicts its next token
    np.testing.assert_array_equal(w, [[1, 1, 1, 0]])


def test_unknown_remat_policy():
    cfg = K2Config.from_hf_config(CONFIGS / "tiny.json")
    with pytest.raises(ValueError, match="remat policy"):
        K2Model(cfg, remat="some").init(jax.random.PRNGKey(0), jnp.zeros((1, 2), jnp.int32))


def test_remat_cuts_activation_memory():
    """At a few hundred tokens the activations kept for the backward pass dominate XLA's temp bytes: with
    remat they must shrink (compile only; params, gradients and Adam state are the same for every policy)."""
    cfg = K2Config.from_hf_config(CONFIGS / "tiny.json")
    params = abstract_params(cfg)
    batch = {"tokens": jax.ShapeDtypeStruct((2, 256), jnp.int32)}
    temp = {}
    for remat in ("none", "full"):
        step = make_train_step(K2Model(cfg, remat=remat), optax.adam(1e-3))
        opt_state = jax.eval_shape(step.optimizer.init, params)
        temp[remat] = step.fn.lower(params, opt_state, batch).compile().memory_analysis().temp_size_in_bytes
    assert temp["full"] < 0.7 * temp["none"], temp  # 0.54 with jax 0.12; about 1 if remat does nothing


# --------------------------------------------------------------------------------------- training runs
@pytest.fixture(scope="module")
def tiny():
    cfg = K2Config.from_hf_config(CONFIGS / "tiny.json")
    params = init_params(cfg, jax.random.PRNGKey(1))
    tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 16), 0, cfg.vocab_size)
    loss_mask = jnp.ones((2, 16), jnp.int32).at[0, :4].set(0)
    return cfg, params, {"tokens": tokens, "loss_mask": loss_mask}


def train(cfg, params, batch, steps, mesh=None, remat="full", moe_impl="dense", **kw):
    step = make_train_step(K2Model(cfg, moe_impl=moe_impl, remat=remat), optax.adamw(3e-3), mesh, **kw)
    params = step.place(jax.tree.map(jnp.copy, params))  # the step donates its inputs
    opt_state = step.init(params)
    history = []
    for _ in range(steps):
        params, opt_state, metrics = step(params, opt_state, batch)
        history.append(jax.device_get(metrics))
    return step, params, opt_state, {k: np.stack([h[k] for h in history]) for k in history[0]}


@pytest.fixture(scope="module")
def single_device(tiny):
    cfg, params, batch = tiny
    return train(cfg, params, batch, STEPS)


def test_overfits_fixed_batch(single_device):
    _, _, _, hist = single_device
    loss = hist["loss"]
    assert loss[-1] < OVERFIT * loss[0], loss
    assert np.all(hist["tokens"] == 15 + 12)
    assert np.all(np.isfinite(hist["grad_norm"])) and hist["grad_norm"][0] > 0
    assert hist["load"].shape == (STEPS, 2, 8) and np.all(hist["load"].sum(-1) == 2 * 16 * 2)  # B·T·K


def test_bias_unchanged_without_balancing(tiny, single_device):
    _, params, _ = tiny
    _, trained, _, _ = single_device
    np.testing.assert_array_equal(_fetch(trained, BIAS_PATH), _fetch(params, BIAS_PATH))
    assert not np.allclose(_fetch(trained, BIAS_PATH[:-1] + ("kernel",)), _fetch(params, BIAS_PATH[:-1] + ("kernel",)))


def test_eight_devices_same_losses(tiny, single_device):
    """Params, optimizer state and batch sharded over data=2, expert=4 (the experts' weights split 4 ways);
    the MoE is the expert-parallel one (k2jax.ops.expert_parallel): 32 tokens over 8 token groups take the
    all-to-all exchange (4 tokens per device, 3 per round). The single-device run it matches is dense."""
    cfg, params, batch = tiny
    mesh = make_mesh("data=2,expert=4")
    step, trained, opt_state, hist = train(cfg, params, batch, STEPS, mesh, moe_impl="auto")
    np.testing.assert_allclose(hist["loss"], single_device[3]["loss"], rtol=1e-5)
    # Optimizer state leaves carry their params' sharding (Adam's mu and nu); the step count is replicated.
    adam = opt_state[0]
    for moments in (adam.mu, adam.nu):
        for (path, leaf), p in zip(jax.tree_util.tree_leaves_with_path(moments), jax.tree.leaves(trained)):
            assert leaf.sharding.is_equivalent_to(p.sharding, leaf.ndim), jax.tree_util.keystr(path)
    experts = _fetch(adam.mu, ("moe_layers", "mlp", "experts", "gate_proj"))
    assert experts.sharding.spec[1] == "expert"  # [L, E, D, F]: experts split 4 ways
    assert adam.count.sharding.is_fully_replicated


def test_balancing_evens_skewed_load(tiny):
    """Experts 0 and 1 start with a +1 correction bias (sigmoid scores lie in (0, 1)), so every token picks
    them: max/mean load = E/K = 4. Balancing must spread the load; the router weight keeps learning."""
    cfg, params, batch = tiny
    skewed = jnp.zeros((cfg.num_moe_layers, cfg.n_routed_experts)).at[:, :2].set(1.0)
    params = {**params, "moe_layers": {**params["moe_layers"], "mlp": {**params["moe_layers"]["mlp"], "gate": {
        **params["moe_layers"]["mlp"]["gate"], "e_score_correction_bias": skewed}}}}
    _, trained, _, hist = train(cfg, params, batch, 100, remat="none", moe_impl="auto", balance_gamma=0.01)
    ratio = hist["load"].max(-1) / hist["load"].mean(-1)  # [steps, L]
    np.testing.assert_allclose(ratio[0], 4.0)
    assert np.all(ratio[-10:].mean(0) < 2.0), ratio[-10:]
    bias = np.asarray(_fetch(trained, BIAS_PATH))
    assert np.all(bias[:, :2] < 1.0) and np.all(bias[:, 2:] > 0.0)
    kernel = BIAS_PATH[:-1] + ("kernel",)
    assert not np.allclose(_fetch(trained, kernel), _fetch(params, kernel))
