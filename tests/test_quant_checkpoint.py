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
from k2jax.checkpoint import int4 as int4_format
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
    """Our packer (checkpoint.int4.pack_words / save_hf) against compressed-tensors' PackedQuantizationCompressor: the
    same int32 words for the same weight and scales, and its decompression of our words is our weight."""
    rng = np.random.default_rng(0)
    nib = rng.integers(0, 16, (48, 96)).astype(np.uint8)  # every nibble, -8 included
    nib[0, :16] = np.arange(16)
    scale = rng.uniform(0.01, 2.0, (48, 3)).astype(BF16)
    cases = [(int4_format.pack_words(nib), scale)]
    t = read_all(thinking)
    w = EXPERT.format(i=1, e=2, p="down_proj")
    cases.append((t[w + "_packed"], t[w + "_scale"]))
    for packed, s in cases:
        weight = int4_format.dequantize_packed_int4(packed, s)
        out = oracle.run({"pack_int4": {"weight": weight, "scale": s.astype(np.float32), "packed": packed}})
        np.testing.assert_array_equal(out["pack_int4.weight_packed"], packed)
        assert list(out["pack_int4.weight_shape"]) == list(weight.shape)
        np.testing.assert_array_equal(out["pack_int4.unpacked"], weight)


def test_repack_to_device_layout_keeps_the_values():
    rng = np.random.default_rng(1)
    nib = rng.integers(0, 16, (40, 64)).astype(np.uint8)
    scale = rng.uniform(0.1, 1, (40, 2)).astype(BF16)
    packed = int4_format.pack_words(nib)
    np.testing.assert_array_equal(int4_format.unpack_words(packed), nib)
    v, s = int4_format.to_k2jax(packed, scale)
    assert v.shape == (64, 20) and v.dtype == np.uint8 and s.shape == (2, 40)
    qw = QuantizedWeight(v, s, "int4")
    np.testing.assert_array_equal(qw.dequantize(np.float32), int4_format.dequantize_packed_int4(packed, scale).T)
    p2, s2 = int4_format.from_k2jax(v, s)
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
            t[n + "_packed"] = int4_format.pack_words(np.full((o, i), 8, np.uint8))
            t[n + "_scale"] = np.ones((o, -(-i // 32)), BF16)
            t[n + "_shape"] = np.array([o, i], np.int64)
    bad = EXPERT.format(i=1, e=0, p="down_proj") + "_packed"
    msg = expect_refused(rewrite(d, tmp_path / "c", edit, lambda hf: hf.update(
        quantization_config=int4_format.quantization_config())), bad, "group size 32 does not divide its input dim 48",
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
        w = int4_format.dequantize_packed_int4(t.pop(plain + "_packed"), t.pop(plain + "_scale"))
        del t[plain + "_shape"]
        t[plain] = w.astype(BF16)
    expect_refused(rewrite(thinking, tmp_path / "c", edit), "layer 2 mixes INT4 and plain routed experts", plain,
                   "weight_packed' (model.safetensors) is INT4", reads=no_weight_reads)


def test_bad_int4_outside_the_routed_experts(thinking, tmp_path, no_weight_reads):
    name = "model.layers.1.self_attn.q_a_proj.weight"

    def edit(t):
        w = t.pop(name).astype(np.float32)
        t[name + "_packed"], t[name + "_scale"] = int4_format.quantize_packed_int4(w)
        t[name + "_shape"] = np.array(w.shape, np.int64)
    expect_refused(rewrite(thinking, tmp_path / "c", edit), name + "_packed", "routed experts only",
                   reads=no_weight_reads)


# ------------------------------------------------------------------------------------------------------
# Loads that hold the weights quantized, and what they weigh.
def dequantized(tree, dtype=jnp.float32):
    return jax.tree.map(lambda x: x.dequantize(dtype) if isinstance(x, QuantizedWeight) else x.astype(dtype)
                        if jnp.issubdtype(x.dtype, jnp.floating) else x, tree,
                        is_leaf=lambda x: isinstance(x, QuantizedWeight))


def logits_of(cfg, params, ids):
    from k2jax import K2Model

    return np.asarray(jax.jit(lambda p, t: K2Model(cfg).apply({"params": p}, t))(params, jnp.asarray(ids)))


IDS = np.random.default_rng(3).integers(0, 96, (2, 9))


def test_int4_parity_against_transformers_on_the_unpacked_weights(oracle, thinking):
    """HF runs the checkpoint as compressed-tensors unpacks it; k2jax the QuantizedWeight leaves it loads,
    dequantized (float32): the values held are the values stored."""
    out = oracle.run({"load": str(thinking), "inputs": {"input_ids": IDS}})
    cfg, params = load_hf(thinking, quant="int4")
    got = logits_of(cfg, dequantized(params), IDS)
    np.testing.assert_allclose(got, out["logits"], rtol=1e-4, atol=1e-4 * np.abs(out["logits"]).max())


def test_int4_parity_held_quantized(oracle, thinking):
    """The model computing on the INT4 leaves themselves (float32 compute) against transformers."""
    out = oracle.run({"load": str(thinking), "inputs": {"input_ids": IDS}})
    cfg, params = load_hf(thinking, dtype=jnp.float32, quant="int4")
    got = logits_of(cfg, params, IDS)
    np.testing.assert_allclose(got, out["logits"], rtol=1e-4, atol=1e-4 * np.abs(out["logits"]).max())


def device_bytes(tree, device):
    """Bytes of the tree's arrays held on `device`, and of one copy of the tree."""
    on, total = 0, 0
    for x in jax.tree.leaves(tree):
        total += x.nbytes
        on += sum(s.data.nbytes for s in x.addressable_shards if s.device == device)
    return on, total


@pytest.fixture(scope="module")
def converted(tmp_path_factory, params, thinking):
    from k2jax.checkpoint.convert import convert

    root = tmp_path_factory.mktemp("converted")
    fp8_src = save_hf(params, make_cfg(), root / "fp8_src", fp8=True, num_shards=2)
    convert(thinking, root / "int4", dtype="int4", quiet=True)
    convert(fp8_src, root / "float8", dtype="float8", quiet=True)
    return {"int4": root / "int4", "float8": root / "float8", "fp8_src": fp8_src}


@pytest.mark.parametrize("dtype,quant", [("int4", "int4"), ("float8", "fp8"), ("float8", "int4")])
def test_held_not_expanded_and_bytes_match_plan(converted, dtype, quant):
    import k2jax
    from k2jax.plan import plan

    mesh = k2jax.make_mesh("expert=4,tensor=2")
    cfg, p = k2jax.load(converted[dtype], quant=quant, mesh=mesh)
    experts = p["moe_layers"]["mlp"]["experts"]
    for k in ("gate_proj", "up_proj", "down_proj"):
        assert isinstance(experts[k], QuantizedWeight) and experts[k].fmt == quant
        assert experts[k].values.dtype == (jnp.uint8 if quant == "int4" else jnp.float8_e4m3fn), k
    attn = p["moe_layers"]["self_attn"]["q_b_proj"]
    assert isinstance(attn, QuantizedWeight) if quant == "fp8" else attn.dtype == jnp.bfloat16
    on, total = device_bytes(p, jax.devices()[0])
    want = plan(cfg, "expert=4,tensor=2", quant=quant)
    assert total == pytest.approx(want.total, rel=0.01)
    assert on == pytest.approx(want.per_device, rel=0.01)
    bf16 = plan(cfg, "expert=4,tensor=2")
    assert want.total < (0.62 if quant == "fp8" else 0.75) * bf16.total  # (tiny dims: norms weigh more)


@pytest.mark.parametrize("dtype,quant", [("int4", "int4"), ("float8", "fp8")])
def test_quantized_load_warns_once_per_fallback_param(converted, dtype, quant):
    """expert=8 with 4 experts: the experts fall back (replicated). Each such param warns once, as held
    (the loader also places the stored layout's scales, which must not warn again)."""
    import warnings

    import k2jax
    from k2jax.placement import fallbacks

    mesh = k2jax.make_mesh("expert=8")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        cfg, _ = k2jax.load(converted[dtype], quant=quant, mesh=mesh)
    names = [str(w.message).split()[2] for w in record if str(w.message).startswith("k2jax.placement")]
    want = sorted(f.name for f in fallbacks(cfg, dict(mesh.shape), quant=quant))
    assert "moe_layers.mlp.experts.gate_proj" in want and sorted(names) == want


def test_convert_int4_round_trip(converted, thinking):
    import k2jax
    from k2jax.checkpoint import orbax_layout

    m = orbax_layout.read_manifest(converted["int4"])
    assert (m["dtype"], m["quant"], m["param_dtype"]) == ("int4", "int4", "bfloat16")
    name = "moe_layers.mlp.experts.gate_proj"
    assert m["leaves"][name + ".values"]["dtype"] == "uint8" and m["leaves"][name + ".scales"]["dtype"] == "bfloat16"
    assert name not in m["leaves"] and name + "_scale" not in m["leaves"]  # the tree of abstract_params, nothing else
    _, held = k2jax.load(converted["int4"], quant="int4")
    _, want = load_hf(thinking, quant="int4")
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), held, want)
    _, plain = k2jax.load(converted["int4"])
    _, plain_hf = load_hf(thinking)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), plain, plain_hf)
    with pytest.raises(ValueError, match="quant='fp8' needs a conversion that holds FP8"):
        k2jax.load(converted["int4"], quant="fp8")


def test_convert_int4_refuses_an_fp8_source(converted, tmp_path):
    from k2jax.checkpoint.convert import ConvertError, convert

    with pytest.raises(ConvertError, match="--dtype int4 keeps the INT4 routed experts"):
        convert(converted["fp8_src"], tmp_path / "x", dtype="int4", quiet=True)
    assert not (tmp_path / "x").exists()


def test_fp8_to_int4_requantization_error(converted):
    """FP8 release -> INT4 experts: exactly ops.quant.quantize_weight of the dequantized FP8 expert, on load_hf and
    load alike; the logit error against the FP8 logits is measured (and bounded: it is a 4-bit rounding)."""
    import k2jax
    from k2jax.ops.quant import quantize_weight

    cfg, fp8 = load_hf(converted["fp8_src"], dtype=jnp.float32)
    _, req = load_hf(converted["fp8_src"], dtype=jnp.float32, quant="int4")
    _, req_dev = k2jax.load(converted["float8"], dtype=jnp.float32, quant="int4")
    for k in ("gate_proj", "up_proj", "down_proj"):
        w = np.asarray(fp8["moe_layers"]["mlp"]["experts"][k])
        q = quantize_weight(w, "int4", 1, lead_ndim=2)
        for got in (req, req_dev):
            np.testing.assert_array_equal(np.asarray(got["moe_layers"]["mlp"]["experts"][k].values), q.values)
            np.testing.assert_array_equal(np.asarray(got["moe_layers"]["mlp"]["experts"][k].scales), q.scales)
    a, b = logits_of(cfg, fp8, IDS), logits_of(cfg, dequantized(req), IDS)
    rel = float(np.linalg.norm(b - a) / np.linalg.norm(a))
    print(f"FP8 -> INT4 requantization: relative logit error {rel:.4f} (L2), max abs {np.abs(b - a).max():.4f}")
    assert 1e-4 < rel < 0.2


def test_quant_refused_for_plain_checkpoints(params, tmp_path):
    d = save_hf(params, make_cfg(), tmp_path / "bf16", num_shards=None)
    for quant in ("fp8", "int4"):
        with pytest.raises(ValueError, match=f"quant='{quant}' keeps"):
            load_hf(d, quant=quant)
    with pytest.raises(ValueError, match=r"quant must be one of \(None, 'fp8', 'int4'\), got 'int8'"):
        load_hf(d, quant="int8")
