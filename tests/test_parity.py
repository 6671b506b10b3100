"""Parity with HuggingFace transformers' DeepseekV3ForCausalLM (the oracle), float32, atol = rtol = 1e-4.

The oracle builds the HF model with random weights (random norms, router and a correction bias large enough
to change which experts win), writes its checkpoint, and records every module's inputs and outputs. k2jax
loads that checkpoint through `load_hf` and runs each module on the recorded inputs.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k2jax import K2Config, K2Model, load_hf
from k2jax.nn.block import DecoderBlock
from k2jax.nn.mla import MLA
from k2jax.nn.mlp import MLP
from k2jax.nn.moe import MoE, Router
from k2jax.nn.norm import rms_norm
from k2jax.nn.rope import apply_rope, attention_factor, inv_freq

TOL = dict(atol=1e-4, rtol=1e-4)
KIMI_ROPE = {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 1.0,
             "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=112, moe_intermediate_size=24, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=24, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=12, n_shared_experts=1, norm_topk_prob=True, rms_norm_eps=1e-6,
            max_position_embeddings=131072, tie_word_embeddings=False)
CONFIGS = {
    # Kimi K2's shape: one group, YaRN with Kimi's constants, one dense block then MoE.
    "kimi_like": BASE | dict(q_lora_rank=32, n_routed_experts=16, num_experts_per_tok=4, n_group=1, topk_group=1,
                             first_k_dense_replace=1, routed_scaling_factor=2.827, rope_theta=50000.0,
                             rope_scaling=KIMI_ROPE),
    # DeepSeek-V3's grouped routing and its YaRN constants (the ramp spans several rotary pairs).
    "grouped": BASE | dict(q_lora_rank=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                           first_k_dense_replace=1, routed_scaling_factor=2.5, qk_rope_head_dim=16,
                           rope_theta=10000.0, rope_scaling={"type": "yarn", "factor": 40.0,
                                                             "original_max_position_embeddings": 4096,
                                                             "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                                                             "mscale_all_dim": 1.0}),
    # A plain q_proj, no rope scaling, non-interleaved rotary layout, two dense blocks.
    "no_q_lora": BASE | dict(q_lora_rank=None, n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
                             first_k_dense_replace=2, routed_scaling_factor=1.5, rope_theta=10000.0,
                             rope_interleave=False, num_hidden_layers=4),
}
B, T = 2, 12


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request, oracle, tmp_path_factory):
    name = request.param
    d = tmp_path_factory.mktemp(name)
    ids = np.random.default_rng(1).integers(0, 96, (B, T))
    mask = np.ones((B, T), np.int64)
    mask[1, :3] = 0  # left padding in the second row
    out = oracle.run({"config": CONFIGS[name], "seed": 7, "save": {"dir": str(d), "format": "hf", "num_shards": 2},
                      "inputs": {"input_ids": ids, "attention_mask": mask}, "capture": True})
    cfg, params = load_hf(d)
    return dict(name=name, cfg=cfg, params=params, out=out, ids=ids, mask=mask)


def layer(params, cfg, i):
    group, j = ("dense_layers", i) if i < cfg.num_dense_layers else ("moe_layers", i - cfg.num_dense_layers)
    return jax.tree_util.tree_map(lambda a: a[j], params[group])


def positions():
    return jnp.broadcast_to(jnp.arange(T), (B, T))


def close(got, want, valid=None):
    got, want = np.asarray(got), np.asarray(want)
    if valid is not None:  # compare real (not padding) positions only
        got, want = got[valid], want[valid]
    np.testing.assert_allclose(got, want, **TOL)


def test_config_values_match_reference(case):
    cfg, out = case["cfg"], case["out"]
    np.testing.assert_allclose(inv_freq(cfg), out["rope.inv_freq"], rtol=1e-6)
    assert attention_factor(cfg) == pytest.approx(float(out["rope.attention_scaling"]))
    assert cfg.softmax_scale == pytest.approx(float(out["attn.scaling"]), rel=1e-7)


def test_rope(case):
    cfg, out = case["cfg"], case["out"]
    pos = jnp.asarray(out["rope.position_ids"]).reshape(-1, T)
    pos = jnp.broadcast_to(pos, (B, T))
    for name in ("q", "k"):
        x = jnp.asarray(out[f"rope.{name}_in"]).transpose(0, 2, 1, 3)  # [B, heads, T, d] -> [B, T, heads, d]
        close(apply_rope(x, pos, cfg).transpose(0, 2, 1, 3), out[f"rope.{name}_out"])


def test_rms_norm(case):
    cfg, out = case["cfg"], case["out"]
    for i in range(cfg.num_hidden_layers):
        p = layer(case["params"], cfg, i)
        close(rms_norm(out[f"layers.{i}.in"], p["input_layernorm"]["weight"], cfg.rms_norm_eps),
              out[f"layers.{i}.input_layernorm.out"])
    close(rms_norm(out[f"layers.{cfg.num_hidden_layers - 1}.out"], case["params"]["norm"]["weight"],
                   cfg.rms_norm_eps), out["norm.out"])


def test_attention(case):
    cfg, out = case["cfg"], case["out"]
    valid = case["mask"].astype(bool)
    for i in range(cfg.num_hidden_layers):
        p = layer(case["params"], cfg, i)["self_attn"]
        got, _ = MLA(cfg).apply({"params": p}, out[f"layers.{i}.input_layernorm.out"], positions(), valid)
        close(got, out[f"layers.{i}.self_attn.out"], valid)


def test_dense_mlp(case):
    cfg, out = case["cfg"], case["out"]
    for i in range(cfg.num_dense_layers):
        p = layer(case["params"], cfg, i)["mlp"]
        close(MLP(cfg.intermediate_size).apply({"params": p}, out[f"layers.{i}.post_attention_layernorm.out"]),
              out[f"layers.{i}.mlp.out"])


def test_router_choices_and_weights(case):
    cfg, out = case["cfg"], case["out"]
    assert float(out["bias_changes_choice"]) > 0.05, "the correction bias must change some choices"
    for i in range(cfg.num_dense_layers, cfg.num_hidden_layers):
        p = layer(case["params"], cfg, i)["mlp"]["gate"]
        x = out[f"layers.{i}.post_attention_layernorm.out"].reshape(B * T, -1)
        idx, w = Router(cfg).apply({"params": p}, x)
        order = np.argsort(np.asarray(idx), axis=-1)
        idx, w = np.take_along_axis(np.asarray(idx), order, -1), np.take_along_axis(np.asarray(w), order, -1)
        np.testing.assert_array_equal(idx, out[f"layers.{i}.mlp.gate.topk_idx"].reshape(B * T, -1))
        close(w, out[f"layers.{i}.mlp.gate.topk_weight"].reshape(B * T, -1))


@pytest.mark.parametrize("impl", ["dense", "tiled", "ragged"])
def test_moe(case, impl):
    cfg, out = case["cfg"], case["out"]
    for i in range(cfg.num_dense_layers, cfg.num_hidden_layers):
        p = layer(case["params"], cfg, i)["mlp"]
        close(MoE(cfg, impl=impl, tile=4).apply({"params": p}, out[f"layers.{i}.post_attention_layernorm.out"]),
              out[f"layers.{i}.mlp.out"])


def test_blocks(case):
    cfg, out = case["cfg"], case["out"]
    valid = case["mask"].astype(bool)
    for i in range(cfg.num_hidden_layers):
        p = layer(case["params"], cfg, i)
        got, _ = DecoderBlock(cfg, i >= cfg.num_dense_layers).apply(
            {"params": p}, out[f"layers.{i}.in"], positions(), valid)
        close(got, out[f"layers.{i}.out"], valid)


def test_logits(case):
    cfg = case["cfg"]
    logits = jax.jit(lambda p, t, m: K2Model(cfg).apply({"params": p}, t, None, m))(
        case["params"], jnp.asarray(case["ids"]), jnp.asarray(case["mask"]))
    close(logits, case["out"]["logits"], case["mask"].astype(bool))


def test_fp8_release_layout(oracle, tmp_path):
    """Block weights quantized to e4m3 with 128x128 scales on dims that are not multiples of 128 (partial edge
    blocks), written in the released layout; HF runs the dequantized values."""
    cfg = CONFIGS["kimi_like"] | dict(hidden_size=160, intermediate_size=200, moe_intermediate_size=136,
                                      q_lora_rank=136, kv_lora_rank=132, num_attention_heads=2,
                                      num_key_value_heads=2, qk_nope_head_dim=72, v_head_dim=68)
    ids = np.random.default_rng(2).integers(0, 96, (1, 10))
    out = oracle.run({"config": cfg, "seed": 3, "save": {"dir": str(tmp_path), "format": "fp8", "num_shards": 3},
                      "inputs": {"input_ids": ids}})
    kcfg, params = load_hf(tmp_path, dtype=jnp.float32)
    assert kcfg.quantization_config["weight_block_size"] == [128, 128]
    logits = K2Model(kcfg).apply({"params": params}, jnp.asarray(ids))
    close(logits, out["logits"])
