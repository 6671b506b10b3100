"""The fast MoE dispatch equals the plain dense/masked MoE (same parameters), values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k2jax.config import K2Config
from k2jax.nn.moe import MoE, route
from k2jax.ops.moe import default_sizes, grouped_moe, moe_dense, moe_grouped
from k2jax.ops.quant import quantize_weight
from tests.conftest import CONFIGS


def experts(key, E, D, F, dtype=jnp.float32):
    k1, k2, k3 = jax.random.split(key, 3)
    return (jax.random.normal(k1, (E, D, F), dtype) / D**0.5, jax.random.normal(k2, (E, D, F), dtype) / D**0.5,
            jax.random.normal(k3, (E, F, D), dtype) / F**0.5)


def routing(key, T, E, K, skew=0.0):
    """Random top-k choices; with skew > 0 most tokens pick expert 0 and several experts get nothing."""
    logits = jax.random.normal(key, (T, E))
    logits = logits.at[:, 0].add(skew).at[:, E // 2:].add(-skew)
    _, idx = jax.lax.top_k(logits, K)
    w = jax.random.uniform(jax.random.fold_in(key, 1), (T, K))
    return idx.astype(jnp.int32), w


@pytest.mark.parametrize("impl, capacity", [("tiled", None), ("tiled", 0), ("tiled", 2), ("ragged", None)])
@pytest.mark.parametrize("T, E, K, tile, skew", [
    (37, 8, 2, 4, 0.0), (64, 16, 4, 8, 0.0), (50, 16, 4, 16, 6.0), (3, 32, 8, 64, 0.0), (1, 8, 8, 4, 0.0),
    (2, 64, 8, 8, 0.0), (4, 64, 8, 8, 0.0), (6, 64, 8, 8, 8.0)])  # decode-sized: the loop (capacity None)
def test_grouped_equals_dense(impl, capacity, T, E, K, tile, skew):
    # capacity None: sized for the load (the batched matmul does it all, a hot expert overflows into tiles;
    # or, for decode-sized batches, a loop over the chosen experts: with skew, rows sharing most of them);
    # 0: every row through the tile loop; 2: most rows overflow.
    key = jax.random.PRNGKey(T * E + K)
    D, F = 24, 20
    w = experts(key, E, D, F)
    x = jax.random.normal(jax.random.fold_in(key, 2), (T, D))
    idx, wt = routing(jax.random.fold_in(key, 3), T, E, K, skew)
    if skew:
        counts = np.bincount(np.asarray(idx).ravel(), minlength=E)
        assert counts[0] == T and (counts == 0).sum() >= E // 2 - K  # uneven: some empty, one full
    ref = moe_dense(x, idx, wt, *w)
    got = jax.jit(lambda *a: moe_grouped(*a, impl=impl, tile=tile, capacity=capacity))(x, idx, wt, *w)
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-5)


def test_default_sizes_hold_a_balanced_load():
    assert default_sizes(32, 64) == (0, 4)  # 4 rows of top-8 over 64 experts (float8's decode): tiles only
    c, t = default_sizes(64, 64)  # 8 rows of top-8 over 64 experts: a mean of one row each
    assert c >= 3 and c % 8 == 0 and t >= c
    c, t = default_sizes(512 * 8, 64)  # a 512-token chunk: 64 rows each
    assert 64 + 2 * 8 <= c < 100 and t == 32


def test_chosen_experts_are_each_listed_once():
    """The decode loop's trip list: every expert some row chose, once, ascending; ids >= E (held elsewhere)
    are not chosen."""
    from k2jax.ops.moe import chosen_experts

    idx = jnp.array([[5, 2, 9], [2, 5, 9], [9, 12, 1], [12, 12, 12]], jnp.int32)  # 12: held elsewhere
    ids, n = chosen_experts(idx, 12)
    assert int(n) == 4 and ids.shape == (12,)
    assert ids[:4].tolist() == [1, 2, 5, 9] and (np.asarray(ids[4:]) == 12).all()
    ids, n = chosen_experts(jnp.full((3, 2), 7, jnp.int32), 8)  # every row the same expert: one trip
    assert int(n) == 1 and int(ids[0]) == 7


@pytest.mark.parametrize("T, E, capacities", [
    (29, 8, (None, 0, 3)),  # batched matmul and tiles together, tiles only, mostly tiles
    (2, 32, (None,)),  # decode-sized: the loop over the chosen experts
])
def test_grouped_gradients_equal_dense(T, E, capacities):
    key = jax.random.PRNGKey(0)
    K, D, F = 3, 16, 12
    w = experts(key, E, D, F)
    x = jax.random.normal(jax.random.fold_in(key, 2), (T, D))
    idx, wt = routing(jax.random.fold_in(key, 3), T, E, K, 3.0)

    def loss(fn, x, wt, w):
        return jnp.sum(jnp.sin(fn(x, idx, wt, *w)))

    g_ref = jax.grad(lambda *a: loss(moe_dense, *a), argnums=(0, 1, 2))(x, wt, w)
    for capacity in capacities:
        g_got = jax.grad(lambda *a: loss(lambda *b: moe_grouped(*b, tile=8, capacity=capacity), *a),
                         argnums=(0, 1, 2))(x, wt, w)
        for a, b in zip(jax.tree_util.tree_leaves(g_got), jax.tree_util.tree_leaves(g_ref)):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("T, E, capacity", [(2, 64, None), (40, 8, None), (40, 8, 0)])  # loop, batched, tiles
def test_experts_held_elsewhere_add_nothing(T, E, capacity):
    # Expert parallelism marks a device's foreign assignments with id E.
    from k2jax.ops.moe import grouped_moe

    key = jax.random.PRNGKey(7)
    K, D, F = 4, 16, 12
    w = experts(key, E, D, F)
    x = jax.random.normal(jax.random.fold_in(key, 2), (T, D))
    idx, wt = routing(jax.random.fold_in(key, 3), T, E, K)
    foreign = jax.random.bernoulli(jax.random.fold_in(key, 4), 0.5, idx.shape)
    ref = moe_dense(x, idx, jnp.where(foreign, 0.0, wt), *w)
    got = grouped_moe(x, jnp.where(foreign, E, idx), wt, *w, capacity=capacity, tile=4)
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-5)


def layer_stacks(key, L, E, D, F, quant=None):
    """Every layer's expert stacks [L, E, ...] (plain or quantized) and each layer's plain weights."""
    ks = jax.random.split(key, L)
    layers = [experts(k, E, D, F) for k in ks]
    stacks = [jnp.stack(ws) for ws in zip(*layers)]
    if quant:
        stacks = [quantize_weight(w, quant, lead_ndim=2) for w in stacks]
        layers = [tuple(w.dequantize()[i] for w in stacks) for i in range(L)]
    return stacks, layers


@pytest.mark.parametrize("quant", [None, "fp8", "int4"])
@pytest.mark.parametrize("T, capacity, block", [
    (2, None, None),  # decode-sized: the loop takes the chosen experts out of the stacks
    (40, None, 1), (40, None, 2), (40, None, 8),  # the batched matmul in blocks of 1, 2, all 8 experts
    (40, 2, 4),  # blocks and overflow tiles
    (40, 0, None),  # tiles only
])
def test_layer_read_out_of_stacks_equals_dense_of_that_layer(quant, T, capacity, block):
    """grouped_moe of layer l of every layer's stacks (and of layer l's own arrays, which run in blocks too
    when quantized) == moe_dense of that layer's experts."""
    L, E, K, D, F = 3, 8, 2, 64, 32
    key = jax.random.PRNGKey(T + 3 * (capacity or 0) + (block or 0))
    stacks, layers = layer_stacks(key, L, E, D, F, quant)
    x = jax.random.normal(jax.random.fold_in(key, 1), (T, D))
    idx, wt = routing(jax.random.fold_in(key, 2), T, E, K, skew=2.0)
    run = jax.jit(lambda x, layer: grouped_moe(x, idx, wt, *stacks, layer=layer, capacity=capacity, tile=4,
                                               block=block))
    own = jax.jit(lambda x, *w: grouped_moe(x, idx, wt, *w, capacity=capacity, tile=4, block=block))
    for layer in range(L):
        want = moe_dense(x, idx, wt, *layers[layer])
        np.testing.assert_allclose(run(x, layer), want, atol=1e-5, rtol=1e-5, err_msg=f"layer {layer}")
        np.testing.assert_allclose(own(x, *(w[layer] for w in stacks)), want, atol=1e-5, rtol=1e-5,
                                   err_msg=f"layer {layer}'s own arrays")


@pytest.mark.parametrize("T, capacity", [(1, None), (40, None), (40, 2), (40, 0)])  # loop, batched, tiles
def test_output_major_layers_equal_dense(T, capacity):
    """A runtime's per-layer arrays with gate and up output-major (OutputMajor [E, F, D]), each layer picked by
    a switch (moe_grouped's stacks as per-layer sequences) == moe_dense of that layer's experts."""
    from k2jax.ops.moe import OutputMajor

    L, E, K, D, F = 3, 8, 2, 64, 32
    key = jax.random.PRNGKey(T + (capacity or 0))
    stacks, layers = layer_stacks(key, L, E, D, F)
    views = [tuple(OutputMajor(jnp.swapaxes(w[l], -1, -2)) for l in range(L)) for w in stacks[:2]]
    views.append(tuple(stacks[2][l] for l in range(L)))
    x = jax.random.normal(jax.random.fold_in(key, 1), (T, D))
    idx, wt = routing(jax.random.fold_in(key, 2), T, E, K, skew=2.0)
    zeros = jax.tree.map(jnp.zeros_like, layers[0])  # the layer's own arrays are read only to differentiate
    run = jax.jit(lambda x, layer: moe_grouped(x, idx, wt, *zeros, capacity=capacity, tile=4, stacks=views,
                                               layer=layer))
    for layer in range(L):
        np.testing.assert_allclose(run(x, layer), moe_dense(x, idx, wt, *layers[layer]), atol=1e-5, rtol=1e-5,
                                   err_msg=f"layer {layer}")


@pytest.mark.parametrize("T, capacity", [(29, None), (29, 0), (2, None)])
def test_stacks_give_the_values_and_the_slice_the_gradients(T, capacity):
    """moe_grouped with the stacks and the layer: values computed out of the stacks (the layer's own arrays
    are never read forward), gradients for x, the router weights and the layer's arrays equal the dense
    reference's, none for the stacks."""
    L, E, K, D, F = 3, 16, 3, 16, 12
    key = jax.random.PRNGKey(4)
    stacks, layers = layer_stacks(key, L, E, D, F)
    x = jax.random.normal(jax.random.fold_in(key, 1), (T, D))
    idx, wt = routing(jax.random.fold_in(key, 2), T, E, K, skew=3.0)
    layer = 1

    def loss(fn, x, wt, w, stacks):
        return jnp.sum(jnp.sin(fn(x, idx, wt, w, stacks)))

    def got(x, idx, wt, w, stacks):
        return moe_grouped(x, idx, wt, *w, tile=8, capacity=capacity, stacks=stacks, layer=jnp.int32(layer))

    zeros = jax.tree.map(jnp.zeros_like, layers[layer])
    np.testing.assert_allclose(jax.jit(got)(x, idx, wt, zeros, stacks), moe_dense(x, idx, wt, *layers[layer]),
                               atol=1e-5, rtol=1e-5)
    g_ref = jax.grad(lambda *a: loss(lambda x, i, wt, w, s: moe_dense(x, i, wt, *w), *a), argnums=(0, 1, 2, 3))(
        x, wt, layers[layer], stacks)
    g_got = jax.jit(jax.grad(lambda *a: loss(got, *a), argnums=(0, 1, 2, 3)))(x, wt, layers[layer], stacks)
    for a, b in zip(jax.tree_util.tree_leaves(g_got[:3]), jax.tree_util.tree_leaves(g_ref[:3])):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
    assert all(not np.any(g) for g in jax.tree_util.tree_leaves(g_got[3]))


def test_bf16_grouped_close_to_dense():
    key = jax.random.PRNGKey(1)
    w = experts(key, 16, 64, 32, jnp.bfloat16)
    x = jax.random.normal(key, (40, 64), jnp.bfloat16)
    idx, wt = routing(jax.random.fold_in(key, 3), 40, 16, 4)
    ref = moe_dense(x, idx, wt, *w).astype(jnp.float32)
    got = moe_grouped(x, idx, wt, *w, tile=8).astype(jnp.float32)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, ref, atol=2e-2, rtol=2e-2)


def test_moe_module_impls_agree():
    cfg = K2Config.from_hf_config(CONFIGS / "tiny.json")
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 9, cfg.hidden_size))
    params = MoE(cfg, impl="dense").init(jax.random.PRNGKey(1), x)
    params = jax.tree_util.tree_map(lambda a: a, params)
    ref = MoE(cfg, impl="dense").apply(params, x)
    for impl in ("tiled", "ragged", "auto"):
        np.testing.assert_allclose(MoE(cfg, impl=impl, tile=4).apply(params, x), ref, atol=1e-5, rtol=1e-5)


def test_padding_tokens_take_no_routed_expert():
    """valid_BT: real tokens' outputs are those of the unmasked module; a padding token's is its shared
    experts' alone (no routed expert), on every single-device impl."""
    from k2jax.nn.mlp import MLP

    cfg = K2Config.from_hf_config(CONFIGS / "tiny.json")
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 9, cfg.hidden_size))
    valid = np.ones((2, 9), bool)
    valid[0, 6:] = valid[1, :2] = False
    params = MoE(cfg, impl="dense").init(jax.random.PRNGKey(1), x)
    whole = MoE(cfg, impl="dense").apply(params, x)
    shared = MLP(cfg.shared_intermediate_size).apply({"params": params["params"]["shared_experts"]}, x)
    for impl in ("dense", "tiled", "ragged"):
        got = MoE(cfg, impl=impl, tile=4).apply(params, x, valid_BT=jnp.asarray(valid))
        np.testing.assert_allclose(got[valid], whole[valid], atol=1e-5, rtol=1e-5, err_msg=impl)
        np.testing.assert_allclose(got[~valid], shared[~valid], atol=1e-5, rtol=1e-5, err_msg=impl)


def test_router_bias_picks_but_does_not_weigh():
    cfg = K2Config.from_hf_config(CONFIGS / "tiny.json").replace(routed_scaling_factor=1.0)
    logits = jnp.array([[0.0, 1.0, 2.0, 3.0, -1.0, -2.0, 0.5, 0.1]])
    bias = jnp.zeros(8).at[5].set(10.0)  # expert 5 has the lowest score but must win
    idx, w = route(logits, bias, cfg)
    assert sorted(idx[0].tolist()) == [3, 5]
    s = jax.nn.sigmoid(logits[0])
    expect = {3: s[3] / (s[3] + s[5]), 5: s[5] / (s[3] + s[5])}
    for i, wk in zip(idx[0].tolist(), w[0].tolist()):
        assert wk == pytest.approx(float(expect[i]), rel=1e-6)


def test_grouped_routing_masks_groups():
    cfg = K2Config.from_hf_config(CONFIGS / "tiny.json").replace(n_group=4, topk_group=2, num_experts_per_tok=2)
    # Groups of 2: {0,1} {2,3} {4,5} {6,7}. Expert 7 alone is the best single score, but group {6,7} sums low.
    logits = jnp.array([[2.0, 2.0, 1.5, 1.5, -5.0, -5.0, 3.0, -9.0]])
    idx, _ = route(logits, jnp.zeros(8), cfg)
    assert sorted(idx[0].tolist()) == [0, 1]
    # Without groups expert 6 wins.
    idx, _ = route(logits, jnp.zeros(8), cfg.replace(n_group=1, topk_group=1))
    assert 6 in idx[0].tolist()
