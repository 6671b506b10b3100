"""k2jax.checkpoint: the name table, FP8 block scales, safetensors headers, load_hf / save_hf (no torch)."""

import concurrent.futures
import json
import struct

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from k2jax import K2Config, abstract_params, load_hf
from k2jax.checkpoint import (
    Checkpoint, SafetensorsError, SafetensorsFile, UnknownTensorError, dequantize_fp8_blocks, expected_names,
    layer_names, quantize_fp8_blocks, resolve, save_hf, scale_shape, source_shape,
)
from k2jax.checkpoint.fp8 import ensure_numpy_float8
from k2jax.checkpoint.safetensors_io import write_file
from tests.conftest import flat

ensure_numpy_float8()
from safetensors.numpy import load_file  # noqa: E402

# Every dimension distinct, so a transposed or mis-split weight cannot have the right shape by accident.
BASE = dict(
    vocab_size=40, hidden_size=48, num_hidden_layers=4, num_attention_heads=3, num_key_value_heads=3,
    intermediate_size=40, moe_intermediate_size=18, n_routed_experts=6, n_shared_experts=2,
    num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=20,
    qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, tie_word_embeddings=False,
)
VARIANTS = {
    "base": {},
    "no_q_lora": dict(q_lora_rank=None),
    "all_moe_tied": dict(first_k_dense_replace=0, tie_word_embeddings=True),
    "three_dense": dict(first_k_dense_replace=3),
    "all_dense": dict(first_k_dense_replace=4, q_lora_rank=None),
    "no_shared": dict(n_shared_experts=0),
    "no_experts": dict(n_routed_experts=None),
}
BLOCK = (16, 16)  # small blocks: the tiny weights get several blocks and partial edge blocks


def make_cfg(**changes):
    return K2Config.from_hf_config({**BASE, **changes})


def random_params(cfg, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda l: rng.standard_normal(l.shape).astype(l.dtype), abstract_params(cfg, dtype))


def assert_same_tree(got, want):
    g, w = flat(got), flat(want)
    assert g.keys() == w.keys()
    for k in w:
        assert (g[k].shape, g[k].dtype) == (w[k].shape, w[k].dtype), k


def naive_dequantize(q, s, block):
    out = np.zeros(q.shape, np.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            rows, cols = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
            out[rows, cols] = q[rows, cols].astype(np.float32) * s[i, j]
    return out


def read_all(path):
    ckpt = Checkpoint(path)
    with ckpt:
        return {n: ckpt.read(n) for n in ckpt.tensors}


# ------------------------------------------------------------------------------------------------------
# The table
@pytest.mark.parametrize("variant", VARIANTS)
def test_table_fills_every_slot_of_abstract_params_exactly_once(variant):
    cfg = make_cfg(**VARIANTS[variant])
    want = set()
    for path, leaf in jax.tree_util.tree_leaves_with_path(abstract_params(cfg)):
        key = tuple(k.key for k in path)
        lead = leaf.shape[:(key[0] in ("dense_layers", "moe_layers")) + ("experts" in key)]
        want |= {(key, idx) for idx in np.ndindex(*lead)}
    got = [(t.leaf, t.index) for t in (resolve(n, cfg) for n in expected_names(cfg))]
    assert len(got) == len(set(got))
    assert set(got) == want


def test_source_shapes_follow_the_hf_module_definitions():
    # Shapes of transformers' DeepseekV3 nn.Linear(in, out).weight = [out, in], written out by hand.
    cfg = make_cfg(first_k_dense_replace=1)
    V, D, N, K, P, Vh, R, Q, F, Fm, E = 40, 48, 3, 12, 8, 10, 20, 24, 40, 18, 6
    hf = {
        "model.embed_tokens.weight": (V, D), "lm_head.weight": (V, D), "model.norm.weight": (D,),
        "input_layernorm.weight": (D,), "post_attention_layernorm.weight": (D,),
        "self_attn.q_a_proj.weight": (Q, D), "self_attn.q_a_layernorm.weight": (Q,),
        "self_attn.q_b_proj.weight": (N * (K + P), Q), "self_attn.kv_a_proj_with_mqa.weight": (R + P, D),
        "self_attn.kv_a_layernorm.weight": (R,), "self_attn.kv_b_proj.weight": (N * (K + Vh), R),
        "self_attn.o_proj.weight": (D, N * Vh),
        "mlp.gate_proj.weight": (F, D), "mlp.up_proj.weight": (F, D), "mlp.down_proj.weight": (D, F),
        "mlp.gate.weight": (E, D), "mlp.gate.e_score_correction_bias": (E,),
        "gate_proj.weight": (Fm, D), "up_proj.weight": (Fm, D), "down_proj.weight": (D, Fm),
        "shared_experts.gate_proj.weight": (2 * Fm, D), "shared_experts.up_proj.weight": (2 * Fm, D),
        "shared_experts.down_proj.weight": (D, 2 * Fm),
    }
    names = expected_names(cfg)
    assert len(names) == 3 + 9 + 3 + 3 * (9 + 2 + 3 * E + 3)
    for name in names:
        key = next(k for k in sorted(hf, key=len, reverse=True) if name.endswith(k))
        assert source_shape(name, cfg) == hf[key], name
    assert source_shape("model.layers.0.self_attn.q_proj.weight", make_cfg(q_lora_rank=None)) == (N * (K + P), D)


def test_full_configs_expect_the_release_tensor_counts(repo):
    cfg = K2Config.from_hf_config(repo / "configs" / "kimi_k2.json")
    names = expected_names(cfg)
    fp8 = sum(resolve(n, cfg).fp8 for n in names)
    # 139,644 tensors in the release = weights + one scale per FP8 weight + 61 inv_freq buffers.
    assert len(names) + fp8 + 61 == 139_644
    assert source_shape("model.layers.5.self_attn.kv_a_proj_with_mqa.weight", cfg) == (576, 7168)
    assert source_shape("model.layers.60.mlp.experts.383.down_proj.weight", cfg) == (7168, 2048)
    assert len(layer_names(cfg, 0)) == 12 and len(layer_names(cfg, 1)) == 11 + 3 * 384 + 3


def test_resolve_skips_and_rejects():
    cfg = make_cfg()  # layer 0 dense, layers 1-3 MoE, 6 experts
    t = resolve("model.layers.2.mlp.experts.5.up_proj.weight", cfg)
    assert (t.group, t.layer, t.expert, t.path) == ("moe_layers", 1, 5, ("mlp", "experts", "up_proj"))
    assert resolve("model.layers.0.mlp.up_proj.weight", cfg).leaf == ("dense_layers", "mlp", "up_proj")
    assert resolve("model.layers.3.self_attn.rotary_emb.inv_freq", cfg) is None
    for mtp in ("model.layers.4.enorm.weight", "model.layers.4.eh_proj.weight",
                "model.layers.4.mlp.experts.0.gate_proj.weight", "model.layers.4.shared_head.head.weight"):
        assert resolve(mtp, cfg) is None
    assert resolve("lm_head.weight", make_cfg(tie_word_embeddings=True)) is None
    bad = {
        "model.layers.0.mlp.experts.0.gate_proj.weight": "layer 0 is dense",
        "model.layers.1.mlp.gate_proj.weight": "MoE layer",
        "model.layers.1.mlp.experts.6.gate_proj.weight": "expert 6",
        "model.layers.01.input_layernorm.weight": "leading zero",
        "model.layers.1.self_attn.q_proj.weight": "q_lora_rank",
        "model.layers.1.self_attn.k_proj.weight": "unknown",
        "model.embed.weight": "unknown",
        "model.layers.1.self_attn.o_proj.weight_scale_inv": "scale",
    }
    for name, why in bad.items():
        with pytest.raises(UnknownTensorError, match=why):
            resolve(name, cfg)


# ------------------------------------------------------------------------------------------------------
# FP8
def test_scale_shape_rule():
    assert scale_shape((576, 7168)) == (5, 56)
    assert scale_shape((300, 200)) == (3, 2)
    assert scale_shape((128, 256)) == (1, 2)
    assert scale_shape((7, 384, 129, 1)) == (7, 384, 2, 1)


@pytest.mark.parametrize("shape,block", [((300, 200), (128, 128)), ((576, 7168), (128, 128)),
                                         ((256, 128), (128, 128)), ((37, 50), (16, 8))])
def test_dequantize_matches_naive_loop(shape, block):
    rng = np.random.default_rng(1)
    q = (rng.standard_normal(shape) * 50).clip(-448, 448).astype(ml_dtypes.float8_e4m3fn)
    s = rng.uniform(1e-4, 1e-2, scale_shape(shape, block)).astype(np.float32)
    want = naive_dequantize(q, s, block)
    got = dequantize_fp8_blocks(q, s, block, np.float32)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(dequantize_fp8_blocks(q, s, block, jnp.bfloat16), want.astype(jnp.bfloat16))
    np.testing.assert_array_equal(np.asarray(dequantize_fp8_blocks(jnp.asarray(q), jnp.asarray(s), block)), want)
    with pytest.raises(ValueError, match="scale_inv shape"):
        dequantize_fp8_blocks(q, s[:, :-1], block)


def test_quantize_round_trip_and_zero_blocks():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((300, 200)).astype(np.float32)
    w[:128, :128] = 0.0  # a whole zero block
    w[290:, 190:] *= 1e4  # a partial edge block with a much larger range
    q, s = quantize_fp8_blocks(w)
    assert q.dtype == ml_dtypes.float8_e4m3fn and s.dtype == np.float32 and s.shape == (3, 2)
    assert s[0, 0] == 1.0 and np.all(s > 0) and np.all(np.isfinite(q.astype(np.float32)))
    back = dequantize_fp8_blocks(q, s)
    np.testing.assert_array_equal(back[:128, :128], 0.0)
    err = np.abs(back - w) / np.repeat(np.repeat(s * 448, 128, 0), 128, 1)[:300, :200]
    assert err.max() <= 2.0**-4  # E4M3: 3 mantissa bits, half an ulp of the block's largest value
    qj, sj = quantize_fp8_blocks(jnp.asarray(w))  # XLA may divide by a reciprocal: scales equal to an ulp
    np.testing.assert_allclose(np.asarray(sj), s, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(dequantize_fp8_blocks(qj, sj)), back, rtol=2.0**-3, atol=1e-30)


# ------------------------------------------------------------------------------------------------------
# Round trips through save_hf / load_hf
@pytest.mark.parametrize("variant", VARIANTS)
def test_round_trip_float32_is_exact(tmp_path, variant):
    cfg = make_cfg(**VARIANTS[variant])
    params = random_params(cfg)
    save_hf(params, cfg, tmp_path, num_shards=3)
    assert (tmp_path / "model-3-of-3.safetensors").is_file()
    cfg2, got = load_hf(tmp_path)
    assert cfg2 == cfg
    assert_same_tree(got, abstract_params(cfg, jnp.float32))
    g, w = flat(got), flat(params)
    for k in w:
        np.testing.assert_array_equal(np.asarray(g[k]), w[k], err_msg=k)


def test_round_trip_bf16_single_file(tmp_path):
    cfg = make_cfg()
    params = random_params(cfg, jnp.bfloat16)
    save_hf(params, cfg, tmp_path, num_shards=None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    _, got = load_hf(tmp_path)
    assert_same_tree(got, abstract_params(cfg, jnp.bfloat16))
    for k, v in flat(params).items():
        np.testing.assert_array_equal(np.asarray(flat(got)[k]), v, err_msg=k)


@pytest.mark.parametrize("variant", ["base", "no_q_lora"])
def test_round_trip_fp8_release_layout(tmp_path, variant):
    cfg = make_cfg(**VARIANTS[variant])
    save_hf(random_params(cfg), cfg, tmp_path, fp8=True, num_shards=2, block=BLOCK)
    raw = load_file(tmp_path / "model-1-of-2.safetensors") | load_file(tmp_path / "model-2-of-2.safetensors")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(raw)
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"]["weight_block_size"] == [16, 16]
    for name, x in raw.items():  # the released dtypes
        if name.endswith("_scale_inv"):
            assert x.dtype == np.float32 and x.shape == scale_shape(raw[name[:-10]].shape, BLOCK), name
        elif "inv_freq" in name or "e_score_correction_bias" in name:
            assert x.dtype == np.float32, name
        elif resolve(name, cfg).fp8:
            assert x.dtype == ml_dtypes.float8_e4m3fn and name + "_scale_inv" in raw, name
        else:
            assert x.dtype == ml_dtypes.bfloat16, name
    _, got = load_hf(tmp_path)
    assert_same_tree(got, abstract_params(cfg, jnp.bfloat16))
    _, got32 = load_hf(tmp_path, dtype=jnp.float32)
    assert_same_tree(got32, abstract_params(cfg, jnp.float32))
    g, g32 = flat(got), flat(got32)
    for name, x in raw.items():
        if name.endswith("_scale_inv") or "inv_freq" in name:
            continue
        t = resolve(name, cfg)
        key = jax.tree_util.keystr(tuple(jax.tree_util.DictKey(k) for k in t.leaf))
        w = naive_dequantize(x, raw[name + "_scale_inv"], BLOCK) if t.fp8 else x.astype(np.float32)
        want = t.transform.forward(w, np.asarray(g32[key])[t.index].shape)
        np.testing.assert_array_equal(np.asarray(g32[key])[t.index], want, err_msg=name)
        if g[key].dtype == jnp.bfloat16:
            np.testing.assert_array_equal(np.asarray(g[key])[t.index], want.astype(jnp.bfloat16), err_msg=name)


def test_loaded_layout_computes_what_hf_computes(tmp_path):
    """Independent of the table: HF's y = x @ W.T (then .view(N, H)) against k2jax's einsums."""
    cfg = make_cfg()
    save_hf(random_params(cfg), cfg, tmp_path)
    _, p = load_hf(tmp_path)
    raw = read_all(tmp_path)
    N, K, P, Vh = 3, 12, 8, 10
    rng = np.random.default_rng(3)
    L, M = "model.layers.1.", p["moe_layers"]
    attn = jax.tree.map(lambda a: np.asarray(a)[0], M["self_attn"])
    x = rng.standard_normal(48).astype(np.float32)
    cq = rng.standard_normal(24).astype(np.float32)
    ckv = rng.standard_normal(20).astype(np.float32)
    o = rng.standard_normal((N, Vh)).astype(np.float32)

    def close(a, b):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)

    close(x @ raw[L + "self_attn.q_a_proj.weight"].T, np.einsum("d,dq->q", x, attn["q_a_proj"]))
    close((cq @ raw[L + "self_attn.q_b_proj.weight"].T).reshape(N, K + P),
          np.einsum("q,qnh->nh", cq, attn["q_b_proj"]))
    close(x @ raw[L + "self_attn.kv_a_proj_with_mqa.weight"].T, np.einsum("d,dr->r", x, attn["kv_a_proj_with_mqa"]))
    close((ckv @ raw[L + "self_attn.kv_b_proj.weight"].T).reshape(N, K + Vh),
          np.einsum("r,rnh->nh", ckv, attn["kv_b_proj"]))
    close(o.reshape(-1) @ raw[L + "self_attn.o_proj.weight"].T, np.einsum("nv,nvd->d", o, attn["o_proj"]))
    close(x @ raw[L + "mlp.gate.weight"].T, x @ np.asarray(M["mlp"]["gate"]["kernel"])[0])
    for e in range(6):
        for proj in ("gate_proj", "up_proj"):
            close(x @ raw[f"{L}mlp.experts.{e}.{proj}.weight"].T, x @ np.asarray(M["mlp"]["experts"][proj])[0, e])
    _, pq = load_hf(save_hf(random_params(make_cfg(q_lora_rank=None)), make_cfg(q_lora_rank=None), tmp_path / "q"))
    raw_q = read_all(tmp_path / "q")
    close((x @ raw_q["model.layers.0.self_attn.q_proj.weight"].T).reshape(N, K + P),
          np.einsum("d,dnh->nh", x, np.asarray(pq["dense_layers"]["self_attn"]["q_proj"])[0]))


# ------------------------------------------------------------------------------------------------------
# Validation: every problem in one error
def rewrite_single(path, tensors):
    for f in path.glob("model*"):
        f.unlink()
    write_file(path / "model.safetensors", tensors)


def test_all_problems_in_one_error(tmp_path):
    cfg = make_cfg()
    save_hf(random_params(cfg), cfg, tmp_path, fp8=True, num_shards=2, block=BLOCK)
    t = read_all(tmp_path)
    for proj in ("gate_proj", "up_proj", "down_proj"):  # expert 4 of layer 2 is gone
        del t[f"model.layers.2.mlp.experts.4.{proj}.weight"], t[f"model.layers.2.mlp.experts.4.{proj}.weight_scale_inv"]
    t["model.layers.1.self_attn.k_proj.weight"] = np.zeros((4, 4), np.float32)
    t["model.layers.3.mlp.shared_experts.up_proj.weight"] = np.zeros((36, 47), ml_dtypes.bfloat16)
    del t["model.layers.3.mlp.shared_experts.up_proj.weight_scale_inv"]
    del t["model.layers.1.self_attn.o_proj.weight_scale_inv"]
    t["model.layers.0.mlp.down_proj.weight_scale_inv"][1, 2] = np.nan
    kv_b_scale = "model.layers.3.self_attn.kv_b_proj.weight_scale_inv"
    t[kv_b_scale] = t[kv_b_scale][:, :1]
    del t["model.norm.weight"]
    rewrite_single(tmp_path, t)
    with pytest.raises(ValueError) as e:
        load_hf(tmp_path)
    msg = str(e.value)
    assert "7 problem(s)" in msg
    for needle in ["missing expert 4 of layer 2",
                   "unknown tensor 'model.layers.1.self_attn.k_proj.weight': no rule in k2jax.checkpoint.names.RULES "
                   "(model.safetensors)",
                   "'model.layers.3.mlp.shared_experts.up_proj.weight' (model.safetensors): shape [36, 47], "
                   "config.json implies [36, 48]",
                   "'model.layers.1.self_attn.o_proj.weight' (model.safetensors): F8_E4M3 weight without its "
                   "scale 'model.layers.1.self_attn.o_proj.weight_scale_inv'",
                   "'model.layers.0.mlp.down_proj.weight_scale_inv' (model.safetensors): 1 scale(s) not finite",
                   "'model.layers.3.self_attn.kv_b_proj.weight_scale_inv' (model.safetensors): shape [5, 1], "
                   "expected [5, 2]",
                   "missing tensor 'model.norm.weight'"]:
        assert needle in msg


def test_more_problems_missing_layer_orphan_scale_dtype(tmp_path):
    cfg = make_cfg()
    save_hf(random_params(cfg), cfg, tmp_path, fp8=True, block=BLOCK)
    t = read_all(tmp_path)
    t = {k: v for k, v in t.items() if not k.startswith("model.layers.3.") or "inv_freq" in k}
    t["model.layers.2.mlp.gate.weight_scale_inv"] = np.ones((1, 3), np.float32)
    t["model.layers.1.self_attn.q_a_layernorm.weight"] = np.zeros(24, np.int64)
    # multi-token-prediction layers (index >= num_hidden_layers) are skipped whatever they hold
    t["model.layers.9.whatever"] = np.zeros(3, np.float32)
    t["model.layers.4.eh_proj.weight"], t["model.layers.4.eh_proj.weight_scale_inv"] = quantize_fp8_blocks(np.ones((48, 96)))
    rewrite_single(tmp_path, t)
    with pytest.raises(ValueError) as e:
        load_hf(tmp_path)
    msg = str(e.value)
    assert "3 problem(s)" in msg, msg
    assert "missing layer 3: none of its" in msg
    assert "'model.layers.2.mlp.gate.weight_scale_inv' (model.safetensors): a scale for" in msg
    assert "dtype I64 is not a float type" in msg


def test_index_problems(tmp_path):
    cfg = make_cfg()
    save_hf(random_params(cfg), cfg, tmp_path, num_shards=2)
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    wm = index["weight_map"]
    wm["model.layers.0.input_layernorm.weight"] = "model-9-of-9.safetensors"
    name2 = next(k for k, v in wm.items() if v == "model-2-of-2.safetensors")
    wm[name2] = "model-1-of-2.safetensors"
    index_path.write_text(json.dumps(index))
    # embed_tokens also in shard 2's header, though the index maps it to shard 1
    shard2 = tmp_path / "model-2-of-2.safetensors"
    write_file(shard2, load_file(shard2) | {"model.embed_tokens.weight": np.ones((40, 48), np.float32)})
    with pytest.raises(ValueError) as e:
        load_hf(tmp_path)
    msg = str(e.value)
    assert "4 problem(s)" in msg, msg
    assert "maps 1 tensor(s) (e.g. 'model.layers.0.input_layernorm.weight') to model-9-of-9.safetensors, " \
           "which does not exist" in msg
    assert f"tensor {name2!r}: model.safetensors.index.json maps it to model-1-of-2.safetensors, but it is " \
           "in model-2-of-2.safetensors" in msg
    assert "tensor 'model.layers.0.input_layernorm.weight' in model-1-of-2.safetensors is not listed" not in msg
    assert "tensor 'model.embed_tokens.weight' is in two files: model-1-of-2.safetensors and model-2-of-2" in msg
    # a tensor the index forgets
    del index["weight_map"][name2]
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"tensor {name2!r} in model-2-of-2.safetensors is not listed in "):
        load_hf(tmp_path)
    index["weight_map"]["x"] = "../etc/passwd"
    index_path.write_text(json.dumps(index))
    with pytest.raises(SafetensorsError, match="not a file name in this directory"):
        load_hf(tmp_path)


# ------------------------------------------------------------------------------------------------------
# safetensors headers and reads
def test_reader_matches_the_safetensors_library(tmp_path):
    rng = np.random.default_rng(4)
    tensors = {
        "f32": rng.standard_normal((3, 5)).astype(np.float32), "f16": rng.standard_normal(7).astype(np.float16),
        "bf16": rng.standard_normal((2, 3, 4)).astype(ml_dtypes.bfloat16),
        "fp8": rng.standard_normal((17, 9)).astype(ml_dtypes.float8_e4m3fn),
        "i64": rng.integers(-10**12, 10**12, 6), "empty": np.zeros((0, 4), np.float32),
        "scalar": np.array(3.5, np.float64), "u8": np.arange(5, dtype=np.uint8),
    }
    write_file(tmp_path / "a.safetensors", tensors, {"format": "pt"})
    lib = load_file(tmp_path / "a.safetensors")
    with SafetensorsFile(tmp_path / "a.safetensors") as f:
        assert f.metadata == {"format": "pt"}
        for name, want in tensors.items():
            got = f.read(name)
            assert got.dtype == want.dtype and got.shape == want.shape and got.flags.writeable, name
            np.testing.assert_array_equal(got, want)
            np.testing.assert_array_equal(got, lib[name])
        with pytest.raises(KeyError, match="no tensor 'nope'"):
            f.read("nope")


def test_reads_are_thread_safe(tmp_path):
    rng = np.random.default_rng(5)
    tensors = {f"t{i}": rng.standard_normal((64, 33 + i)).astype(np.float32) for i in range(40)}
    write_file(tmp_path / "model.safetensors", tensors)
    with Checkpoint(tmp_path) as ckpt, concurrent.futures.ThreadPoolExecutor(8) as pool:
        for _ in range(5):
            for name, got in zip(tensors, pool.map(ckpt.read, tensors)):
                np.testing.assert_array_equal(got, tensors[name])


def header_file(path, header: bytes, data: bytes = b"", length=None):
    path.write_bytes(struct.pack("<Q", len(header) if length is None else length) + header + data)
    return path


def entry(dtype="F32", shape=(2, 2), offsets=(0, 16)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


@pytest.mark.parametrize("case,match", [
    ("absurd_length", "header length 1000000000000 is absurd"),
    ("header_past_end", "runs past the end of the file"),
    ("too_short", "too short"),
    ("bad_json", "not valid UTF-8 JSON"),
    ("not_object", "not a JSON object"),
    ("duplicate_key", "duplicate key 'w'"),
    ("offsets_past_end", "tensor 'w': data ends at byte 16 of the data section, which has only 8 bytes"),
    ("truncated", "tensor 'b': data ends at byte 32"),
    ("unknown_dtype", "tensor 'w': unknown dtype 'F4'"),
    ("bad_shape", "tensor 'w': shape must be"),
    ("size_mismatch", "tensor 'w': data_offsets \\[0, 12\\] span 12 bytes, but F32 \\[2, 2\\] needs 16"),
    ("overlap", "tensors 'a' and 'b' overlap"),
    ("missing_key", "tensor 'w': entry must have"),
])
def test_corrupt_headers_name_the_file(tmp_path, case, match):
    p = tmp_path / f"{case}.safetensors"
    j = lambda d: json.dumps(d).encode()  # noqa: E731
    if case == "absurd_length":
        header_file(p, j({"w": entry()}), bytes(16), length=10**12)
    elif case == "header_past_end":
        header_file(p, j({"w": entry()}), length=4096)
    elif case == "too_short":
        p.write_bytes(b"\x01\x00")
    elif case == "bad_json":
        header_file(p, b'{"w": {"dtype": "F32",', bytes(16))
    elif case == "not_object":
        header_file(p, b"[1, 2]")
    elif case == "duplicate_key":
        header_file(p, b'{"w": ' + j(entry()) + b', "w": ' + j(entry()) + b"}", bytes(16))
    elif case == "offsets_past_end":
        header_file(p, j({"w": entry()}), bytes(8))
    elif case == "truncated":  # a good file cut short
        write_file(p, {"a": np.ones((2, 2), np.float32), "b": np.ones((2, 2), np.float32)})
        p.write_bytes(p.read_bytes()[:-4])
    elif case == "unknown_dtype":
        header_file(p, j({"w": entry(dtype="F4")}), bytes(16))
    elif case == "bad_shape":
        header_file(p, j({"w": entry(shape=(2, -2))}), bytes(16))
    elif case == "size_mismatch":
        header_file(p, j({"w": entry(offsets=(0, 12))}), bytes(16))
    elif case == "overlap":
        header_file(p, j({"a": entry(offsets=(0, 16)), "b": entry(offsets=(8, 24))}), bytes(24))
    elif case == "missing_key":
        header_file(p, j({"w": {"dtype": "F32", "shape": [2, 2]}}), bytes(16))
    with pytest.raises(SafetensorsError, match=match) as e:
        SafetensorsFile(p)
    assert str(p) in str(e.value)


def test_load_hf_reports_a_corrupt_shard_by_name(tmp_path):
    cfg = make_cfg()
    save_hf(random_params(cfg), cfg, tmp_path, num_shards=3)
    shard = tmp_path / "model-2-of-3.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(SafetensorsError, match="model-2-of-3.safetensors.*truncated"):
        load_hf(tmp_path)
