"""tools/convert: released FP8 safetensors -> k2jax Orbax checkpoint (k2jax.checkpoint.convert, k2jax.load)."""

import json
import os
import pathlib
import re
import signal
import struct
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k2jax
from k2jax import K2Model, load_hf
from k2jax.ops.quant import QuantizedWeight
from k2jax.checkpoint import names as hf_names
from k2jax.checkpoint.convert import convert, main
from k2jax.checkpoint.orbax_layout import MANIFEST, IncompleteCheckpointError
from k2jax.checkpoint.safetensors_io import Checkpoint, write_file
from k2jax.testing import run_measured, write_release_checkpoint
from tests.conftest import flat

REPO = pathlib.Path(__file__).resolve().parents[1]
# Dims that are not multiples of 128 (partial edge blocks everywhere), Kimi's routing and rope, 3 layers.
CFG = dict(
    vocab_size=96, hidden_size=160, intermediate_size=200, moe_intermediate_size=136, num_hidden_layers=3,
    num_attention_heads=2, num_key_value_heads=2, q_lora_rank=136, kv_lora_rank=132, qk_nope_head_dim=72,
    qk_rope_head_dim=8, v_head_dim=68, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=1,
    topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.827, rope_theta=50000.0, norm_topk_prob=True,
    rms_norm_eps=1e-6, max_position_embeddings=131072, tie_word_embeddings=False,
    rope_scaling={"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 1.0,
                  "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return write_release_checkpoint(CFG, tmp_path_factory.mktemp("src"), num_shards=3, seed=1)


@pytest.fixture(scope="module")
def dst_bf16(src, tmp_path_factory):
    d = tmp_path_factory.mktemp("conv") / "bf16"
    assert main([str(src), str(d), "--quiet"]) == 0
    return d


def assert_bit_equal(got, want):
    g, w = flat(got), flat(want)
    assert g.keys() == w.keys()
    for k in w:
        assert (g[k].shape, g[k].dtype) == (w[k].shape, w[k].dtype), k
        np.testing.assert_array_equal(np.asarray(g[k]).view(np.uint8), np.asarray(w[k]).view(np.uint8), err_msg=k)


def tree_bytes(d: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------------------------------
def test_release_layout(src):
    index = json.loads((src / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-{k}-of-3.safetensors" for k in (1, 2, 3)]
    with Checkpoint(src) as ck:
        assert set(ck.tensors) == set(index["weight_map"]) and not ck.problems
        codes = {n: i.dtype for n, i in ck.tensors.items()}
    assert codes["model.layers.1.mlp.experts.3.up_proj.weight"] == "F8_E4M3"
    assert codes["model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"] == "F32"
    assert codes["model.layers.1.self_attn.kv_a_proj_with_mqa.weight_scale_inv"] == "F32"
    assert codes["model.layers.2.mlp.gate.weight"] == codes["model.embed_tokens.weight"] == "BF16"
    assert codes["model.layers.2.mlp.gate.e_score_correction_bias"] == "F32"
    assert codes["model.layers.0.self_attn.rotary_emb.inv_freq"] == "F32"
    cfg = json.loads((src / "config.json").read_text())
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128]


def test_equals_load_hf_bit_exact(src, dst_bf16):
    cfg, got = k2jax.load(dst_bf16)
    cfg_hf, want = load_hf(src)
    assert cfg == cfg_hf
    assert_bit_equal(got, want)
    _, got32 = k2jax.load(dst_bf16, dtype=jnp.float32)  # cast on read: bf16 -> f32 is exact
    assert_bit_equal(got32, jax.tree.map(lambda x: x.astype(jnp.float32), want))


def test_float32_conversion_equals_load_hf(src, tmp_path):
    assert main([str(src), str(tmp_path / "f32"), "--dtype", "float32", "--workers", "3", "--quiet"]) == 0
    assert_bit_equal(k2jax.load(tmp_path / "f32")[1], load_hf(src, dtype=jnp.float32)[1])


def test_logits_equal_transformers(src, tmp_path, oracle):
    d = tmp_path / "f32"
    assert main([str(src), str(d), "--dtype", "float32", "--quiet"]) == 0
    cfg, params = k2jax.load(d)
    ids = np.random.default_rng(2).integers(0, 96, (2, 9))
    want = oracle.run({"load": str(src), "inputs": {"input_ids": ids}})["logits"]
    got = K2Model(cfg).apply({"params": params}, jnp.asarray(ids))
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=1e-4)


def test_plain_orbax_restore_and_shardings(dst_bf16):
    import orbax.checkpoint as ocp

    cfg, params = k2jax.load(dst_bf16)
    mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    P = jax.sharding.PartitionSpec

    def sharding(path, leaf):
        experts = "experts" in jax.tree_util.keystr(path) and "shared" not in jax.tree_util.keystr(path)
        return jax.sharding.NamedSharding(mesh, P(None, "expert") if experts else P())

    abstract = k2jax.abstract_params(cfg, jnp.bfloat16)
    shardings = jax.tree_util.tree_map_with_path(sharding, abstract)
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    plain = ocp.StandardCheckpointer().restore(os.path.abspath(dst_bf16), target)
    assert_bit_equal(plain, params)
    _, sharded = k2jax.load(dst_bf16, shardings=shardings)
    assert_bit_equal(sharded, params)
    up = sharded["moe_layers"]["mlp"]["experts"]["up_proj"]
    assert up.sharding == shardings["moe_layers"]["mlp"]["experts"]["up_proj"]
    assert {s.data.shape[1] for s in up.addressable_shards} == {up.shape[1] // 4}


def test_float8_round_trip(src, dst_bf16, tmp_path):
    """A float8 conversion holds the release's e4m3 bytes and block scales as stored (transposed into k2jax's
    layout), as QuantizedWeight leaves; dequantized on load, on device, it is the bf16 / f32 conversion."""
    d = tmp_path / "f8"
    assert main([str(src), str(d), "--dtype", "float8", "--quiet"]) == 0
    cfg, stored = k2jax.load(d, quant="fp8")
    leaves = {tuple(k.key for k in p): v for p, v in
              jax.tree_util.tree_leaves_with_path(stored, is_leaf=lambda x: isinstance(x, QuantizedWeight))}
    n_fp8 = 0
    with Checkpoint(src) as ck:
        for name, info in ck.tensors.items():
            if info.dtype != "F8_E4M3":
                continue
            t = hf_names.resolve(name, cfg)
            w = np.asarray(leaves[t.leaf].values)[t.index]
            assert w.dtype == np.dtype(jnp.float8_e4m3fn), name
            np.testing.assert_array_equal(t.transform.inverse(w).view(np.uint8), ck.read(name).view(np.uint8), name)
            scale = np.asarray(leaves[t.leaf].scales)[t.index]
            np.testing.assert_array_equal(scale.T, ck.read(hf_names.scale_name(name)), name)
            n_fp8 += 1
    assert n_fp8 > 50
    _, bf16 = k2jax.load(d)  # dequantized on load, on device
    assert_bit_equal(bf16, k2jax.load(dst_bf16)[1])
    _, f32 = k2jax.load(d, dtype=jnp.float32)
    assert_bit_equal(f32, load_hf(src, dtype=jnp.float32)[1])


# A conversion SIGKILLed from inside, right after it has marked its second unit done (other workers may be
# mid-write): the hook lives here, in the test, wrapped around the converter's own marker.
_KILLED_CONVERT = r"""
import os, signal, sys
from k2jax.checkpoint.convert import destination, main, pool
marked = []
def mark_then_die(dst, unit):
    destination.mark_done(dst, unit)
    marked.append(unit)
    if len(marked) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
pool.mark_done = mark_then_die
sys.exit(main(sys.argv[1:]))
"""


def test_sigkill_resume_is_bit_identical(src, dst_bf16, tmp_path):
    d = tmp_path / "killed"
    cmd = [sys.executable, "-c", _KILLED_CONVERT, str(src), str(d), "--quiet"]
    p = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr
    assert not (d / MANIFEST).exists()
    with pytest.raises(IncompleteCheckpointError, match="incomplete conversion"):
        k2jax.load(d)
    fresh = convert(src, tmp_path / "fresh", quiet=True)
    resumed = convert(src, d, quiet=True)
    assert resumed.complete and fresh.complete
    assert 0 < resumed.units_converted < fresh.units_converted and resumed.units_skipped > 0
    assert resumed.bytes_read < fresh.bytes_read
    assert tree_bytes(d) == tree_bytes(dst_bf16)  # every file, manifest included
    # the same command again: nothing to do; another job over a complete DST needs --overwrite
    assert convert(src, d, quiet=True).tensors == 0
    with pytest.raises(ValueError, match="--overwrite"):
        convert(src, d, dtype="float32", quiet=True)


def test_layer_ranges_fill_one_checkpoint(src, dst_bf16, tmp_path):
    d = tmp_path / "split"
    first = convert(src, d, layers="0:2", quiet=True)
    assert not first.complete and first.units_left == 1
    with pytest.raises(IncompleteCheckpointError):
        k2jax.load(d)
    assert convert(src, d, layers="2:", quiet=True).complete
    assert tree_bytes(d) == tree_bytes(dst_bf16)


def test_page_cache_io_writes_the_same_files(src, dst_bf16, tmp_path):
    """--no-direct-io (also what runs where the filesystem refuses O_DIRECT) writes the same bytes."""
    d = tmp_path / "buffered"
    assert main([str(src), str(d), "--quiet", "--no-direct-io"]) == 0
    assert tree_bytes(d) == tree_bytes(dst_bf16)


def test_big_tensors_convert_in_pieces(tmp_path, monkeypatch):
    """A tensor above PIECE_BYTES goes in row ranges of whole chunks (and whole 128-row scale blocks), here
    with tiny chunks and pieces: the same params as load_hf, for bf16 and float8."""
    from k2jax.checkpoint import orbax_layout
    from k2jax.checkpoint.convert import codec

    cfg = CFG | dict(hidden_size=256, moe_intermediate_size=256, intermediate_size=384, q_lora_rank=256,
                     kv_lora_rank=128, vocab_size=320, num_hidden_layers=2)
    s = write_release_checkpoint(cfg, tmp_path / "src", seed=3)
    monkeypatch.setattr(orbax_layout, "CHUNK_BYTES", 16 << 10)
    monkeypatch.setattr(codec, "PIECE_BYTES", 1)
    pieces = []
    convert_rows = codec.TensorConverter._convert_rows
    monkeypatch.setattr(codec.TensorConverter, "_convert_rows", lambda self, src, *a: pieces.append(src.target.name)
                        or convert_rows(self, src, *a))
    for dtype in ("bfloat16", "float8"):
        assert convert(s, tmp_path / dtype, dtype=dtype, quiet=True).complete
    for name in ("lm_head.weight", "model.embed_tokens.weight", "model.layers.1.mlp.experts.0.up_proj.weight"):
        assert pieces.count(name) > 2, name  # > one piece per conversion
    want = load_hf(s)[1]
    assert_bit_equal(k2jax.load(tmp_path / "bfloat16")[1], want)
    assert_bit_equal(k2jax.load(tmp_path / "float8")[1], want)


def test_dequantize_transposed_is_numpys_dequantize():
    """The converter's fast path (XLA decode by bits, strips, NaN count by lanes) = fp8.dequantize_fp8_blocks(...).T,
    bit for bit: every e4m3 value, partial edge blocks, bf16 and f32."""
    from k2jax.checkpoint import fp8

    rng = np.random.default_rng(4)
    for shape in [(160, 136), (256, 384), (37, 300)]:
        u = rng.integers(0, 256, shape, dtype=np.uint8)
        u.reshape(-1)[:256] = np.arange(256)  # NaN (0x7f, 0xff) included
        w = u.view(fp8.FP8)
        scale = np.exp(rng.uniform(-20, 5, fp8.scale_shape(shape))).astype(np.float32)
        for dtype in (np.dtype(jnp.bfloat16), np.dtype(np.float32)):
            got, bad = fp8.dequantize_fp8_transposed(w, scale, (128, 128), dtype)
            want = fp8.dequantize_fp8_blocks(w, scale, (128, 128), np.float32).astype(dtype).T
            nan = np.isnan(want.astype(np.float32))
            assert got.flags.c_contiguous and bad == nan.sum() > 0
            np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan)
            bits = f"u{dtype.itemsize}"
            np.testing.assert_array_equal(got.view(bits)[~nan], np.ascontiguousarray(want).view(bits)[~nan])


def test_transpose_is_numpys():
    """fp8.transpose (XLA strips + numpy runs, the rest tile by tile) = np.ascontiguousarray(x.T), bit for bit:
    e4m3, bf16 and f32, rows not a multiple of the strip height, arrays below and above the XLA threshold."""
    from k2jax.checkpoint import fp8

    rng = np.random.default_rng(5)
    for shape in [(1, 1), (3, 517), (131, 257), (300, 1000), (1000, 300), (129, 1031)]:
        for dtype in (fp8.FP8, np.dtype(jnp.bfloat16), np.dtype(np.float32)):
            x = rng.integers(0, 256, (shape[0], shape[1] * dtype.itemsize), dtype=np.uint8).view(dtype)
            out = np.empty(shape[::-1], dtype)
            got = fp8.transpose(x, out)
            assert got is out
            np.testing.assert_array_equal(got.view(np.uint8), fp8.transpose_reference(x).view(np.uint8))
    x = rng.integers(0, 256, (256, 640), dtype=np.uint8)[:, 64:576]  # not contiguous
    np.testing.assert_array_equal(fp8.transpose(x), fp8.transpose_reference(x))


def test_int4_fast_forms_are_the_plain_ones():
    """int4.to_k2jax (byte transpose + XLA nibble repack) = to_k2jax_reference, and
    dequantize_packed_int4_transposed = dequantize_packed_int4(...).T, bit for bit, on odd shapes."""
    from k2jax.checkpoint import int4

    rng = np.random.default_rng(6)
    for out, inn in [(2, 32), (6, 96), (130, 160), (258, 512), (1026, 288)]:
        packed = rng.integers(-2**31, 2**31, (out, inn // 8), dtype=np.int64).astype(np.int32)
        scale = rng.standard_normal((out, inn // 32)).astype(jnp.bfloat16)
        for got, want in zip(int4.to_k2jax(packed, scale), int4.to_k2jax_reference(packed, scale)):
            assert got.flags.c_contiguous and got.dtype == want.dtype
            np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
        for dtype in (np.dtype(jnp.bfloat16), np.dtype(np.float32)):
            got = int4.dequantize_packed_int4_transposed(packed, scale, dtype)
            want = np.ascontiguousarray(int4.dequantize_packed_int4(packed, scale, dtype).T)
            assert got.flags.c_contiguous and got.dtype == want.dtype
            np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


def test_count_nonfinite_finds_each_one():
    from k2jax.checkpoint import fp8

    for dtype, bad_bits in ((fp8.FP8, [0x7F, 0xFF]), (np.dtype(jnp.bfloat16), [0x7F80, 0xFF80, 0x7FC0, 0xFFC1])):
        bits = f"u{dtype.itemsize}"
        x = np.zeros((1 << 20) + 13, bits)  # more than one piece, and a tail that is not whole lanes
        x[:] = np.arange(x.size) % (0x7F if dtype == fp8.FP8 else 0x7F80)
        assert fp8.count_nonfinite(x.view(dtype)) == 0
        for pos in (0, 5, 1 << 20, x.size - 1):
            for b in bad_bits:
                y = x.copy()
                y[pos] = b
                assert fp8.count_nonfinite(y.view(dtype)) == 1, (dtype, pos, b)
                assert fp8.count_nonfinite(y[1:].view(dtype)) == (pos > 0), (dtype, pos, b)  # misaligned


# ------------------------------------------------------------------------------------------------------
# Bad input: exit status, one cause (naming tensor and file), nothing marked complete.
def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _rewrite(path, edit):
    """Rewrite one shard's header JSON with edit(header) -> header (data unchanged)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = edit(json.loads(raw[8:8 + n]))
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + raw[8 + n:])


def _drop(src, name):
    with Checkpoint(src) as ck:
        f = ck.file_of(name)
        keep = {n: ck.read(n) for n, i in ck.tensors.items() if os.path.basename(i.file) == f and n != name}
    write_file(src / f, keep, {"format": "pt"})
    index = json.loads((src / "model.safetensors.index.json").read_text())
    del index["weight_map"][name]
    (src / "model.safetensors.index.json").write_text(json.dumps(index))


def _patch(path, offset, data):
    raw = bytearray(path.read_bytes())
    raw[offset:offset + len(data)] = data
    path.write_bytes(raw)
    return path.parent


def _edit_config(src, **changes):
    (src / "config.json").write_text(json.dumps(json.loads((src / "config.json").read_text()) | changes))
    return src


def _set_dtype(header, name, dtype):
    header[name]["dtype"] = dtype
    return header


SCALE = "model.layers.2.mlp.experts.5.down_proj.weight_scale_inv"
BAD = {
    "missing_src": (lambda s: s / "nope", "no such file or directory"),
    "missing_shard": (lambda s: (s / "model-2-of-3.safetensors").unlink() or s,
                      "model-2-of-3.safetensors, which does not exist"),
    "truncated_shard": (lambda s: os.truncate(s / "model-3-of-3.safetensors", 5000) or s,
                        "model-3-of-3.safetensors.*truncated"),
    "absurd_header_length": (lambda s: _patch(s / "model-1-of-3.safetensors", 0, struct.pack("<Q", 1 << 60)),
                             "header length .* absurd"),
    "header_not_json": (lambda s: _patch(s / "model-2-of-3.safetensors", 8, b"{not json"),
                        "model-2-of-3.safetensors: header is not valid UTF-8 JSON"),
    "offsets_past_end": (lambda s: _rewrite(s / "model-1-of-3.safetensors", lambda h: {
        k: (v | {"data_offsets": [v["data_offsets"][0] + 10**9, v["data_offsets"][1] + 10**9]}
            if k == "model.embed_tokens.weight" else v) for k, v in h.items()}) or s,
        "model.embed_tokens.weight.*data ends at byte"),
    "dtype_not_allowed": (lambda s: _rewrite(s / "model-3-of-3.safetensors", lambda h: _set_dtype(
        h, next(k for k, v in h.items() if k != "__metadata__" and v["dtype"] == "F8_E4M3"), "U8")) or s,
        "dtype U8 is not a float type"),
    "missing_scale_inv": (lambda s: _drop(s, SCALE) or s, "F8_E4M3 weight without its scale .*down_proj"),
    "config_mismatch": (lambda s: _edit_config(s, moe_intermediate_size=128), "config.json implies"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input(src, tmp_path, capsys, case):
    corrupt, message = BAD[case]
    s = corrupt(_copy(src, tmp_path / "src"))
    d = tmp_path / "dst"
    assert main([str(s), str(d), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("convert: error: ") and "Traceback" not in err, err
    assert re.search(message, err), err
    assert not (d / MANIFEST).exists() and not (d.exists() and any(d.iterdir()))


def test_nan_in_fp8_data_is_reported(src, tmp_path, capsys):
    """NaN inside an FP8 weight (e4m3fn 0x7F) is found by the dequantizing pass: exit 2, the tensor named,
    nothing marked complete."""
    s = _copy(src, tmp_path / "src")
    name = "model.layers.2.mlp.experts.3.up_proj.weight"
    with Checkpoint(s) as ck:
        info = ck.tensors[name]
    _patch(pathlib.Path(info.file), info.begin + 17, b"\x7f")
    d = tmp_path / "dst"
    assert main([str(s), str(d), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert re.search(f"{re.escape(name)}.*1 NaN/inf value", err) and "Traceback" not in err, err
    assert not (d / MANIFEST).exists()


def test_problems_are_reported_together(src, tmp_path, capsys):
    s = _copy(src, tmp_path / "src")
    _drop(s, SCALE)
    _rewrite(s / "model-1-of-3.safetensors", lambda h: _set_dtype(h, "model.layers.0.mlp.up_proj.weight", "I8"))
    assert main([str(s), str(tmp_path / "dst")]) == 2
    err = capsys.readouterr().err
    assert "2 problem(s)" in err and "without its scale" in err and "up_proj.weight" in err
    assert "model-1-of-3.safetensors" in err


def test_unwritable_dst_and_no_overwrite(src, dst_bf16, tmp_path, capsys):
    assert main([str(src), "/sys/k2jax-convert-test/dst", "--quiet"]) == 2  # read-only for root too
    assert "cannot write there" in capsys.readouterr().err
    assert main([str(src), str(dst_bf16), "--dtype", "float32", "--quiet"]) == 2  # complete: not replaced
    assert "--overwrite" in capsys.readouterr().err
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    assert main([str(src), str(tmp_path / "foreign"), "--overwrite", "--quiet"]) == 2
    assert (tmp_path / "foreign" / "notes.txt").read_text() == "mine"


def test_cli_never_prints_a_traceback(tmp_path):
    p = subprocess.run([sys.executable, "-m", "k2jax.cli", "convert", str(tmp_path / "missing"), str(tmp_path / "d")],
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0 and "no such file" in p.stderr, p.stderr


# ------------------------------------------------------------------------------------------------------
def _peak_rss(src, dst) -> int:
    cmd = [sys.executable, str(REPO / "tools" / "convert" / "convert.py"), str(src), str(dst), "--quiet"]
    status, rss, *_ = run_measured(cmd)  # getrusage (wait4) of the child, from a small launcher
    assert status == 0
    return rss


def test_memory_does_not_grow_with_blocks(tmp_path):
    """Wide enough that 6 extra MoE blocks (~170 MB bf16) would show well above the 1.3x allowed."""
    wide = CFG | dict(hidden_size=512, moe_intermediate_size=512, intermediate_size=512, n_routed_experts=16,
                      q_lora_rank=256, kv_lora_rank=128)
    rss = {}
    for moe_blocks in (2, 8):
        s = write_release_checkpoint(wide | dict(num_hidden_layers=1 + moe_blocks), tmp_path / f"s{moe_blocks}",
                                     fast=True)
        rss[moe_blocks] = _peak_rss(s, tmp_path / f"d{moe_blocks}")
    print({k: f"{v / 2**20:.0f} MiB" for k, v in rss.items()})
    assert rss[8] <= 1.3 * rss[2], rss
