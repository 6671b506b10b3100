"""Model structure: scanned blocks equal the same blocks applied one by one; depth does not grow the program."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k2jax import K2Config, K2Model, abstract_params, init_params, make_mesh, split_experts, stack_experts, use_mesh
from k2jax.nn.block import DecoderBlock
from k2jax.nn.norm import rms_norm
from k2jax.testing import random_params
from tests.conftest import CONFIGS

TINY = K2Config.from_hf_config(CONFIGS / "tiny.json")


def test_scan_equals_blocks_one_by_one():
    cfg = TINY.replace(first_k_dense_replace=2, num_hidden_layers=5)
    params = random_params(cfg, seed=3)
    tokens = jax.random.randint(jax.random.PRNGKey(4), (2, 7), 0, cfg.vocab_size)
    logits = K2Model(cfg).apply({"params": params}, tokens)

    x = params["embed_tokens"][tokens]
    pos = jnp.broadcast_to(jnp.arange(7), (2, 7))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((7, 7), bool)), (2, 7, 7))
    for group, n, moe in (("dense_layers", 2, False), ("moe_layers", 3, True)):
        block = jax.jit(DecoderBlock(cfg, moe).apply)  # one compile per kind of block, not op by op
        for i in range(n):
            layer = jax.tree_util.tree_map(lambda a: a[i], params[group])
            x, _ = block({"params": layer}, x, pos, mask)
    x = rms_norm(x, params["norm"]["weight"], cfg.rms_norm_eps)
    np.testing.assert_allclose(logits, x @ params["lm_head"], atol=1e-5, rtol=1e-5)


def test_positions_and_padding_mask():
    params = random_params(TINY)
    model = K2Model(TINY)
    apply = jax.jit(model.apply)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (1, 6), 0, TINY.vocab_size)
    full = apply({"params": params}, tokens)
    # Left padding with a mask and shifted positions gives the unpadded logits.
    padded = jnp.concatenate([jnp.zeros((1, 3), jnp.int32), tokens], axis=1)
    mask = jnp.array([[0, 0, 0, 1, 1, 1, 1, 1, 1]])
    pos = jnp.maximum(jnp.arange(9) - 3, 0)[None]
    out = apply({"params": params}, padded, pos, mask)
    np.testing.assert_allclose(out[:, 3:], full, atol=1e-5, rtol=1e-5)
    # Causality: changing the last token leaves earlier logits alone.
    other = apply({"params": params}, tokens.at[0, -1].set((tokens[0, -1] + 1) % TINY.vocab_size))
    np.testing.assert_allclose(other[:, :-1], full[:, :-1], atol=1e-6)
    assert not np.allclose(other[:, -1], full[:, -1])


def test_blocked_forward_equals_reference_over_several_blocks():
    # 300 tokens: two attention blocks, the second partial, tiles above the diagonal skipped.
    params = random_params(TINY, seed=5)
    model = K2Model(TINY)
    tokens = jax.random.randint(jax.random.PRNGKey(6), (2, 300), 0, TINY.vocab_size)
    mask = jnp.ones((2, 300), jnp.int32).at[1, :37].set(0)
    got = jax.jit(lambda p, t, m: model.apply({"params": p}, t, None, m))(params, tokens, mask)
    want = jax.jit(lambda p, t, m: model.apply({"params": p}, t, None, m, method=K2Model.reference))(
        params, tokens, mask)
    valid = np.asarray(mask, bool)
    np.testing.assert_allclose(np.asarray(got)[valid], np.asarray(want)[valid], atol=1e-4, rtol=1e-4)


def test_bf16_params_compute_in_bf16_with_f32_logits():
    params = init_params(TINY, jax.random.PRNGKey(0), jnp.bfloat16)
    leaves = jax.tree_util.tree_leaves_with_path(params)
    for path, a in leaves:
        names = [getattr(k, "key", "") for k in path]
        expected = jnp.float32 if names[-2:] in (["gate", "kernel"], ["gate", "e_score_correction_bias"]) else jnp.bfloat16
        assert a.dtype == expected, names
    tokens = jnp.arange(8).reshape(1, 8)
    out16 = K2Model(TINY, jnp.bfloat16).apply({"params": params}, tokens)
    p32 = jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), params)
    out32 = K2Model(TINY).apply({"params": p32}, tokens)
    assert out16.dtype == jnp.float32
    np.testing.assert_allclose(out16, out32, atol=0.1, rtol=0.1)


def test_program_size_does_not_grow_with_depth():
    """nn.scan: the lowered program of 32 MoE layers is the size of the 4-layer one (the compile-time
    benchmark in bench/compile.py times it)."""
    bench = K2Config.from_hf_config(CONFIGS / "bench.json")
    sizes = []
    for n in (4, 32):
        cfg = bench.replace(num_hidden_layers=n + 1)
        params = abstract_params(cfg, jnp.bfloat16)
        tokens = jax.ShapeDtypeStruct((1, 16), jnp.int32)
        text = jax.jit(lambda p, t: K2Model(cfg, jnp.bfloat16).apply({"params": p}, t)).lower(params, tokens).as_text()
        sizes.append(len(text))
    assert abs(sizes[1] - sizes[0]) < 0.02 * sizes[0], sizes


def test_split_experts_layout_gives_the_same_model():
    """Per-layer expert arrays (a switch on the layer index) == the stacked layout, each layer with its own
    experts; stack_experts restores the params exactly; a mesh is refused."""
    cfg = TINY.replace(num_hidden_layers=4)  # 3 MoE layers
    params = random_params(cfg, seed=7)
    split = split_experts(params)
    assert "experts" not in split["moe_layers"]["mlp"]
    stacked_up = params["moe_layers"]["mlp"]["experts"]["up_proj"]
    assert [a.shape for a in split["moe_layers_experts"]["up_proj"]] == [stacked_up.shape[1:]] * 3
    model = K2Model(cfg)
    tokens = jax.random.randint(jax.random.PRNGKey(8), (2, 9), 0, cfg.vocab_size)
    fwd = jax.jit(lambda p: model.apply({"params": p}, tokens))
    np.testing.assert_allclose(fwd(split), fwd(params), atol=1e-6, rtol=1e-6)
    # Swapping two layers' experts must change the output: the switch does pick per layer.
    swapped = split | {"moe_layers_experts": jax.tree.map(lambda t: (t[1], t[0], t[2]), split["moe_layers_experts"],
                                                          is_leaf=lambda t: isinstance(t, tuple))}
    assert not np.allclose(fwd(swapped), fwd(params), atol=1e-3)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), stack_experts(split), params))
    with use_mesh(make_mesh("expert=4,tensor=2")), pytest.raises(ValueError, match="single-device layout"):
        model.apply({"params": split}, tokens)
