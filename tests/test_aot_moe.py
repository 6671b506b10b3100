"""The expert-parallel MoE over quantized experts in chunks (k2jax.ops.expert_parallel.dequant_chunk): what
the TPU compile check required (a device with more local experts than a token's top-k dequantized all of
them at once), equal to the plain form on 8 simulated CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k2jax.ops.expert_parallel import dequant_chunk, local_experts, moe_expert_parallel
from k2jax.ops.moe import moe_dense
from k2jax.ops.quant import dequantize_weight, quantize_weight
from k2jax.sharding import make_mesh, use_mesh
from tests.test_moe import experts, routing


def quantized_experts(key, E, D, F, fmt):
    plain = experts(key, E, D, F)
    return tuple(quantize_weight(np.asarray(w), fmt, lead_ndim=1) for w in plain)


def test_chunk_sizes():
    q = quantize_weight(np.zeros((24, 64, 32), np.float32), "int4", lead_ndim=1)
    assert dequant_chunk(q, 8) == 8  # Kimi K2 on expert=16: 24 local experts, top-8
    assert dequant_chunk(quantize_weight(np.zeros((12, 64, 32), np.float32), "int4", lead_ndim=1), 8) == 6
    assert dequant_chunk(quantize_weight(np.zeros((6, 64, 32), np.float32), "int4", lead_ndim=1), 8) == 6  # all at once
    assert dequant_chunk(jnp.zeros((24, 64, 32)), 8) == 24  # plain weights: no dequantization, no chunks


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_local_experts_in_chunks_equal_the_dequantized_weights(fmt):
    key = jax.random.PRNGKey(3)
    R, E, K, D, F = 40, 12, 2, 128, 64  # 12 experts, top-2: chunks of 2
    w = quantized_experts(key, E, D, F, fmt)
    assert dequant_chunk(w[0], K) == 2
    x = jax.random.normal(jax.random.fold_in(key, 1), (R, D))
    idx, wt = routing(jax.random.fold_in(key, 2), R, E + 3, K)  # ids >= E: held elsewhere
    got = jax.jit(lambda x, i, t, *w: local_experts(x, i, t, *w, impl="ragged"))(x, idx, wt, *w)
    plain = [dequantize_weight(q, jnp.float32) for q in w]
    want = jax.jit(lambda x, i, t, *w: local_experts(x, i, t, *w, impl="ragged"))(x, idx, wt, *plain)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    held = jnp.where(idx < E, idx, 0)
    dense = moe_dense(x, held, jnp.where(idx < E, wt, 0.0), *plain)
    np.testing.assert_allclose(got, dense, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("spec, mode", [("expert=2,data=4", "all_to_all"), ("expert=4,tensor=2", "gather")])
def test_expert_parallel_over_quantized_chunks_equals_dense(spec, mode):
    key = jax.random.PRNGKey(5)
    T, E, K, D, F = 24, 32, 2, 128, 64  # 16 or 8 experts per device, top-2: chunks of 2
    w = quantized_experts(key, E, D, F, "int4")
    x = jax.random.normal(jax.random.fold_in(key, 1), (T, D))
    idx, wt = routing(jax.random.fold_in(key, 2), T, E, K)
    want = moe_dense(x, idx, wt, *[dequantize_weight(q, jnp.float32) for q in w])
    with use_mesh(make_mesh(spec)):
        got = jax.jit(lambda *a: moe_expert_parallel(*a, mode=mode, impl="ragged"))(x, idx, wt, *w)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
