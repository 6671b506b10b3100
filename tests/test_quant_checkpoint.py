"""Quantized checkpoints: Kimi-K2-Thinking's INT4 "pack-quantized" layout (written by our packer, cross-checked
with compressed-tensors' own), its bad inputs, and loads that keep weights quantized (quant="fp8" / "int4")."""

import json
import math
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from k2jax import K2Config, load_hf
from k2jax.checkpoint import int4 as I4
from k2jax.checkpoint import save_hf
from k2jax.checkpoint.safetensors_io import Checkpoint, write_file
from k2jax.ops.quant import QuantizedWeight
from k2jax.testing import random_params

BF16 = np.dtype(ml_dtypes.bfloat16)
# Input dims (hidden 64, moe_intermediate 32) divisible by the group size 32; 1 dense + 2 MoE layers.
CFG = dict(
    vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
    n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=16, tie_word_embeddings=False, norm_topk_prob=True, routed_scaling_factor=2.5,
)
EXPERT = "model.layers.{i}.mlp.experts.{e}.{p}.weight"


def make_cfg(**changes):
    return K2Config.from_hf_config({**CFG, **changes})


@pytest.fixture(scope="module")
def params():
    return random_params(make_cfg(), np.float32, seed=1)


@pytest.fixture(scope="module")
def thinking(tmp_path_factory, params):
    """A Kimi-K2-Thinking-layout checkpoint (index + 3 shards) written by save_hf(int4=True)."""
    return save_hf(params, make_cfg(), tmp_path_factory.mktemp("thinking"), int4=True, num_shards=3)


def read_all(path):
    with Checkpoint(path) as ck:
        return {n: ck.read(n) for n in ck.tensors}


# ------------------------------------------------------------------------------------------------------
def test_layout_is_the_thinking_release(thinking):
    cfg = make_cfg()
    hf = json.loads((thinking / "config.json").read_text())
    assert hf["quantization_config"]["quant_method"] == "compressed-tensors"
    assert hf["quantization_config"]["format"] == "pack-quantized"
    assert (thinking / "model.safetensors.index.json").is_file()
    t = read_all(thinking)
    D, F = cfg.hidden_size, cfg.moe_intermediate_size
    for p, (o, i) in (("gate_proj", (F, D)), ("up_proj", (F, D)), ("down_proj", (D, F))):
        w = EXPERT.format(i=2, e=3, p=p)
        assert w not in t
        assert t[w + "_packed"].dtype == np.int32 and t[w + "_packed"].shape == (o, i // 8)
        assert t[w + "_scale"].dtype == BF16 and t[w + "_scale"].shape == (o, i // 32)
        assert t[w + "_shape"].dtype == np.int64 and list(t[w + "_shape"]) == [o, i]
    # everything else plain bf16, as released (the router bias float32)
    assert t["model.layers.1.self_attn.q_a_proj.weight"].dtype == BF16
    assert t["model.layers.1.mlp.shared_experts.up_proj.weight"].dtype == BF16
    assert t["model.layers.0.mlp.up_proj.weight"].dtype == BF16
    assert t["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == np.float32


def test_pack_is_bit_exact_against_compressed_tensors(oracle, thinking):
    """Our packer (checkpoint.int4.pack / save_hf) against compressed-tensors' PackedQuantizationCompressor: the
    same int32 words for the same weight and scales, and its decompression of our words is our weight."""
    rng = np.random.default_rng(0)
    nib = rng.integers(0, 16, (48, 96)).astype(np.uint8)  # every nibble, -8 included
    nib[0, :16] = np.arange(16)
    scale = rng.uniform(0.01, 2.0, (48, 3)).astype(BF16)
    cases = [(I4.pack(nib), scale)]
    t = read_all(thinking)
    w = EXPERT.format(i=1, e=2, p="down_proj")
    cases.append((t[w + "_packed"], t[w + "_scale"]))
    for packed, s in cases:
        weight = I4.dequantize(packed, s)
        out = oracle.run({"pack_int4": {"weight": weight, "scale": s.astype(np.float32), "packed": packed}})
        np.testing.assert_array_equal(out["pack_int4.weight_packed"], packed)
        assert list(out["pack_int4.weight_shape"]) == list(weight.shape)
        np.testing.assert_array_equal(out["pack_int4.unpacked"], weight)


def test_repack_to_device_layout_keeps_the_values():
    rng = np.random.default_rng(1)
    nib = rng.integers(0, 16, (40, 64)).astype(np.uint8)
    scale = rng.uniform(0.1, 1, (40, 2)).astype(BF16)
    packed = I4.pack(nib)
    np.testing.assert_array_equal(I4.unpack(packed), nib)
    v, s = I4.to_k2jax(packed, scale)
    assert v.shape == (64, 20) and v.dtype == np.uint8 and s.shape == (2, 40)
    qw = QuantizedWeight(v, s, "int4")
    np.testing.assert_array_equal(qw.dequantize(np.float32), I4.dequantize(packed, scale).T)
    p2, s2 = I4.from_k2jax(v, s)
    np.testing.assert_array_equal(p2, packed)
    np.testing.assert_array_equal(s2, scale)


# ------------------------------------------------------------------------------------------------------
# Bad inputs: one clear error naming the tensor, found before any weight is read.
def rewrite(src, dst, edit=None, config=None):
    """A copy of checkpoint `src` as one model.safetensors with edit(tensors) applied, config.json edited too."""
    dst.mkdir()
    tensors = read_all(src)
    if edit:
        edit(tensors)
    write_file(dst / "model.safetensors", tensors, {"format": "pt"})
    hf = json.loads((src / "config.json").read_text())
    if config:
        config(hf)
    (dst / "config.json").write_text(json.dumps(hf))
    return dst


@pytest.fixture
def no_weight_reads(monkeypatch):
    """Fail the test if a load reads anything but scales and weight_shape (the checks' small reads)."""
    real = Checkpoint.read
    read = []

    def spy(self, name, *a, **k):
        if not name.endswith(("_scale", "_scale_inv", "_shape")):
            read.append(name)
        return real(self, name, *a, **k)

    monkeypatch.setattr(Checkpoint, "read", spy)
    return read


def expect_refused(path, *needles, reads=None, quant=None):
    if reads is not None:
        reads.clear()  # (writing the bad copy read it all)
    with pytest.raises(ValueError) as e:
        load_hf(path, quant=quant)
    msg = str(e.value)
    for n in needles:
        assert n in msg, msg
    if reads is not None:
        assert reads == [], f"weights were read before the error: {reads[:3]}"
    return msg


W = EXPERT.format(i=2, e=1, p="up_proj")


def test_bad_wrong_packed_shape(thinking, tmp_path, no_weight_reads):
    def edit(t):
        t[W + "_packed"] = t[W + "_packed"][:, :-1].copy()
    expect_refused(rewrite(thinking, tmp_path / "c", edit), W + "_packed", "expected I32 [32, 8]",
                   reads=no_weight_reads)


def test_bad_scale_shape(thinking, tmp_path, no_weight_reads):
    def edit(t):
        t[W + "_scale"] = np.concatenate([t[W + "_scale"]] * 2, axis=1)
    expect_refused(rewrite(thinking, tmp_path / "c", edit), W + "_scale", "[32, 4]", "expected a float [32, 2]",
                   reads=no_weight_reads)


def test_bad_group_size_does_not_divide(tmp_path, no_weight_reads):
    """moe_intermediate_size 48: the down projections' input dim is not a multiple of 32."""
    cfg = make_cfg(moe_intermediate_size=48)
    d = save_hf(random_params(cfg, np.float32), cfg, tmp_path / "plain", num_shards=None)

    def edit(t):
        for n in [n for n in t if ".mlp.experts." in n]:
            w = t.pop(n).astype(np.float32)
            o, i = w.shape
            t[n + "_packed"] = I4.pack(np.full((o, i), 8, np.uint8))
            t[n + "_scale"] = np.ones((o, -(-i // 32)), BF16)
            t[n + "_shape"] = np.array([o, i], np.int64)
    bad = EXPERT.format(i=1, e=0, p="down_proj") + "_packed"
    msg = expect_refused(rewrite(d, tmp_path / "c", edit, lambda hf: hf.update(
        quantization_config=I4.quantization_config())), bad, "group size 32 does not divide its input dim 48",
        reads=no_weight_reads)
    assert "gate_proj.weight_packed" not in msg  # their input dim (64) is fine


@pytest.mark.parametrize("value", [np.nan, 0.0])
def test_bad_nan_or_zero_scale(thinking, tmp_path, no_weight_reads, value):
    def edit(t):
        s = t[W + "_scale"].astype(np.float32)
        s[5, 1] = value
        t[W + "_scale"] = s.astype(BF16)
    expect_refused(rewrite(thinking, tmp_path / "c", edit), W + "_scale", "not finite and positive",
                   "[row, group] [5, 1]", reads=no_weight_reads)


def test_bad_weight_shape_disagrees_with_config(thinking, tmp_path, no_weight_reads):
    def edit(t):
        t[W + "_shape"] = np.array([32, 96], np.int64)
    expect_refused(rewrite(thinking, tmp_path / "c", edit), W + "_shape", "[32, 96]", "implies the weight is [32, 64]",
                   reads=no_weight_reads)


@pytest.mark.parametrize("change,key", [
    (lambda qc: qc.update(format="marlin-24"), "quantization_config.format 'marlin-24'"),
    (lambda qc: qc.update(quant_method="awq"), "quantization_config.quant_method 'awq'"),
    (lambda qc: qc["config_groups"]["group_0"]["weights"].update(num_bits=8), "weights.num_bits 8"),
    (lambda qc: qc["config_groups"]["group_0"]["weights"].update(symmetric=False), "weights.symmetric False"),
    (lambda qc: qc["config_groups"]["group_0"].update(input_activations={"num_bits": 8}), "input_activations"),
])
def test_bad_unknown_format(thinking, tmp_path, no_weight_reads, change, key):
    expect_refused(rewrite(thinking, tmp_path / "c", config=lambda hf: change(hf["quantization_config"])), key,
                   reads=no_weight_reads)


def test_bad_mix_of_int4_and_plain_experts(thinking, tmp_path, no_weight_reads):
    plain = EXPERT.format(i=2, e=3, p="gate_proj")

    def edit(t):
        w = I4.dequantize(t.pop(plain + "_packed"), t.pop(plain + "_scale"))
        del t[plain + "_shape"]
        t[plain] = w.astype(BF16)
    expect_refused(rewrite(thinking, tmp_path / "c", edit), "layer 2 mixes INT4 and plain routed experts", plain,
                   "weight_packed' (model.safetensors) is INT4", reads=no_weight_reads)


def test_bad_int4_outside_the_routed_experts(thinking, tmp_path, no_weight_reads):
    name = "model.layers.1.self_attn.q_a_proj.weight"

    def edit(t):
        w = t.pop(name).astype(np.float32)
        t[name + "_packed"], t[name + "_scale"] = I4.quantize(w)
        t[name + "_shape"] = np.array(w.shape, np.int64)
    expect_refused(rewrite(thinking, tmp_path / "c", edit), name + "_packed", "routed experts only",
                   reads=no_weight_reads)
