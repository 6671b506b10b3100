"""Model structure: scanned blocks equal the same blocks applied one by one; depth does not grow the program."""

import jax
import jax.numpy as jnp
import numpy as np

from k2jax import K2Config, K2Model, abstract_params, init_params
from k2jax.nn.block import DecoderBlock
from k2jax.nn.model import EXPERT_VIEWS, expert_views
from k2jax.nn.norm import rms_norm
from k2jax.nn.quantized import quantize_params
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
    valid = jnp.ones((2, 7), bool)
    for group, n, moe in (("dense_layers", 2, False), ("moe_layers", 3, True)):
        block = jax.jit(DecoderBlock(cfg, moe).apply)  # one compile per kind of block, not op by op
        for i in range(n):
            layer = jax.tree_util.tree_map(lambda a: a[i], params[group])
            x, _ = block({"params": layer}, x, pos, valid)
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


def test_moe_layers_run_out_of_the_stacked_experts():
    """The default MoE path (XLA:CPU, one device) computes each layer's routed experts out of the stacked
    params with the layer's index: equal to the dense reference, each layer with its own experts (swapping two
    layers' experts changes the output), gradients equal to the reference's."""
    cfg = TINY.replace(num_hidden_layers=4)  # 3 MoE layers
    params = random_params(cfg, seed=7)
    tokens = jax.random.randint(jax.random.PRNGKey(8), (2, 9), 0, cfg.vocab_size)

    def loss(model, p):
        return jnp.sum(jnp.sin(model.apply({"params": p}, tokens)))

    dense, default = K2Model(cfg, moe_impl="dense"), K2Model(cfg)
    fwd = jax.jit(lambda p: default.apply({"params": p}, tokens))
    np.testing.assert_allclose(fwd(params), dense.apply({"params": params}, tokens), atol=1e-5, rtol=1e-5)
    mlp = params["moe_layers"]["mlp"]
    swapped = jax.tree.map(lambda a: a[jnp.array([1, 0, 2])], mlp["experts"])
    swapped = params | {"moe_layers": params["moe_layers"] | {"mlp": mlp | {"experts": swapped}}}
    assert not np.allclose(fwd(swapped), fwd(params), atol=1e-3)
    g_ref = jax.jit(jax.grad(lambda p: loss(dense, p)))(params)
    g_got = jax.jit(jax.grad(lambda p: loss(default, p)))(params)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_got), jax.tree_util.tree_leaves(g_ref)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4, err_msg=jax.tree_util.keystr(path))


def test_forward_copies_no_layer_of_the_expert_stacks():
    """XLA:CPU copies a slice of an array before a matmul reads it: the forward must not take a layer's
    whole expert stack out of the stacked params (the scan's per-layer slice), only blocks of experts that
    fit the cache; its temporary memory stays under one layer's stack of one projection."""
    cfg = TINY.replace(num_hidden_layers=3, n_routed_experts=32, moe_intermediate_size=1024)
    params = abstract_params(cfg)
    tokens = jax.ShapeDtypeStruct((1, 64), jnp.int32)  # 128 assignments over 32 experts: the batched matmul
    compiled = jax.jit(lambda p, t: K2Model(cfg).apply({"params": p}, t)).lower(params, tokens).compile()
    one_projection = np.prod(params["moe_layers"]["mlp"]["experts"]["up_proj"].shape[1:]) * 4
    assert compiled.memory_analysis().temp_size_in_bytes < one_projection


def test_expert_views_share_the_stacks_memory_and_give_the_same_model():
    """expert_views, the per-layer views a runtime's steps take on one CPU device: each view is its stack's
    own memory (nothing copied), the model gives the reference's logits through them (a switch picks each
    layer's views: swapping two layers' changes the output), quantized experts too, and params it cannot
    view (abstract ones) come back unchanged."""
    cfg = TINY.replace(num_hidden_layers=4)  # 3 MoE layers
    params = random_params(cfg, seed=7)
    tokens = jax.random.randint(jax.random.PRNGKey(8), (2, 9), 0, cfg.vocab_size)
    fwd = jax.jit(lambda p: K2Model(cfg).apply({"params": p}, tokens))
    views = expert_views(params)
    stack = np.asarray(params["moe_layers"]["mlp"]["experts"]["up_proj"])
    assert [v.unsafe_buffer_pointer() for v in views[EXPERT_VIEWS]["up_proj"]] == [
        stack[i].ctypes.data for i in range(3)]
    want = K2Model(cfg, moe_impl="dense").apply({"params": params}, tokens)
    np.testing.assert_allclose(fwd(views), want, atol=1e-5, rtol=1e-5)
    swapped = views | {EXPERT_VIEWS: {k: (v[1], v[0], v[2]) for k, v in views[EXPERT_VIEWS].items()}}
    assert not np.allclose(fwd(swapped), want, atol=1e-3)
    quantized = quantize_params(params, cfg, "fp8")
    np.testing.assert_allclose(fwd(expert_views(quantized)), fwd(quantized), atol=1e-6, rtol=1e-6)
    abstract = abstract_params(cfg)
    assert expert_views(abstract) is abstract


def test_output_major_expert_views_hold_the_transposes_and_give_the_same_model():
    """expert_views(output_major=True), what the runtime's CPU steps take: gate and up become per-layer
    OutputMajor copies [E, F, D] (the transposes of their layers, counted by copied_expert_bytes), down stays
    a view of its stack, and the model's logits are the reference's; quantized experts stay views."""
    from k2jax.nn.model import copied_expert_bytes
    from k2jax.ops.moe import OutputMajor

    cfg = TINY.replace(num_hidden_layers=4)  # 3 MoE layers
    params = random_params(cfg, seed=7)
    tokens = jax.random.randint(jax.random.PRNGKey(8), (2, 9), 0, cfg.vocab_size)
    views = expert_views(params, output_major=True)
    experts = params["moe_layers"]["mlp"]["experts"]
    for name in ("gate_proj", "up_proj"):
        got = views[EXPERT_VIEWS][name]
        assert all(isinstance(w, OutputMajor) for w in got)
        np.testing.assert_array_equal(np.stack([w.w_FD for w in got]), np.swapaxes(experts[name], -1, -2))
    down = np.asarray(experts["down_proj"])
    assert [v.unsafe_buffer_pointer() for v in views[EXPERT_VIEWS]["down_proj"]] == [
        down[i].ctypes.data for i in range(3)]
    assert copied_expert_bytes(views) == experts["gate_proj"].nbytes + experts["up_proj"].nbytes
    assert copied_expert_bytes(expert_views(params)) == 0
    for B, T in ((2, 9), (1, 1)):  # the batched matmul; one token (4 K <= E): the gathered decode path
        want = K2Model(cfg, moe_impl="dense").apply({"params": params}, tokens[:B, :T])
        got = jax.jit(lambda p: K2Model(cfg).apply({"params": p}, tokens[:B, :T]))(views)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5, err_msg=f"{B} x {T} tokens")
    quantized = expert_views(quantize_params(params, cfg, "fp8"), output_major=True)
    assert not any(isinstance(w, OutputMajor) for w in quantized[EXPERT_VIEWS]["gate_proj"])


def test_runner_steps_through_the_views_equal_the_reference():
    """The runtime's steps on one CPU device take expert_views of the params: greedy generation through them
    equals the argmax of the dense reference's full forward, token by token."""
    from k2jax.ops.moe import OutputMajor
    from k2jax.runtime import generate as generate_module
    from k2jax.runtime.generate import generate
    from k2jax.runtime.runner import Runner

    cfg = TINY.replace(num_hidden_layers=4)
    params = random_params(cfg, seed=3)
    assert EXPERT_VIEWS in Runner(K2Model(cfg), params, slots=1, num_pages=2, page_size=8).params
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    generate_module._RUNNERS.clear()
    tokens, _ = generate(K2Model(cfg), params, prompts, 5)
    (runner,) = generate_module._RUNNERS.values()  # generate's steps took the views too
    assert all(isinstance(w, OutputMajor) for w in runner.params[EXPERT_VIEWS]["gate_proj"])
    reference = jax.jit(lambda t: K2Model(cfg, moe_impl="dense").apply({"params": params}, t))
    for prompt, got in zip(prompts, np.asarray(tokens)):
        seq = list(prompt)
        for _ in range(5):
            seq.append(int(jnp.argmax(reference(jnp.asarray([seq]))[0, -1])))
        assert list(got) == seq[len(prompt):]


def test_runner_makes_the_views_once_per_params_object():
    """Runner.set_params: the same params again keep their per-layer arrays (no second copy); new params
    (generate's cached runner called with other weights) get their own, and the steps follow them."""
    from k2jax.runtime.layout import RaggedShape
    from k2jax.runtime.runner import Runner

    cfg = TINY.replace(num_hidden_layers=4)
    params, other = random_params(cfg, seed=3), random_params(cfg, seed=4)
    runner = Runner(K2Model(cfg), params, slots=1, num_pages=2, page_size=8)
    views = runner.params[EXPERT_VIEWS]
    runner.set_params(params)
    assert runner.params[EXPERT_VIEWS] is views
    runner.set_params(other)
    got = runner.params[EXPERT_VIEWS]["gate_proj"][0].w_FD
    np.testing.assert_array_equal(got, np.swapaxes(other["moe_layers"]["mlp"]["experts"]["gate_proj"][0], -1, -2))
    kv_b = sum(other[g]["self_attn"]["kv_b_proj"].nbytes for g in ("dense_layers", "moe_layers"))
    assert runner.extra_bytes == 2 * other["moe_layers"]["mlp"]["experts"]["gate_proj"].nbytes + kv_b
    head_major = runner._params_for(RaggedShape(1, 0, 16, 1, 2))["moe_layers"]["self_attn"]["kv_b_proj"]
    K = cfg.qk_nope_head_dim  # W_UK [L, N, R, K] and W_UV [L, N, V, R] of the params' [L, R, N, K + V]
    w = np.asarray(other["moe_layers"]["self_attn"]["kv_b_proj"])
    np.testing.assert_array_equal(head_major.uk_NRK, np.transpose(w[..., :K], (0, 2, 1, 3)))
    np.testing.assert_array_equal(head_major.uv_NVR, np.transpose(w[..., K:], (0, 2, 3, 1)))
