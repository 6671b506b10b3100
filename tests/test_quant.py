"""Quantized weights on device (FP8 128x128 blocks, INT4 groups of 32): parity with transformers on the
dequantized weights, the kernels' fast paths against their plain references, and the weights held quantized.

The parity tests quantize random params (k2jax.nn.quantized.quantize_params), write their dequantized values
as an HF checkpoint for the oracle, and compare its float32 logits with k2jax computing in float32 from the
quantized leaves, on one device and on an expert=4,tensor=2 mesh.
"""

import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from k2jax import K2Config, K2Model, abstract_params, make_mesh, param_shardings, use_mesh
from k2jax.aot.topology import has_libtpu
from k2jax.checkpoint import save_hf
from k2jax.nn.model import expert_views
from k2jax.nn.quantized import dequantize_params, quantize_params
from k2jax.ops.attention import attend_absorbed, attend_expanded
from k2jax.ops.expert_parallel import moe_expert_parallel
from k2jax.ops.matmul import einsum, einsum_reference
from k2jax.ops.moe import moe_dense, moe_grouped
from k2jax.ops.quant import QuantizedWeight, dequantize_weight, held_shapes, materialize, quantize_weight, unpack_int4
from k2jax.testing import random_params
from tests.test_parity import CONFIGS

TOL = dict(atol=1e-4, rtol=1e-4)
EXPERTS = ("gate_proj", "up_proj", "down_proj")


def hf_config(name, quant):
    cfg = dict(CONFIGS[name])
    if quant == "int4":  # groups of 32 inputs must divide the routed experts' hidden dim (down_proj's input)
        cfg["moe_intermediate_size"] = 32
    return cfg


@pytest.fixture(scope="module", params=[(n, q) for q in ("fp8", "int4") for n in CONFIGS])
def case(request, oracle, tmp_path_factory):
    name, quant = request.param
    cfg = K2Config.from_hf_config(hf_config(name, quant))
    qparams = quantize_params(random_params(cfg, seed=3), cfg, quant)
    d = tmp_path_factory.mktemp(f"{name}_{quant}")
    save_hf(dequantize_params(qparams), cfg, d)
    ids = np.random.default_rng(5).integers(0, cfg.vocab_size, (8, 7))
    mask = np.ones(ids.shape, np.int64)
    mask[1, :2] = 0
    want = oracle.run({"load": str(d), "inputs": {"input_ids": ids, "attention_mask": mask}})["logits"]
    return dict(cfg=cfg, quant=quant, qparams=qparams, ids=ids, mask=mask, want=want)


def _forward(cfg):
    return jax.jit(lambda p, t, m: K2Model(cfg).apply({"params": p}, t, None, m))


def _close(got, case):
    valid = case["mask"].astype(bool)
    got, want = np.asarray(got)[valid], case["want"][valid]
    np.testing.assert_allclose(got, want, **TOL)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def test_parity_one_device(case):
    q = case["qparams"]
    experts = q["moe_layers"]["mlp"]["experts"]
    assert all(isinstance(experts[k], QuantizedWeight) and experts[k].fmt == case["quant"] for k in EXPERTS)
    _close(_forward(case["cfg"])(q, jnp.asarray(case["ids"]), jnp.asarray(case["mask"])), case)


def test_parity_expert_tensor_mesh(case):
    cfg, quant = case["cfg"], case["quant"]
    mesh = make_mesh("expert=4,tensor=2")
    params = jax.device_put(case["qparams"], param_shardings(cfg, mesh, quant=quant))
    gate = params["moe_layers"]["mlp"]["experts"]["gate_proj"]
    assert len(gate.values.sharding.device_set) == 8 and gate.values.addressable_shards[0].data.shape[1] * 4 == \
        gate.values.shape[1]  # experts split over `expert`
    with use_mesh(mesh):
        got = _forward(cfg)(params, jnp.asarray(case["ids"]), jnp.asarray(case["mask"]))
    _close(got, case)


# ------------------------------------------------------------------------------ formats, independently checked
def test_fp8_blocks_and_int4_groups_match_a_loop():
    """dequantize against an explicit loop over blocks / groups (partial edge blocks included)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((200, 3, 50)).astype(np.float32)  # In 200, Out 150: partial 128-blocks
    q = quantize_weight(w, "fp8")
    assert q.values.dtype == ml_dtypes.float8_e4m3fn and q.scales.shape == (2, 2)
    ref = np.empty((200, 150), np.float32)
    v = q.values.astype(np.float32).reshape(200, 150)
    for i in range(200):
        for o in range(150):
            ref[i, o] = v[i, o] * q.scales[i // 128, o // 128]
    np.testing.assert_array_equal(dequantize_weight(q).reshape(200, 150), ref)
    np.testing.assert_allclose(ref.reshape(w.shape), w, rtol=0.07, atol=1e-3)

    w4 = rng.standard_normal((2, 64, 6)).astype(np.float32)  # lead 2, In 64 (2 groups), Out 6
    q4 = quantize_weight(w4, "int4", lead_ndim=1)
    assert q4.values.dtype == np.uint8 and q4.values.shape == (2, 64, 3) and q4.scales.shape == (2, 2, 6)
    nib = unpack_int4(q4.values)
    assert nib.min() >= -8 and nib.max() <= 7
    lo = (q4.values & 0xF).astype(np.int32) - 8  # column 2c in the low nibble
    np.testing.assert_array_equal(nib[..., 0::2], lo)
    ref4 = np.empty_like(w4)
    for e in range(2):
        for i in range(64):
            for o in range(6):
                ref4[e, i, o] = nib[e, i, o] * np.float32(q4.scales[e, i // 32, o])
    np.testing.assert_array_equal(dequantize_weight(q4), ref4)
    err = np.abs(ref4 - w4).max(axis=1, keepdims=True) / np.abs(w4).max(axis=1, keepdims=True)
    assert err.max() < 0.1  # within half a step of 1/7 of the group's absmax


# ------------------------------------------------------------------ fp8 weights read as held (TPU decode)
@pytest.mark.parametrize("eq,x_shape,w_shape,in_ndim", [
    ("BTNV,NVD->BTD", (1, 1, 4, 64), (4, 64, 300), 2),   # o_proj: two input dims, 2 input blocks
    ("BTQ,QNH->BTNH", (2, 1, 200), (200, 3, 72), 1),      # q_b_proj: two output dims across blocks, a short block
    ("BTD,DQ->BTQ", (3, 1, 384), (384, 256), 1),          # q_a_proj
])
def test_fp8_blocks_form_against_float64(eq, x_shape, w_shape, in_ndim):
    """einsum_fp8_blocks (a TPU decode step's form: rows repeated per input block, the fp8 values read as
    held, each block's scales taken after the dot) against the float64 product with the dequantized weight.
    It does not round the dequantized weight to bf16, so it is at least as close as the dequantize-then-dot
    reference, within the bf16 rounding of the result."""
    from k2jax.ops.matmul import einsum_fp8_blocks

    rng = np.random.default_rng(0)
    w32 = rng.standard_normal(w_shape).astype(np.float32) * 0.05
    w32[..., :17] *= 8.0  # output blocks of different scales
    w = quantize_weight(w32, "fp8", in_ndim)
    x = jnp.asarray(rng.standard_normal(x_shape), jnp.bfloat16)
    exact = np.einsum(eq, np.asarray(x, np.float64), np.asarray(w.dequantize(jnp.float32), np.float64))
    got = np.asarray(jax.jit(lambda x, w: einsum_fp8_blocks(eq, x, w))(x, w), np.float64)
    ref = np.asarray(einsum_reference(eq, x, w, jnp.bfloat16), np.float64)
    ulp = np.abs(exact).max() * 2.0 ** -8
    assert np.abs(got - exact).max() <= np.abs(ref - exact).max() + 0.5 * ulp
    assert np.abs(got - exact).max() <= 1.5 * ulp
    # each block's scale is used: one input block's doubled is far off
    wrong = QuantizedWeight(w.values, jnp.asarray(w.scales).at[-1].multiply(2.0), "fp8", in_ndim)
    assert np.abs(np.asarray(einsum_fp8_blocks(eq, x, wrong), np.float64) - exact).max() > 10 * ulp


def test_fp8_blocks_form_applies_to_few_rows_per_device():
    """block_rows_apply: fp8 weights of one layer in bf16 at most MXU_ROWS rows x input blocks, the rows a
    device holds: on a data=8 mesh, 64 rows of a 7168-input weight (56 blocks) are 8 per device, too many;
    8 rows are one per device. Off TPU the step keeps the dequantizing form (lax.platform_dependent), so
    einsum's result on CPU is unchanged."""
    from k2jax.ops.matmul import MXU_ROWS, block_rows_apply
    from k2jax.sharding import make_mesh, use_mesh

    w = held_shapes((7168, 1536), "fp8")
    bf = jnp.bfloat16
    x = lambda B: jax.ShapeDtypeStruct((B, 1, 7168), bf)
    assert MXU_ROWS // 56 == 2
    assert block_rows_apply("BTD,DQ->BTQ", x(2), w, bf) and not block_rows_apply("BTD,DQ->BTQ", x(3), w, bf)
    assert not block_rows_apply("BTD,DQ->BTQ", x(1), w, jnp.float32)  # the bf16 compute dtype only
    assert not block_rows_apply("BTD,DQ->BTQ", x(1), held_shapes((7168, 1536), "int4"), bf)
    assert not block_rows_apply("BTD,DQ->BTQ", x(1), held_shapes((4, 7168, 1536), "fp8", 1, 1), bf)  # a stack
    assert not block_rows_apply("BTD,QD->BTQ", x(1), w, bf)  # not x's trailing dims against w's inputs
    with use_mesh(make_mesh("data=8", jax.devices()[:8])):
        assert block_rows_apply("BTD,DQ->BTQ", x(16), w, bf) and not block_rows_apply("BTD,DQ->BTQ", x(64), w, bf)
    rng = np.random.default_rng(1)
    wq = quantize_weight(rng.standard_normal((256, 384)).astype(np.float32), "fp8")
    xv = jnp.asarray(rng.standard_normal((1, 1, 256)), bf)
    # Against einsum over the dequantized weight, the CPU form itself: einsum_reference's unpadded 1-row dot
    # rounds differently on some CPUs (AVX512-BF16/AMX: 1 ulp at one element of 384) from einsum's rows padded
    # to CPU_MIN_ROWS. einsum against einsum_reference: test_kernels_on_quantized_equal_reference.
    held = jax.jit(lambda x, w: einsum("BTD,DQ->BTQ", x, w, dtype=bf))(xv, wq)
    plain = jax.jit(lambda x, w: einsum("BTD,DQ->BTQ", x, materialize(w, bf)))(xv, wq)
    np.testing.assert_array_equal(np.asarray(held), np.asarray(plain))


@pytest.mark.skipif(not has_libtpu() and os.environ.get("K2JAX_REQUIRE_TPU_AOT") != "1",
                    reason="libtpu is not installed (pip install 'k2jax[tpu-aot]')")
@pytest.mark.parametrize("name,shape,in_ndim", [("o_proj", (64, 128, 7168), 2), ("q_b_proj", (1536, 64, 192), 1),
                                                ("q_a_proj", (7168, 1536), 1)])
def test_fp8_decode_reads_the_layers_weights_as_held_on_tpu(name, shape, in_ndim):
    """Compiled for v5p by libtpu: a scan over 8 layers of Kimi K2's fp8 attention weights, one decode row,
    through einsum (the model's matmul). Each layer's fp8 values are read in place out of the stack, about
    once: the program moves at most 1.2x the stack's bytes (1.07 to 1.13x when written), where the
    dequantize-then-dot form moves 9 to 17x."""
    from k2jax.aot import hlo
    from k2jax.aot.topology import load_topology

    sh = jax.sharding.SingleDeviceSharding(load_topology("v5p:2x2x1").devices[0])
    w = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                     held_shapes((8,) + shape, "fp8", in_ndim, 1))
    ins, outs = "IJ"[:in_ndim], "OP"[:len(shape) - in_ndim]
    eq = f"BT{ins},{ins}{outs}->BT{outs}"
    x = jax.ShapeDtypeStruct((1, 1) + shape[:in_ndim], jnp.bfloat16, sharding=sh)

    def layers(x, w):
        return jax.lax.scan(lambda c, wl: (c + einsum(eq, x, wl, dtype=jnp.bfloat16).astype(jnp.float32).sum(),
                                           None), 0.0, w)[0]

    moved = hlo.traffic(hlo.parse(jax.jit(layers).lower(x, w).compile().as_text())).bytes
    held = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(w))
    assert moved <= 1.2 * held, (name, moved / held)


# ------------------------------------------------------------------------------ fast paths == references
@pytest.mark.parametrize("quant", ["fp8", "int4"])
def test_kernels_on_quantized_equal_reference(quant):
    key = jax.random.PRNGKey(0)
    E, D, F, K = 8, 64, 96, 2
    ks = jax.random.split(key, 8)
    stacks = [quantize_weight(jax.random.normal(k, s) * 0.2, quant, lead_ndim=1)
              for k, s in zip(ks[:3], [(E, D, F), (E, D, F), (E, F, D)])]
    plain = [w.dequantize() for w in stacks]
    assert not np.allclose(plain[0], jax.random.normal(ks[0], (E, D, F)) * 0.2)  # lossy: really quantized
    for T in (1, 3, 40):  # gathered (decode), batched + tiles, overflow tiles
        x = jax.random.normal(ks[3], (T, D))
        idx = jax.vmap(lambda k: jax.random.permutation(k, E)[:K])(jax.random.split(ks[4], T)).astype(jnp.int32)
        wt = jax.random.uniform(ks[5], (T, K))
        want = moe_dense(x, idx, wt, *plain)
        np.testing.assert_allclose(moe_dense(x, idx, wt, *stacks), want, atol=1e-5, rtol=1e-5)
        for impl, kw in (("tiled", {}), ("tiled", dict(capacity=2, tile=4)), ("ragged", {}), ("gmm", {})):
            got = jax.jit(lambda *a: moe_grouped(*a, impl=impl, **kw))(x, idx, wt, *stacks)
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5, err_msg=f"{impl} {kw} T={T}")

    # einsum on a multi-dim input (o_proj's [N, V, D]) and absorbed attention with a quantized kv_b
    w_o = quantize_weight(jax.random.normal(ks[6], (4, 32, 64)) * 0.2, "fp8" if quant == "fp8" else "int4", in_ndim=2)
    x = jax.random.normal(ks[7], (2, 1, 4, 32))
    np.testing.assert_allclose(jax.jit(lambda a, w: einsum("BTNV,NVD->BTD", a, w))(x, w_o),
                               einsum_reference("BTNV,NVD->BTD", x, w_o), atol=1e-5, rtol=1e-5)
    assert not np.allclose(einsum_reference("BTNV,NVD->BTD", x, w_o),
                           einsum_reference("BTNV,NVD->BTD", x, w_o.dequantize().transpose(1, 0, 2)
                                            .reshape(4, 32, 64)), atol=1e-3)  # the in/out layout matters
    R, N, Kd, V, S = 32, 4, 16, 12, 9
    kv_b = quantize_weight(jax.random.normal(ks[0], (R, N, Kd + V)) * 0.3, quant)
    q_nope, q_pe = jax.random.normal(ks[1], (2, 1, N, Kd)), jax.random.normal(ks[2], (2, 1, N, 8))
    ckv, k_pe = jax.random.normal(ks[3], (2, S, R)), jax.random.normal(ks[4], (2, S, 8))
    mask = jnp.ones((2, 1, S), bool)
    np.testing.assert_allclose(attend_absorbed(q_nope, q_pe, ckv, k_pe, kv_b, mask, 0.2),
                               attend_expanded(q_nope, q_pe, ckv, k_pe, kv_b.dequantize(), mask, 0.2),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("quant, F", [("fp8", 256), ("int4", 64)])
def test_expert_parallel_scales_sharded_with_blocks(quant, F):
    """A shard of F holding whole blocks: scales split over `tensor` with their blocks (no replication)."""
    E, D, K, T = 8, 128, 2, 16
    ks = jax.random.split(jax.random.PRNGKey(1), 6)
    stacks = [quantize_weight(jax.random.normal(k, s) * 0.1, quant, lead_ndim=1)
              for k, s in zip(ks[:3], [(E, D, F), (E, D, F), (E, F, D)])]
    x = jax.random.normal(ks[3], (T, D))
    idx = jax.vmap(lambda k: jax.random.permutation(k, E)[:K])(jax.random.split(ks[4], T)).astype(jnp.int32)
    wt = jax.random.uniform(ks[5], (T, K))
    want = moe_dense(x, idx, wt, *[w.dequantize() for w in stacks])
    mesh = make_mesh("expert=4,tensor=2")
    from k2jax.ops.quant import scale_partition
    from jax.sharding import PartitionSpec as P

    assert scale_partition(stacks[0], P("expert", None, "tensor"), dict(mesh.shape)) == ("expert", None, "tensor")
    assert scale_partition(stacks[2], P("expert", "tensor", None), dict(mesh.shape)) == ("expert", "tensor", None)
    with use_mesh(mesh):
        for impl in ("tiled", "gmm"):  # gmm: each device's experts through the kernel (interpreted on CPU)
            got = jax.jit(lambda *a: moe_expert_parallel(*a, tile=4, impl=impl))(x, idx, wt, *stacks)
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5, err_msg=impl)


# ------------------------------------------------------------------------------ held, not expanded
WIDE = dict(CONFIGS["kimi_like"], hidden_size=256, moe_intermediate_size=128, n_routed_experts=64,
            num_experts_per_tok=2, num_hidden_layers=2, q_lora_rank=64, kv_lora_rank=64)


@pytest.mark.parametrize("quant", ["fp8", "int4"])
def test_held_quantized_and_decode_temp_far_below_a_layer_of_experts(quant):
    cfg = K2Config.from_hf_config(WIDE)
    shapes = abstract_params(cfg, jnp.bfloat16, quant=quant)
    params = quantize_params(random_params(cfg, np.float32), cfg, quant)
    experts = params["moe_layers"]["mlp"]["experts"]
    for k in EXPERTS:
        w = experts[k]
        if quant == "fp8":
            assert w.values.dtype == jnp.float8_e4m3fn and w.values.shape == w.shape
        else:
            assert w.values.dtype == jnp.uint8 and w.values.shape[-1] * 2 == w.shape[-1]
        assert jax.tree.map(lambda a: (a.shape, a.dtype), w) == jax.tree.map(lambda a: (a.shape, a.dtype), subtree_k(
            shapes, k))
    attn = params["moe_layers"]["self_attn"]["kv_b_proj"]
    assert isinstance(attn, QuantizedWeight) == (quant == "fp8")
    assert not isinstance(params["moe_layers"]["mlp"]["gate"]["kernel"], QuantizedWeight)
    assert not isinstance(params["lm_head"], QuantizedWeight)
    bf16_layer = sum(np.prod(experts[k].shape[1:]) * 2 for k in EXPERTS)  # one layer's experts in bf16
    held = sum(experts[k].nbytes for k in EXPERTS)
    assert held <= (0.51 if quant == "fp8" else 0.3) * bf16_layer * cfg.num_moe_layers

    from k2jax.runtime.cache import init_cache

    model = K2Model(cfg, jnp.bfloat16)
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a, params)
    cache = init_cache(cfg, 1, 64, "bfloat16")
    tok = jnp.zeros((1, 1), jnp.int32)
    for p in (params, expert_views(params)):
        compiled = jax.jit(lambda p, c: model.apply({"params": p}, tok, None, None, c)).lower(p, cache).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes
        assert temp < 0.25 * bf16_layer, (temp, bf16_layer)


def subtree_k(shapes, k):
    return shapes["moe_layers"]["mlp"]["experts"][k]


def test_train_step_keeps_quantized_frozen():
    from k2jax import make_train_step

    cfg = K2Config.from_hf_config(hf_config("kimi_like", "int4"))
    params = quantize_params(random_params(cfg), cfg, "int4")
    before = jax.tree.map(np.asarray, params)
    step = make_train_step(K2Model(cfg))
    params = jax.tree.map(jnp.copy, params)
    opt_state = step.init(params)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 8)))
    new, _, metrics = step(params, opt_state, {"tokens": ids})
    assert np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    ex, ex0 = new["moe_layers"]["mlp"]["experts"], before["moe_layers"]["mlp"]["experts"]
    for k in EXPERTS:
        np.testing.assert_array_equal(ex[k].values, ex0[k].values)
    assert not np.allclose(new["moe_layers"]["self_attn"]["o_proj"], before["moe_layers"]["self_attn"]["o_proj"])
