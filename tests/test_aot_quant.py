"""The quantized releases (K2-Thinking's int4 experts, K2-Instruct's fp8) compiled by the TPU compiler for real
TPU slices on this CPU host, as tests/test_aot.py does for bf16 (a file of its own so that a parallel test run
can put it beside that one)."""

import pytest

from k2jax.aot.report import step_model
from k2jax.plan import CHIPS, GiB
from tests.test_aot import compiled  # skips (or, with K2JAX_REQUIRE_TPU_AOT=1, fails) as that file does without libtpu


@pytest.fixture(scope="module")
def v5p_16_int4():
    """K2-Thinking's int4 experts on v5p:2x2x4 (16 chips), batch 256 x 8192: 24 local experts per chip."""
    return compiled("v5p:2x2x4", 256, 8192, ("decode", "prefill"), quant="int4")


def test_int4_on_v5p_16_within_the_goal_and_no_dequantized_stack(v5p_16_int4):
    res, p = v5p_16_int4
    assert p.mesh["expert"] == 16
    for name in ("decode", "prefill"):
        assert res[name].total_bytes <= 86 * GiB, (name, res[name].total_bytes / GiB)
    decode = res["decode"]
    # one layer's chosen experts: top-8 x gate, up, down of 7168 x 2048 in bf16
    assert decode.copy_limit == 8 * 3 * 7168 * 2048 * 2
    assert decode.weight_copies == [], decode.weight_copies
    assert decode.weight_collectives == [], decode.weight_collectives


def test_int4_decode_on_v5p_64_within_the_roofline_goals():
    """K2-Thinking on v5p:4x4x4 `expert=64`, 64 x 8192: decode moves at most 1.3x its arguments, and the step
    model gives at least 5,500 tokens/s for the slice (1.25x and 6,128 when written)."""
    res, p = compiled("v5p:4x4x4", 64, 8192, ("decode",), quant="int4", mesh="expert=64")
    decode = res["decode"]
    assert decode.moved_bytes <= 1.3 * decode.argument_bytes, decode.moved_bytes / decode.argument_bytes
    model = step_model(decode, CHIPS["v5p"], p.devices)
    assert model["tokens_per_second"] >= 5500, model


def test_fp8_decode_on_v5p_64_reads_its_weights_in_place():
    """Kimi-K2-Instruct (fp8 attention, dense and expert weights) on v5p:4x4x4, 64 x 8192: the step moves at
    most 1.3x its arguments (the issue's goal; 1.29x when written, 7.46x before the dense fp8 weights were
    read as held, k2jax.ops.matmul.einsum_fp8_blocks and k2jax.ops.paged.head_blocks)."""
    res, p = compiled("v5p:4x4x4", 64, 8192, ("decode",), quant="fp8")
    decode = res["decode"]
    assert decode.total_bytes <= 54 * GiB
    assert decode.moved_bytes <= 1.3 * decode.argument_bytes, decode.moved_bytes / decode.argument_bytes
    assert decode.weight_copies == [], decode.weight_copies
    # Only the dense layer's MLP is gathered, by its fp8 values (16 MB a step): its hidden dim of 18432 split 64
    # ways leaves each chip 288 columns, not whole 128-column blocks, so XLA gathers 4 shards (9 blocks) to
    # scale them. Routed and shared experts stay where they are.
    moved = {name for _, _, src in decode.weight_collectives for name in src}
    assert moved <= {"params.dense_layers.mlp.gate_proj.values", "params.dense_layers.mlp.up_proj.values"}, moved


@pytest.mark.slow
def test_int4_on_v6e_64_within_the_goal():
    res, p = compiled("v6e:8x8", 128, 8192, ("decode", "prefill"), quant="int4")
    for name in ("decode", "prefill"):
        assert res[name].total_bytes <= 28 * GiB, (name, res[name].total_bytes / GiB)
    assert res["decode"].weight_copies == [] and res["decode"].weight_collectives == []
