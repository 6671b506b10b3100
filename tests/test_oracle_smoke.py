"""Smoke test of the reference oracle (HF DeepseekV3ForCausalLM in its own venv), driven through the client.

Never imports torch: everything goes through tests/oracle/client.py. Skips when the oracle venv is missing,
unless K2JAX_REQUIRE_ORACLE=1 (then the fixture raises and the test fails).
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest


# Kimi-like in miniature. intermediate_size 160 > 128 puts partial 128x128 blocks into the dense MLP's FP8 scales.
CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
    "vocab_size": 64, "hidden_size": 32, "intermediate_size": 160, "moe_intermediate_size": 16,
    "num_hidden_layers": 2, "first_k_dense_replace": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
    "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
    "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 2.827,
    "q_lora_rank": 16, "kv_lora_rank": 8, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 131072, "rope_theta": 50000.0,
    "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                     "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
}
B, T, V, D, L = 2, 7, 64, 32, 2
INPUT_IDS = np.random.default_rng(0).integers(0, V, size=(B, T))
PROMPTS = [[1, 5, 9], [7, 3, 2, 11, 4]]
NEW_TOKENS = 5


def read_safetensors(path) -> dict[str, tuple[str, list[int], np.ndarray]]:
    """Parse a safetensors file by hand: {name: (dtype, shape, array)} (F8 via ml_dtypes)."""
    dtypes = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "BF16": ml_dtypes.bfloat16, "F32": np.float32}
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    out = {}
    for name, h in header.items():
        a, b = h["data_offsets"]
        arr = np.frombuffer(raw[8 + n + a:8 + n + b], dtype=dtypes[h["dtype"]]).reshape(h["shape"])
        out[name] = (h["dtype"], h["shape"], arr)
    return out


def read_dir(d) -> dict[str, tuple[str, list[int], np.ndarray]]:
    out = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        out.update(read_safetensors(f))
    return out


def base_request(**kw):
    return {"config": CONFIG, "seed": 1234, "inputs": {"input_ids": INPUT_IDS}, **kw}


def test_hf_save_capture_generate_grad_and_load(oracle, tmp_path):
    out = oracle.run(base_request(
        save={"dir": str(tmp_path / "hf"), "format": "hf"}, capture=True,
        generate={"prompts": PROMPTS, "max_new_tokens": NEW_TOKENS},
        grad={"input_ids": INPUT_IDS[:, :-1], "labels": INPUT_IDS[:, 1:]},
    ))
    assert out["logits"].shape == (B, T, V) and out["logits"].dtype == np.float32
    assert np.isfinite(out["logits"]).all() and 0.1 < out["logits"].std() < 10  # O(1) activations
    for i in range(L):
        for k in ("in", "out", "input_layernorm.out", "self_attn.out", "post_attention_layernorm.in",
                  "post_attention_layernorm.out", "mlp.out"):
            assert out[f"layers.{i}.{k}"].shape == (B, T, D), k
    np.testing.assert_allclose(out["layers.0.out"], out["layers.1.in"])
    np.testing.assert_allclose(out["layers.1.post_attention_layernorm.in"],
                               out["layers.1.in"] + out["layers.1.self_attn.out"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out["layers.1.mlp.out"], out["layers.1.mlp.experts.out"]
                               + out["layers.1.mlp.shared_experts.out"], rtol=1e-5, atol=1e-5)
    assert out["layers.1.mlp.gate.logits"].shape == (B, T, 8)
    idx, w = out["layers.1.mlp.gate.topk_idx"], out["layers.1.mlp.gate.topk_weight"]
    assert idx.shape == w.shape == (B, T, 2) and (np.diff(idx, axis=-1) > 0).all()
    np.testing.assert_allclose(w.sum(-1), 2.827, rtol=1e-5)  # norm_topk_prob, then routed_scaling_factor
    assert "layers.0.mlp.gate.logits" not in out  # layer 0 is dense
    assert out["embed.out"].shape == out["norm.out"].shape == (B, T, D)
    assert 0 < float(out["bias_changes_choice"]) <= 1
    mscale = 0.1 * math.log(32.0) + 1.0
    assert float(out["attn.scaling"]) == pytest.approx(12 ** -0.5 * mscale ** 2, rel=1e-6)
    assert out["rope.inv_freq"].shape == (2,) and float(out["rope.attention_scaling"]) == pytest.approx(1.0)
    assert out["rope.q_out"].shape == (B, 2, T, 4) and out["rope.k_out"].shape == (B, 1, T, 4)
    np.testing.assert_allclose(out["rope.q_out"][:, :, 0], out["rope.q_in"][:, :, 0][..., [0, 2, 1, 3]],
                               rtol=1e-6)  # position 0: no rotation, only the [evens; odds] reordering
    for j, p in enumerate(PROMPTS):
        g = out[f"generate.{j}"]
        assert g.dtype == np.int64 and g.shape == (NEW_TOKENS,) and ((0 <= g) & (g < V)).all()
    assert np.isfinite(out["loss"]) and out["loss"].shape == ()
    assert out["grad.model.layers.1.mlp.experts.7.gate_proj.weight"].shape == (16, D)
    assert out["grad.model.layers.1.mlp.experts.7.down_proj.weight"].shape == (D, 16)
    assert not any("gate_up_proj" in k for k in out)
    assert np.abs(out["grad.model.layers.1.mlp.gate.weight"]).sum() > 0  # router gets gradient via weights

    saved = read_dir(tmp_path / "hf")
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in saved
    assert all(dt == "F32" for dt, _, _ in saved.values())

    # Loading the saved directory reproduces the random model exactly.
    again = oracle.run({"load": str(tmp_path / "hf"), "inputs": {"input_ids": INPUT_IDS}})
    np.testing.assert_array_equal(again["logits"], out["logits"])

    # Greedy generation agrees with the forward, and stop_tokens end it.
    first = oracle.run(base_request(inputs={"input_ids": [PROMPTS[1]]},
                                    generate={"prompts": [PROMPTS[1]], "max_new_tokens": 3,
                                              "stop_tokens": [int(out["generate.1"][0])]}))
    assert int(first["logits"][0, -1].argmax()) == int(out["generate.1"][0])
    assert first["generate.0"].tolist() == [int(out["generate.1"][0])]


def test_fp8_layout_and_load(oracle, tmp_path):
    d = tmp_path / "fp8"
    fp8 = oracle.run(base_request(save={"dir": str(d), "format": "fp8", "num_shards": 2}))
    plain = oracle.run(base_request(save={"dir": str(tmp_path / "hf"), "format": "hf"}))

    index = json.loads((d / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in d.glob("*.safetensors"))
    assert files == ["model-1-of-2.safetensors", "model-2-of-2.safetensors"]
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128] and cfg["torch_dtype"] == "bfloat16"
    tensors = read_dir(d)
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(a.nbytes for _, _, a in tensors.values())
    assert index["weight_map"]["model.embed_tokens.weight"] == files[0]
    assert index["weight_map"]["lm_head.weight"] == files[1]

    reference = read_dir(tmp_path / "hf")  # the same random weights in float32
    quantized = [n for n in tensors if n.endswith("_scale_inv")]
    assert len(quantized) == L * 5 + 3 + 8 * 3 + 3  # 5 attention projections x 2 layers, dense MLP, experts, shared
    for s_name in quantized:
        name = s_name[:-len("_scale_inv")]
        dt, (o, i), q = tensors[name]
        s_dt, s_shape, s = tensors[s_name]
        assert dt == "F8_E4M3" and s_dt == "F32" and s_shape == [-(-o // 128), -(-i // 128)]
        w = q.astype(np.float32) * np.repeat(np.repeat(s, 128, 0), 128, 1)[:o, :i]
        ref = reference[name][2]
        # e4m3 keeps 3 mantissa bits: relative error <= 1/16, subnormals near 2^-9 of the block scale.
        blocks_s = np.repeat(np.repeat(s, 128, 0), 128, 1)[:o, :i]
        assert (np.abs(w - ref) <= np.abs(ref) / 16 + blocks_s * 2 ** -9).all(), name
    assert tensors["model.layers.0.mlp.gate_proj.weight_scale_inv"][1] == [2, 1]  # partial edge block
    assert tensors["model.layers.0.mlp.down_proj.weight_scale_inv"][1] == [1, 2]
    for name, (dt, _, _) in tensors.items():
        if name.endswith(("norm.weight", "embed_tokens.weight", "lm_head.weight", "mlp.gate.weight")):
            assert dt == "BF16", name
        if name.endswith(("e_score_correction_bias", "rotary_emb.inv_freq")):
            assert dt == "F32", name
    assert sum(n.endswith("rotary_emb.inv_freq") for n in tensors) == L

    # The fp8 run used the stored values: loading the directory gives the same logits; rounding did change them.
    again = oracle.run({"load": str(d), "inputs": {"input_ids": INPUT_IDS}})
    np.testing.assert_array_equal(again["logits"], fp8["logits"])
    assert not np.array_equal(fp8["logits"], plain["logits"])
    # Close to the unquantized model, except where the rounding flips a (discrete) routing decision.
    assert np.mean(np.abs(fp8["logits"] - plain["logits"]) < 0.25) > 0.9
