"""Any config on any mesh (8 simulated CPU devices): dims the mesh does not divide fall back (replicated, or
the dividing part of a multi-axis rule) instead of being refused, and the sharded model still equals one
device; logits keep exactly the config's vocabulary; the plan's bytes are what a sharded load holds."""

import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import k2jax
from k2jax import K2Config, K2Model, generate, make_train_step
from k2jax.checkpoint.convert import main as convert_main
from k2jax.plan import format_plan, plan
from k2jax.placement import fallbacks, param_shardings
from k2jax.sharding import dividing_axes, logical_to_spec, make_mesh, use_mesh
from k2jax.testing import random_params, write_release_checkpoint
from tests.conftest import CONFIGS

TWO_LAYERS = dict(num_hidden_layers=2, first_k_dense_replace=1)  # one dense, one MoE block: one compile each
TINY_HF = json.loads((CONFIGS / "tiny.json").read_text()) | TWO_LAYERS
# Odd sizes: vocabularies no tensor size divides, 3 / 5 heads, 6 / 10 experts, hidden sizes not powers of 2.
ODD97 = TINY_HF | dict(vocab_size=97, num_attention_heads=3, num_key_value_heads=3, n_routed_experts=6,
                       hidden_size=96, intermediate_size=80, moe_intermediate_size=40)
ODD101 = TINY_HF | dict(vocab_size=101, num_attention_heads=5, num_key_value_heads=5, n_routed_experts=10,
                        hidden_size=75, intermediate_size=72, moe_intermediate_size=24, q_lora_rank=24)
CONFIG_DICTS = {"tiny": TINY_HF, "bench": json.loads((CONFIGS / "bench.json").read_text()) | TWO_LAYERS,
                "odd97": ODD97, "odd101": ODD101}
CONFIGS_BY_NAME = {k: K2Config.from_hf_config(v) for k, v in CONFIG_DICTS.items()}

# (config, mesh, batch, params expected to fall back): every mesh of the issue, each odd property at least once.
CASES = [
    ("tiny", "data=4,tensor=2", 3, []),  # tensor=2 on 8 devices; a batch of 3 on data=4 is replicated
    ("bench", "tensor=8", 2, []),
    ("odd97", "expert=4,tensor=2", 2, ["embed_tokens", "lm_head", "moe_layers.mlp.experts.gate_proj"]),
    ("odd97", "expert=8", 3, ["moe_layers.mlp.experts.gate_proj"]),  # E=6 on expert=8
    ("odd101", "tensor=8", 2, ["lm_head", "dense_layers.self_attn.q_b_proj", "moe_layers.self_attn.o_proj"]),
    ("odd101", "data=2,expert=4", 3, ["moe_layers.mlp.experts.up_proj"]),  # batch 3 on data=2 too
    ("odd101", "fsdp=2,tensor=4", 2, ["embed_tokens", "dense_layers.mlp.gate_proj"]),  # hidden 75 on fsdp=2
]


def quiet_shardings(cfg, mesh):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return param_shardings(cfg, mesh)


def forward(cfg):
    return jax.jit(lambda p, t: K2Model(cfg).apply({"params": p}, t))


@pytest.fixture(scope="module")
def references():
    """Per config: (params, tokens [3, 8], one-device logits), built on first use."""
    cache = {}

    def get(name):
        if name not in cache:
            cfg = CONFIGS_BY_NAME[name]
            # std ~ 1/sqrt(D) like a trained model's: bench's D=1024 at tiny's 0.15 gives logits of +-100,
            # where float32 summation order alone (tensor-parallel partial sums) moves them by more than 1e-5
            params = random_params(cfg, seed=1, scale=min(0.15, 1.2 / cfg.hidden_size**0.5))
            tokens = jax.random.randint(jax.random.PRNGKey(2), (3, 8), 0, cfg.vocab_size)
            cache[name] = params, tokens, forward(cfg)(params, tokens)
        return cache[name]

    return get


def test_the_fallback_rule():
    assert dividing_axes(("data", "fsdp"), 12, {"data": 2, "fsdp": 3}) == ("data", "fsdp")
    assert dividing_axes(("data", "fsdp"), 6, {"data": 4, "fsdp": 3}) == ("fsdp",)
    assert dividing_axes(("data", "fsdp"), 4, {"data": 4, "fsdp": 3}) == ("data",)
    assert dividing_axes(("data", "fsdp"), 3, {"data": 2, "fsdp": 1}) == ("fsdp",)  # size-1 axes stay
    assert dividing_axes(("tensor",), 97, {"tensor": 2}) == ()
    mesh = {"data": 1, "fsdp": 1, "expert": 4, "tensor": 2}
    assert logical_to_spec(("vocab", "embed"), (97, 64), mesh) == jax.sharding.PartitionSpec(None, "fsdp")
    assert logical_to_spec(("vocab", "embed"), (98, 64), mesh) == jax.sharding.PartitionSpec("tensor", "fsdp")


@pytest.mark.parametrize("name, spec, batch, expected", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_sharded_logits_equal_one_device_on_any_mesh(references, name, spec, batch, expected):
    cfg = CONFIGS_BY_NAME[name]
    params, tokens, reference = references(name)
    tokens, reference = tokens[:batch], reference[:batch]
    mesh = make_mesh(spec)
    fell_back = {f.name for f in fallbacks(cfg, dict(mesh.shape))}
    assert set(expected) <= fell_back and bool(expected) == bool(fell_back), fell_back
    with pytest.warns(UserWarning) if expected else warnings.catch_warnings():
        shardings = param_shardings(cfg, mesh)
    sharded = jax.device_put(params, shardings)
    with use_mesh(mesh):
        logits = forward(cfg)(sharded, tokens)
    assert logits.shape == (batch, 8, cfg.vocab_size)
    np.testing.assert_allclose(logits, reference, atol=1e-5, rtol=1e-5)


def test_one_warning_per_param_naming_it():
    cfg = CONFIGS_BY_NAME["odd97"]
    with pytest.warns(UserWarning) as record:
        param_shardings(cfg, make_mesh("expert=4,tensor=2"))
    lines = [str(w.message) for w in record if str(w.message).startswith("k2jax.placement")]
    names = [ln.split()[2] for ln in lines]
    assert sorted(names) == sorted(f.name for f in fallbacks(cfg, dict(make_mesh("expert=4,tensor=2").shape)))
    assert len(names) == len(set(names)) and all("\n" not in ln for ln in lines)
    assert any(ln.startswith("k2jax.placement: param embed_tokens [97, 96]: dim 97 not divisible by tensor=2,expert=4 "
                             "-> replicated; +") for ln in lines), lines


def test_greedy_generation_on_an_odd_vocabulary_mesh_equals_one_device(references):
    """Vocabulary 97 on tensor=2 (replicated, not padded): the logits are exactly 97 wide, so greedy decoding
    cannot emit an id >= 97; the sharded tokens equal one device's."""
    cfg = CONFIGS_BY_NAME["odd97"]
    params = references("odd97")[0]
    prompts = [[5, 17, 96], [3], [90, 2, 4, 8, 1]]  # 3 rows: padded to the batch shards by generate
    want, want_len = generate(K2Model(cfg), params, prompts, 5)
    mesh = make_mesh("expert=4,tensor=2")
    got, got_len = generate(K2Model(cfg), jax.device_put(params, quiet_shardings(cfg, mesh)), prompts, 5,
                            mesh=mesh)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_len, want_len)
    assert got.max() < cfg.vocab_size and got.min() >= 0


def test_train_step_on_a_mesh_that_divides_neither_batch_nor_experts(references):
    """make_train_step on data=2,expert=4 with 10 experts and a batch of 3: same loss and updated params as
    one device."""
    cfg = CONFIGS_BY_NAME["odd101"]
    params, tokens, _ = references("odd101")
    batch = {"tokens": tokens}
    plain = make_train_step(K2Model(cfg), optax.sgd(0.1))
    copy = jax.tree.map(jnp.copy, params)  # the steps donate their params
    want_params, _, want = plain(copy, plain.init(copy), batch)
    mesh = make_mesh("data=2,expert=4")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = make_train_step(K2Model(cfg), optax.sgd(0.1), mesh)
    placed = step.place(params)
    got_params, _, got = step(placed, step.init(placed), batch)
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got_params), jax.tree.leaves(want_params)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The odd configs written in the release layout and converted (bf16), by config name."""
    out = {}
    for name in ("odd97", "odd101"):
        tmp = tmp_path_factory.mktemp(name)
        src = write_release_checkpoint(CONFIG_DICTS[name], tmp / "src", seed=3, fast=True)
        assert convert_main([str(src), str(tmp / "dst"), "--quiet"]) == 0
        out[name] = tmp / "dst"
    return out


@pytest.mark.parametrize("name, spec", [("odd97", "expert=4,tensor=2"), ("odd97", "expert=8"),
                                        ("odd101", "fsdp=2,tensor=4"), ("odd101", "data=2,expert=4")])
def test_plan_bytes_equal_a_sharded_load(converted, name, spec):
    """Fallback cases: what `plan` says each device holds is what k2jax.load puts on each device."""
    mesh = make_mesh(spec)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg, params = k2jax.load(converted[name], mesh=mesh)
    per_device = {d: 0 for d in jax.devices()}
    for a in jax.tree.leaves(params):
        assert a.dtype in (jnp.bfloat16, jnp.float32)
        for s in a.addressable_shards:
            per_device[s.device] += s.data.nbytes
    p = plan(cfg, spec)
    assert p.fallbacks and {f.name for f in p.fallbacks} == {f.name for f in fallbacks(cfg, dict(mesh.shape))}
    assert len(set(per_device.values())) == 1  # even over the axes that divide: every device holds the same
    assert next(iter(per_device.values())) == pytest.approx(p.per_device, rel=0.01)
    text = format_plan(p)
    assert f"{len(p.fallbacks)} params fall back" in text and "fallback cost: +" in text
