"""`k2jax plan`: the bytes per chip of weights, paged cache and sampling state, the KV tokens that fit, the
mesh search, and the command line (--quant / --dtype named as serve and generate name them)."""

import json
import math

import jax.numpy as jnp
import pytest

from k2jax import K2Config, abstract_params
from k2jax.cli import main as cli_main
from k2jax.plan import CHIPS, GiB, meshes, plan, search
from tests.conftest import CONFIGS

KIMI = K2Config.from_hf_config(CONFIGS / "kimi_k2.json")
TINY = K2Config.from_hf_config(CONFIGS / "tiny.json")


def kimi_weights_per_chip(mesh: dict, dtype_bytes=2) -> float:
    """Kimi K2's params per chip in bf16 from its shapes alone (the rules table written out by hand): routed
    experts split over expert (and their hidden dim over tensor); vocab and dense/shared hidden dims over
    tensor x expert; attention heads over tensor; the rest whole."""
    D, L, Ld, E, F, V = 7168, 60, 1, 384, 2048, 163840
    e, t = mesh.get("expert", 1), mesh.get("tensor", 1)
    N, R, Q, Pr, Kn, Vh = 64, 512, 1536, 64, 128, 128
    experts = L * E * 3 * D * F / (e * t)
    vocab = 2 * V * D / (e * t)
    shared = L * 3 * D * F / (e * t)
    dense = Ld * 3 * D * 18432 / (e * t)
    attn_split = (Q * N * (Kn + Pr) + R * N * (Kn + Vh) + N * Vh * D) / t  # q_b, kv_b, o over heads
    attn_whole = D * Q + Q + D * (R + Pr) + R  # q_a, its norm, kv_a, its norm
    attention = (L + Ld) * (attn_split + attn_whole)
    norms = (L + Ld) * 2 * D + D
    plain = (experts + vocab + shared + dense + attention + norms) * dtype_bytes
    router = L * (D * E + E) * 4  # float32
    return plain + router


def test_kimi_k2_bytes_and_kv_tokens_on_v5p_64():
    p = plan(KIMI, "expert=64", batch=64, max_len=8192)
    assert p.weights_per_device == pytest.approx(kimi_weights_per_chip({"expert": 64}), rel=1e-9)
    # 61 layers x (512 + 64) bf16 values per token; every chip holds its own row's pages and a trash page
    per_token = 61 * 576 * 2
    assert p.bytes_per_token == per_token and p.kv_shards == 64
    assert p.kv.per_chip == (1 + 8192 // 64) * 64 * per_token
    usable = 95 * GiB * 0.9
    state = 64 * 163840 * 5 / 64
    assert p.kv_tokens(95 * GiB) == int((usable - p.weights_per_device - state) // per_token) * 64
    assert p.kv_tokens(95 * GiB) >= 25e6  # the goal for v5p-64


def test_the_search_ranks_by_kv_tokens_and_recommends_expert_only_meshes_for_kimi():
    cands = search(KIMI, 64, CHIPS["v5p"].hbm, batch=64, max_len=8192)
    assert len(cands) == len(meshes(64)) == 28  # 64 = 2^6 over three axes: C(8, 2)
    assert all(c.plan.mesh["fsdp"] == 1 for c in cands)
    tokens = [c.kv_tokens for c in cands if c.fits]
    assert tokens == sorted(tokens, reverse=True)
    assert cands[0].mesh_spec == "expert=64"
    # every candidate's capacity from its own plan, independently: free bytes per chip / bytes per token x shards
    for c in cands[:5]:
        p = c.plan
        # per slot: counts int32 and a prompt mask per id; settings: 10 4-byte values, 16 stop ids, 300 bias pairs
        free = 95 * GiB * 0.9 - p.weights_per_device - 64 * (163840 * 5 + 10 * 4 + 16 * 4 + 300 * 8) / p.kv.shards
        assert c.kv_tokens == max(0, int(free // (61 * 576 * 2))) * math.prod(
            p.mesh[a] for a in ("data", "fsdp", "expert"))
    # int4 experts: 16 chips hold K2-Thinking; 8 v5p do not hold bf16 Kimi K2
    assert search(KIMI, 16, CHIPS["v5p"].hbm, quant="int4", batch=256, max_len=8192)[0].mesh_spec == "expert=16"
    assert not search(KIMI, 8, CHIPS["v5p"].hbm)[0].fits


def test_a_batch_the_mesh_does_not_divide_falls_back_and_is_counted_so():
    p = plan(TINY, "data=2,expert=4", batch=6, max_len=100, page_size=16)
    assert p.kv.shards == 2  # 6 rows: data=2 divides, expert=4 does not
    W = 7  # ceil(100 / 16) pages per row
    assert p.kv.per_chip == (1 + 3 * W) * 16 * p.bytes_per_token
    p1 = plan(TINY, "expert=8", batch=1, max_len=64)
    assert p1.kv.shards == 1 and p1.kv_shards == 8  # a lone row is replicated; a divisible batch splits 8 ways


def test_float8_cache_and_quantized_weights():
    p = plan(KIMI, "expert=64", quant="int4", kv_dtype="float8", batch=8, max_len=1024)
    assert p.bytes_per_token == 61 * (576 + 8)  # e4m3 values and two float32 scales per layer
    full = abstract_params(KIMI, jnp.bfloat16, quant="int4")
    experts = full["moe_layers"]["mlp"]["experts"]
    held = sum(w.nbytes for w in experts.values())
    assert dict((r[0], r[2]) for r in p.rows)["routed experts"] == held
    assert held == pytest.approx(60 * 384 * 3 * 7168 * 2048 * (0.5 + 2 / 32))
    with pytest.raises(ValueError, match=r"dtype must be one of .* got 'int4' \(quantization is quant='int4'\)"):
        plan(KIMI, "expert=64", dtype="int4")
    with pytest.raises(ValueError, match="quant must be one of"):
        plan(KIMI, "expert=64", quant="int8")
    with pytest.raises(TypeError):  # no positional dtype any more: it was the quantization too
        plan(KIMI, "expert=64", "bfloat16")


def test_plan_command_search_and_names(capsys):
    assert cli_main(["plan", str(CONFIGS / "kimi_k2.json"), "--chip", "v5p", "--chips", "64", "--batch", "64",
                     "--max-len", "8192"]) == 0
    out = capsys.readouterr().out
    assert "recommended: --mesh expert=64" in out and "78,080 bytes per token" in out  # 576 -> 640 on a TPU
    first = next(ln for ln in out.splitlines() if ln.strip().startswith("1  "))
    assert "expert=64" in first and " M " in first + " "
    assert cli_main(["plan", str(CONFIGS / "kimi_k2.json"), "--chips", "16", "--hbm", "95", "--quant", "int4",
                     "--json", "--top", "2"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert [c["mesh"] for c in got][:1] == ["expert=16"] and got[0]["quant"] == "int4" and len(got) == 2
    # the old spelling names the new one
    assert cli_main(["plan", str(CONFIGS / "kimi_k2.json"), "--mesh", "expert=64", "--dtype", "int4"]) == 2
    assert "--dtype int4: the quantization is --quant int4" in capsys.readouterr().err
    assert cli_main(["plan", str(CONFIGS / "kimi_k2.json"), "--chips", "64"]) == 2
    assert "--chip v5p|v6e|v5e|v7x|h100|h200 or --hbm GiB" in capsys.readouterr().err


def test_compile_without_libtpu_says_what_to_install(capsys, monkeypatch):
    from k2jax.aot import topology

    monkeypatch.setattr(topology, "has_libtpu", lambda: False)
    assert cli_main(["plan", str(CONFIGS / "tiny.json"), "--compile", "v5p:2x2x1", "--batch", "8",
                     "--max-len", "256"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'k2jax[tpu-aot]'" in err and "libtpu" in err
    assert cli_main(["plan", str(CONFIGS / "tiny.json"), "--compile", "v5p-64", "--batch", "8",
                     "--max-len", "256"]) == 2
    assert "expected a TPU topology such as v5p:4x4x4" in capsys.readouterr().err
