"""Kimi-K2.5 / K2.6 text releases: the DeepSeek-V3 text model under `language_model.`, its config nested in
`text_config` (KimiK25ForConditionalGeneration), the vision tower and projector beside it, INT4 routed experts.

The checkpoint is written in the released layout with the release index's names (language_model.model.layers.N...,
language_model.lm_head.weight, vision_tower.encoder.blocks.N.wqkv.weight, mm_projector.proj.0.weight, ...); its
text weights are the same tensors as a plain Kimi-K2-Thinking-layout checkpoint, which transformers' DeepseekV3
(the oracle, INT4 unpacked by compressed-tensors) runs for the reference logits."""

import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k2jax
from k2jax import K2Config, K2Model, load_hf
from k2jax.checkpoint import save_hf
from k2jax.checkpoint.convert import convert
from k2jax.checkpoint.safetensors_io import Checkpoint, write_file
from k2jax.testing import random_params

TEXT = dict(
    vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
    n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=16, tie_word_embeddings=False, norm_topk_prob=True, routed_scaling_factor=2.827,
    rope_theta=50000.0, rms_norm_eps=1e-5,
)
IDS = np.random.default_rng(7).integers(0, 96, (2, 9))
VISION_DEPTH, VISION_WIDTH = 2, 16


def vision_tensors(rng) -> dict[str, np.ndarray]:
    """The vision tower (MoonViT) and projector tensors of the release, by their names, at a toy width."""
    w = VISION_WIDTH
    out = {"vision_tower.patch_embed.proj.weight": (w, 3, 14, 14), "vision_tower.patch_embed.proj.bias": (w,),
           "vision_tower.patch_embed.pos_emb.weight": (4, 4, w), "vision_tower.patch_embed.pos_emb.time_weight": (4, 1, w),
           "vision_tower.encoder.final_layernorm.weight": (w,), "vision_tower.encoder.final_layernorm.bias": (w,),
           "mm_projector.pre_norm.weight": (w,), "mm_projector.pre_norm.bias": (w,),
           "mm_projector.proj.0.weight": (4 * w, 4 * w), "mm_projector.proj.0.bias": (4 * w,),
           "mm_projector.proj.2.weight": (TEXT["hidden_size"], 4 * w), "mm_projector.proj.2.bias": (TEXT["hidden_size"],)}
    for b in range(VISION_DEPTH):
        p = f"vision_tower.encoder.blocks.{b}."
        out |= {p + "norm0.weight": (w,), p + "norm0.bias": (w,), p + "norm1.weight": (w,), p + "norm1.bias": (w,),
                p + "wqkv.weight": (3 * w, w), p + "wqkv.bias": (3 * w,), p + "wo.weight": (w, w), p + "wo.bias": (w,),
                p + "mlp.fc0.weight": (4 * w, w), p + "mlp.fc0.bias": (4 * w,),
                p + "mlp.fc1.weight": (w, 4 * w), p + "mlp.fc1.bias": (w,)}
    return {n: rng.standard_normal(s).astype(np.float32).astype(jnp.bfloat16) for n, s in out.items()}


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    """(text, k25): the same text weights as a Kimi-K2-Thinking-layout checkpoint and as a K2.5 one."""
    root = tmp_path_factory.mktemp("k25")
    cfg = K2Config.from_hf_config(TEXT)
    text = save_hf(random_params(cfg, np.float32, seed=2), cfg, root / "text", int4=True, num_shards=2)
    k25 = root / "k25"
    k25.mkdir()
    index = json.loads((text / "model.safetensors.index.json").read_text())
    weight_map = {}
    with Checkpoint(text) as ck:
        for f in sorted(set(index["weight_map"].values())):
            names = [n for n, g in index["weight_map"].items() if g == f]
            write_file(k25 / f, {"language_model." + n: ck.read(n) for n in names}, {"format": "pt"})
            weight_map |= {"language_model." + n: f for n in names}
    vision = vision_tensors(np.random.default_rng(3))
    write_file(k25 / "model-vision.safetensors", vision, {"format": "pt"})
    weight_map |= {n: "model-vision.safetensors" for n in vision}
    (k25 / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    text_config = json.loads((text / "config.json").read_text()) | {"model_type": "kimi_k2"}
    (k25 / "config.json").write_text(json.dumps({
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": text_config,
        "vision_config": {"vt_hidden_size": VISION_WIDTH, "vt_num_hidden_layers": VISION_DEPTH, "patch_size": 14,
                          "text_hidden_size": TEXT["hidden_size"]},
        "media_placeholder_token_id": 95, "pad_token_id": 0, "tie_word_embeddings": False}))
    return text, k25


@pytest.fixture
def reads(monkeypatch):
    """Every tensor name Checkpoint.read is asked for."""
    real, names = Checkpoint.read, []

    def spy(self, name, *a, **k):
        names.append(name)
        return real(self, name, *a, **k)

    monkeypatch.setattr(Checkpoint, "read", spy)
    return names


def logits(cfg, params):
    return np.asarray(jax.jit(lambda p, t: K2Model(cfg).apply({"params": p}, t))(params, jnp.asarray(IDS)))


def test_config_is_the_text_config(releases):
    text, k25 = releases
    assert K2Config.from_hf_config(k25) == K2Config.from_hf_config(text)
    assert K2Config.from_hf_config(k25).quantization_config["quant_method"] == "compressed-tensors"
    top = json.loads((k25 / "config.json").read_text())  # a quantization_config at the top level is found too
    top["quantization_config"] = top["text_config"].pop("quantization_config")
    assert K2Config.from_hf_config(top).quantization_config == top["quantization_config"]


def test_load_hf_equals_transformers_and_skips_the_vision_tower(oracle, releases, reads, caplog):
    text, k25 = releases
    want = oracle.run({"load": str(text), "inputs": {"input_ids": IDS}})["logits"]
    with caplog.at_level(logging.WARNING, logger="k2jax.checkpoint"):
        cfg, params = load_hf(k25, dtype=jnp.float32)
    notes = [r.getMessage() for r in caplog.records if "vision" in r.getMessage()]
    assert len(notes) == 1 and "vision_tower.*" in notes[0] and "mm_projector.*" in notes[0], notes
    assert reads and not [n for n in reads if not n.startswith("language_model.")]  # vision tensors never read
    np.testing.assert_allclose(logits(cfg, params), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    _, held = load_hf(k25, dtype=jnp.float32, quant="int4")  # the INT4 experts as stored
    _, held_text = load_hf(text, dtype=jnp.float32, quant="int4")
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), held, held_text)


def test_convert_then_load_equals_transformers(oracle, releases, reads, tmp_path):
    text, k25 = releases
    want = oracle.run({"load": str(text), "inputs": {"input_ids": IDS}})["logits"]
    lines = []
    stats = convert(k25, tmp_path / "int4", dtype="int4", log=lines.append)
    assert stats.complete
    assert len([ln for ln in lines if "vision" in ln]) == 1, lines
    assert reads and not [n for n in reads if not n.startswith("language_model.")]
    cfg, params = k2jax.load(tmp_path / "int4", dtype=jnp.float32, quant="int4")
    assert cfg == K2Config.from_hf_config(text)
    assert isinstance(params["moe_layers"]["mlp"]["experts"]["down_proj"], k2jax.QuantizedWeight)
    np.testing.assert_allclose(logits(cfg, params), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_text_tensors_outside_the_prefix_are_refused(releases, tmp_path):
    _, k25 = releases
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in k25.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    write_file(bad / "model-vision.safetensors", {"model.norm.weight": np.ones(64, np.float32)}, {"format": "pt"})
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if f != "model-vision.safetensors"}
    index["weight_map"]["model.norm.weight"] = "model-vision.safetensors"
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"(?s)1 problem\(s\).*'model.norm.weight'.*under 'language_model.'"):
        load_hf(bad)
