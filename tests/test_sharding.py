"""Sharding on 8 simulated CPU devices: the rules table, expert-parallel MoE equal to one device, planning."""


import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from k2jax import K2Config, K2Model, abstract_params, init_params, param_axes
from k2jax.cli import main as cli_main
from k2jax.runtime.cache import init_cache
from k2jax.ops.expert_parallel import moe_expert_parallel
from k2jax.ops.moe import moe_dense
from k2jax.plan import plan
from k2jax.placement import param_shardings
from k2jax.sharding import RULES, make_mesh, use_mesh
from tests.conftest import CONFIGS
from tests.test_moe import experts, routing

TINY = K2Config.from_hf_config(CONFIGS / "tiny.json")  # 8 experts, top-2
MESHES = ["expert=8", "data=2,expert=4", "expert=4,tensor=2", "data=2,expert=2,tensor=2"]


def is_spec(x):
    return isinstance(x, P)


def test_make_mesh():
    mesh = make_mesh("data=2,expert=4")
    assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "expert": 4, "tensor": 1}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    with pytest.raises(ValueError, match="multiply to 4, but there are 8 devices"):
        make_mesh("expert=4")
    with pytest.raises(ValueError, match="unknown axis 'experts'"):
        make_mesh("experts=8")
    with pytest.raises(ValueError, match="expected AXIS=SIZE"):
        make_mesh("expert:8")


def test_param_shardings_follow_the_rules_table():
    mesh = make_mesh("data=2,expert=2,tensor=2")
    shardings = param_shardings(TINY, mesh)
    table = dict(RULES)
    for (path, names), sharding in zip(jax.tree_util.tree_leaves_with_path(param_axes(TINY), is_leaf=is_spec),
                                       jax.tree_util.tree_leaves(shardings)):
        assert sharding.mesh is mesh
        expected = tuple(table[name] for name in names)
        got = tuple(sharding.spec) + (None,) * (len(names) - len(sharding.spec))
        assert got == expected, (jax.tree_util.keystr(path), names, got)
        if "experts" in names:  # nothing expert-sized is replicated
            assert got[names.index("experts")] == "expert"
        assert got[0] is None or names[0] != "layers"
    moe = shardings["moe_layers"]["mlp"]
    assert moe["experts"]["gate_proj"].spec == P(None, "expert", "fsdp", "tensor")
    assert moe["experts"]["down_proj"].spec == P(None, "expert", "tensor", "fsdp")
    # shared experts and the vocab also split over `expert`: on an expert-only mesh nothing large is whole
    assert moe["shared_experts"]["gate_proj"].spec == P(None, "fsdp", ("tensor", "expert"))
    assert shardings["moe_layers"]["self_attn"]["q_b_proj"].spec == P(None, None, "tensor", None)
    assert shardings["lm_head"].spec == P("fsdp", ("tensor", "expert"))
    # 6 experts on expert=4: the experts dim falls back to replicated (one warning per param, not per layer)
    with pytest.warns(UserWarning) as record:
        odd = param_shardings(TINY.replace(n_routed_experts=6, n_group=1), make_mesh("expert=4,tensor=2"))
    named = sorted(str(w.message).split()[2] for w in record if "k2jax.placement" in str(w.message))
    assert named == [f"moe_layers.mlp.experts.{n}" for n in ("down_proj", "gate_proj", "up_proj")]
    assert odd["moe_layers"]["mlp"]["experts"]["gate_proj"].spec == P(None, None, "fsdp", "tensor")


@pytest.fixture(scope="module")
def model_and_params():
    params = init_params(TINY, jax.random.PRNGKey(0))
    # Uneven routing by construction: scores are in (0, 1), so +6 makes expert 0 every token's choice and -6
    # keeps experts 4-7 from ever being chosen (top-2 always finds a bias-0 expert among 1-3).
    bias = params["moe_layers"]["mlp"]["gate"]["e_score_correction_bias"]
    params["moe_layers"]["mlp"]["gate"]["e_score_correction_bias"] = jnp.broadcast_to(
        jnp.array([6.0, 0, 0, 0, -6, -6, -6, -6]), bias.shape)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (4, 8), 0, TINY.vocab_size)
    step = jax.jit(lambda p, t: K2Model(TINY).apply({"params": p}, t))
    return params, tokens, step(params, tokens)


@pytest.mark.parametrize("spec", MESHES)
def test_sharded_logits_equal_one_device(model_and_params, spec):
    params, tokens, reference = model_and_params
    mesh = make_mesh(spec)
    sharded = jax.device_put(params, param_shardings(TINY, mesh))
    n, E = mesh.shape["expert"], TINY.n_routed_experts
    for name, w in sharded["moe_layers"]["mlp"]["experts"].items():
        assert len(w.addressable_shards) == 8
        for shard in w.addressable_shards:
            assert shard.data.shape[1] == E // n, (name, shard.data.shape)
    with use_mesh(mesh):
        logits = jax.jit(lambda p, t: K2Model(TINY).apply({"params": p}, t))(sharded, tokens)
    np.testing.assert_allclose(logits, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("spec, mode, capacity, combine_rows", [("expert=4,tensor=2", "gather", 1.25, 256),
                                                                 ("data=2,expert=2,tensor=2", "all_to_all", 1.25, 256),
                                                                 ("expert=4,tensor=2", "all_to_all", 0.2, 256),
                                                                 ("expert=4,tensor=2", "all_to_all", 0.2, 0)])
def test_exchanges_equal_dense(spec, mode, capacity, combine_rows, monkeypatch):
    """Both exchanges, with 50 tokens (padded to the token groups), one expert taking every token and half
    the experts idle; capacity 0.2 forces several all-to-all rounds. combine_rows 0: the rows that come back
    are scatter-added onto their tokens (a prompt's many rows) rather than summed by one 0/1 matmul."""
    import k2jax.ops.expert_parallel as ep

    monkeypatch.setattr(ep, "COMBINE_MATMUL_ROWS", combine_rows)
    T, E, K, D, F = 50, 16, 4, 24, 20
    key = jax.random.PRNGKey(5)
    w = experts(key, E, D, F)
    x = jax.random.normal(jax.random.fold_in(key, 2), (T, D))
    idx, wt = routing(jax.random.fold_in(key, 3), T, E, K, skew=6.0)
    reference = moe_dense(x, idx, wt, *w)
    with use_mesh(make_mesh(spec)):
        for impl in ("tiled", "ragged"):
            got = jax.jit(lambda *a: moe_expert_parallel(*a, mode=mode, impl=impl, tile=4,
                                                         capacity_factor=capacity))(x, idx, wt, *w)
            np.testing.assert_allclose(got, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("spec, mode, capacity", [("expert=4,tensor=2", "gather", 1.25),
                                                   ("data=2,expert=2,tensor=2", "all_to_all", 0.2)])
def test_a_layer_read_out_of_the_stacks_equals_its_own_arrays(spec, mode, capacity):
    """The gmm path given every layer's expert stacks and a traced layer index (as a TPU runs it, its
    kernel reading the layer's tiles in place; the plain form on CPU): the forward reads the stacks (given
    zeros as the layer's own arrays, it still equals that layer), and derivatives, for x, the router
    weights and the layer's own arrays, equal the dense reference's."""
    L, T, E, K, D, F = 3, 50, 16, 4, 24, 20
    key = jax.random.PRNGKey(7)
    stacks = tuple(jnp.stack(ws) for ws in zip(*(experts(jax.random.fold_in(key, 10 + i), E, D, F)
                                                  for i in range(L))))
    x = jax.random.normal(jax.random.fold_in(key, 2), (T, D))
    idx, wt = routing(jax.random.fold_in(key, 3), T, E, K, skew=6.0)
    layer = 1
    own = tuple(s[layer] for s in stacks)

    def ep(x, wt, own, layer):
        return moe_expert_parallel(x, idx, wt, *own, mode=mode, impl="gmm", tile=4, capacity_factor=capacity,
                                   stacks=jax.lax.stop_gradient(stacks), layer=layer)

    def loss(fn):
        return lambda x, wt, w: jnp.sum(jnp.sin(fn(x, wt, w)))

    with use_mesh(make_mesh(spec)):
        zeros = tuple(jnp.zeros_like(w) for w in own)
        got = jax.jit(ep)(x, wt, zeros, jnp.int32(layer))
        np.testing.assert_allclose(got, moe_dense(x, idx, wt, *own), atol=1e-5, rtol=1e-5)
        grads = jax.jit(jax.grad(loss(lambda x, wt, w: ep(x, wt, w, jnp.int32(layer))), argnums=(0, 1, 2)))(
            x, wt, own)
    want = jax.grad(loss(lambda x, wt, w: moe_dense(x, idx, wt, *w)), argnums=(0, 1, 2))(x, wt, own)
    for a, b in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_plan_per_device_bytes_match_the_placed_arrays(model_and_params):
    spec = "data=2,expert=2,tensor=2"
    mesh = make_mesh(spec)
    p = plan(TINY, spec, dtype="float32", batch=4, max_len=16)
    # What the devices really hold once the params are placed, and one copy times each tensor's replication.
    held = one_copy_x_replication = 0
    placed = jax.device_put(model_and_params[0], param_shardings(TINY, mesh))
    for a in jax.tree_util.tree_leaves(placed):
        held += sum(s.data.nbytes for s in a.addressable_shards)
        distinct = {tuple((i.start, i.stop) for i in idx) for idx in a.sharding.devices_indices_map(a.shape).values()}
        one_copy_x_replication += a.nbytes * 8 / len(distinct)
    params_rows = [r for r in p.rows if not r[0].startswith(("KV cache", "sampling state"))]
    assert sum(r[1] for r in params_rows) * p.devices == held == one_copy_x_replication
    assert sum(r[2] for r in params_rows) == sum(a.nbytes for a in jax.tree_util.tree_leaves(placed))
    # KV cache: the pool the runtime makes, split over the batch's axes (data, expert; not tensor).
    kv = [r for r in p.rows if r[0].startswith("KV cache")][0]
    assert kv[2] == TINY.num_hidden_layers * 4 * 16 * (TINY.kv_lora_rank + TINY.qk_rope_head_dim) * 4
    cache = init_cache(TINY, 4, 16, "float32", mesh=mesh)
    pool = [s.data.nbytes for a in jax.tree_util.tree_leaves(cache.pages) for s in a.addressable_shards]
    assert kv[1] * p.devices == sum(pool)
    assert p.per_device * p.devices == pytest.approx(p.total * p.replication)


def test_plan_command_full_kimi_k2(capsys):
    assert cli_main(["plan", str(CONFIGS / "kimi_k2.json"), "--mesh", "expert=64,tensor=4"]) == 0
    out = capsys.readouterr().out
    experts_bytes = 60 * 384 * 3 * 7168 * 2048 * 2  # 60 MoE blocks, bf16
    line = next(ln for ln in out.splitlines() if ln.startswith("routed experts"))
    assert f"{experts_bytes / 256 / 2**30:.3g} GiB" in line  # 7.38 GiB
    assert "TPU v5p" in out and "H200" in out and "fall back" not in out
    # 384 experts on expert=5: replicated, and the plan says so and what it costs
    assert cli_main(["plan", str(CONFIGS / "kimi_k2.json"), "--mesh", "expert=5"]) == 0
    out = capsys.readouterr().out
    # the dense and shared MLPs too: their hidden dims (18432, 2048) split over expert as well
    assert "9 params fall back" in out and "moe_layers.mlp.experts.gate_proj" in out
    assert f"fallback cost: +{experts_bytes * 4 / 5 / 2**40:.3g} TiB per device" in out  # 1.48 TiB


def test_full_width_kimi_k2_moe_block_compiles_with_an_eighth_per_device():
    from bench.compile_full_width import compile_block

    compiled, block_bytes, _ = compile_block("expert=8", tokens=64)
    cfg = K2Config.from_hf_config(CONFIGS / "kimi_k2.json").replace(num_hidden_layers=2, first_k_dense_replace=1)
    moe = abstract_params(cfg, jnp.bfloat16)["moe_layers"]
    expert_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree_util.tree_leaves(moe["mlp"]["experts"]))
    assert expert_bytes > 0.98 * block_bytes
    inputs = 64 * 7168 * 2 + 64 * 4 + 64  # hidden states, positions, valid flags: batch 1 is not split
    mesh = make_mesh("expert=8")
    shard = param_shardings(cfg, mesh)["moe_layers"]
    # each param's bytes over the devices its spec splits it over (routed and shared experts over expert=8)
    per_device = sum(a.size // a.shape[0] * a.dtype.itemsize / math.prod(mesh.shape[n] for n in jax.tree.leaves(
        tuple(s.spec))) for a, s in zip(jax.tree.leaves(moe), jax.tree.leaves(shard)))
    expected = per_device + inputs
    args = compiled.memory_analysis().argument_size_in_bytes
    assert args == pytest.approx(expected, rel=1e-3)
    assert args / (block_bytes / 8) < 1.1


def test_param_shardings_and_init_inside_use_mesh():
    """Inside `with use_mesh(mesh):` (where users run their steps) the shape-only init must not trip over the
    activation constraints."""
    mesh = make_mesh("expert=8")
    outside = param_shardings(TINY, mesh)
    with use_mesh(mesh):
        inside = param_shardings(TINY, mesh)
        params = init_params(TINY)
    assert jax.tree.map(lambda s: s.spec, inside) == jax.tree.map(lambda s: s.spec, outside)
    assert jax.tree.structure(params) == jax.tree.structure(outside)


COLLECTIVES = ("psum", "pmax", "pmin", "all_gather", "reduce_scatter", "ppermute", "all_to_all")


def collectives_under_cond(jaxpr, under=False, found=None) -> set:
    """Names of the collectives that run inside a lax.cond branch anywhere in `jaxpr` (a jax.make_jaxpr
    result). A collective there completes only if every device of its group takes the same branch."""
    found = set() if found is None else found
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        if under and eqn.primitive.name.startswith(COLLECTIVES):
            found.add(eqn.primitive.name)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if hasattr(getattr(sub, "jaxpr", sub), "eqns"):
                    collectives_under_cond(sub, under or eqn.primitive.name == "cond", found)
    return found


@pytest.mark.parametrize("spec", ["expert=4,tensor=2", "data=2,expert=4", "data=2,expert=2,tensor=2"])
@pytest.mark.parametrize("mode, capacity", [("all_to_all", 0.3), ("gather", 1.25)])
def test_exchange_gradients_equal_dense(spec, mode, capacity):
    """Gradients through both exchanges (all-to-all with several rounds), also when tokens are split over
    data: then the experts' weight gradients are summed over data, a psum that used to run inside the tile
    loop's per-device cond and never complete on XLA:CPU (the process aborts). Checked statically first, so a regression fails here instead: the only
    collectives under a cond are the all-to-all rounds (their predicate is pmax'd over all token groups)."""
    T, E, K, D, F = 48, 16, 4, 24, 20
    key = jax.random.PRNGKey(0)
    w = experts(key, E, D, F)
    x = jax.random.normal(jax.random.fold_in(key, 2), (T, D))
    idx, wt = routing(jax.random.fold_in(key, 3), T, E, K, skew=3.0)

    def loss(fn):
        return lambda x, wt, w: jnp.sum(jnp.sin(fn(x, idx, wt, *w)))

    reference = jax.grad(loss(moe_dense), argnums=(0, 1, 2))(x, wt, w)
    sharded = jax.grad(loss(lambda *a: moe_expert_parallel(*a, mode=mode, tile=4, capacity_factor=capacity)),
                       argnums=(0, 1, 2))
    with use_mesh(make_mesh(spec)):
        assert collectives_under_cond(jax.make_jaxpr(sharded)(x, wt, w)) <= {"all_to_all"}
        got = jax.jit(sharded)(x, wt, w)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(reference)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("R,K,e,E", [(64, 8, 6, 384), (5, 3, 4, 8), (7, 4, 2, 6), (3, 2, 8, 16)])
@pytest.mark.parametrize("matmul_rows", [256, 0], ids=["matmul", "gather"])
def test_combine_equals_its_plain_form(R, K, e, E, matmul_rows, monkeypatch):
    """The exchange's combine (a matmul of the weights laid out [R, M], or each row gathering its own local
    slots' outputs) equals its plain form (every slot scattered onto its row), with rows holding from none to
    min(K, e) local experts, e >= K and e < K."""
    from k2jax.ops import expert_parallel
    from k2jax.ops.expert_parallel import _combine, _combine_plain

    monkeypatch.setattr(expert_parallel, "COMBINE_MATMUL_ROWS", matmul_rows)
    rng = np.random.default_rng(R)
    idx = np.stack([rng.choice(E, K, replace=False) for _ in range(R)])
    lid = np.where(idx < e, idx, e)  # experts 0 .. e-1 are this device's; e marks the others'
    M = R * min(K, e)
    order = np.argsort(lid.reshape(-1), kind="stable")[:M]
    y = jnp.asarray(rng.standard_normal((M, 11)), jnp.bfloat16)
    w = jnp.asarray(rng.random((R, K)), jnp.float32)
    args = (y, jnp.asarray(order), jnp.asarray(lid), w, e)
    got, want = np.asarray(_combine(*args)), np.asarray(_combine_plain(*args))
    assert (lid < e).any(1).sum() > 0 and np.abs(want).max() > 0.1
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
