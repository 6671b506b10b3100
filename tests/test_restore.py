"""Sharded restore of a converted checkpoint (k2jax.load with a mesh), on 8 simulated CPU devices: the same
bits on every mesh, each device holding and each process reading only its own shards, bounded host memory,
and a config that does not match the checkpoint refused by name."""

import itertools
import json
import os
import pathlib
import shutil
import sys
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k2jax
from k2jax import K2Model
from k2jax.checkpoint.convert import main as convert_main
from k2jax.checkpoint.orbax_layout import stored_array
from k2jax.placement import param_shardings
from k2jax.sharding import make_mesh, use_mesh
from k2jax.testing import write_release_checkpoint
from tests.conftest import CONFIGS
from tests.processes import free_port, result, run_all

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = json.loads((CONFIGS / "tiny.json").read_text())  # 8 experts, top-2, 3 layers (2 MoE)
# Experts dominate (75 MB of 82 MB bf16, 25 MB per stacked leaf): what each process reads shows in the bytes.
WIDE = TINY | dict(hidden_size=512, moe_intermediate_size=512, intermediate_size=256, n_routed_experts=16,
                   num_hidden_layers=4, q_lora_rank=64, kv_lora_rank=64, vocab_size=96)
MESHES = ["expert=8", "data=2,expert=2,tensor=2"]
EXPERT_LEAVES = ("gate_proj", "up_proj", "down_proj")


def convert(cfg: dict, tmp: pathlib.Path, *extra: str, fast: bool = False) -> pathlib.Path:
    src = write_release_checkpoint(cfg, tmp / "src", seed=3, fast=fast)
    dst = tmp / "dst"
    assert convert_main([str(src), str(dst), "--quiet", *extra]) == 0
    return dst


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return convert(TINY, tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    return convert(WIDE, tmp_path_factory.mktemp("wide"), fast=True)


@pytest.fixture(scope="module")
def one_device(ckpt):
    return k2jax.load(ckpt)


def leaves(tree) -> dict[str, jax.Array]:
    return {".".join(k.key for k in p): v for p, v in jax.tree_util.tree_leaves_with_path(tree)}


def bits(x) -> np.ndarray:
    return np.asarray(x).view(np.uint8)


# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", MESHES)
def test_every_device_holds_its_shard_of_the_same_bits(ckpt, one_device, spec):
    """Restored on a mesh: the rules table's shardings, E / n_expert experts per device, and every device's
    shard bit-equal to the same region of the one-device restore (so mesh A == mesh B == one device)."""
    cfg, reference = one_device
    mesh = make_mesh(spec)
    got_cfg, params = k2jax.load(ckpt, mesh=mesh)
    assert got_cfg == cfg
    want_sharding = leaves(param_shardings(cfg, mesh))
    ref = {n: np.asarray(v) for n, v in leaves(reference).items()}
    got = leaves(params)
    assert got.keys() == ref.keys()
    n_expert, E = mesh.shape["expert"], cfg.n_routed_experts
    for name, a in got.items():
        assert (a.shape, a.dtype) == (ref[name].shape, ref[name].dtype), name
        assert a.sharding == want_sharding[name], (name, a.sharding, want_sharding[name])
        assert len(a.addressable_shards) == 8
        for shard in a.addressable_shards:
            np.testing.assert_array_equal(bits(shard.data), bits(ref[name][shard.index]), err_msg=name)
    for leaf in EXPERT_LEAVES:
        stack = params["moe_layers"]["mlp"]["experts"][leaf]
        held = {(s.index[1].start, s.index[1].stop) for s in stack.addressable_shards}
        assert {s.data.shape[1] for s in stack.addressable_shards} == {E // n_expert}, leaf
        assert len(held) == n_expert  # the experts are partitioned, none replicated across the expert axis
    # A restore on mesh A equals one on mesh B as whole arrays too.
    for name, a in got.items():
        np.testing.assert_array_equal(bits(a), bits(ref[name]), err_msg=name)


def test_sharded_logits_from_restored_params_equal_one_device(ckpt):
    cfg, one = k2jax.load(ckpt, dtype=jnp.float32)
    tokens = jax.random.randint(jax.random.PRNGKey(0), (4, 8), 0, cfg.vocab_size)
    step = jax.jit(lambda p, t: K2Model(cfg).apply({"params": p}, t))
    reference = step(one, tokens)
    mesh = make_mesh("data=2,expert=2,tensor=2")  # every mesh's logits: tests/test_sharding.py
    _, params = k2jax.load(ckpt, dtype=jnp.float32, mesh=mesh)
    with use_mesh(mesh):
        logits = step(params, tokens)
    np.testing.assert_allclose(logits, reference, atol=1e-5, rtol=1e-5)


def test_float8_conversion_restores_sharded(tmp_path, one_device):
    """A float8 conversion on a mesh: weights and their scales split over the expert axis (nothing
    expert-sized replicated), dequantized on device to the bf16 conversion's bits."""
    d = convert(TINY, tmp_path, "--dtype", "float8")
    mesh = make_mesh("expert=8")
    _, stored = k2jax.load(d, quant="fp8", mesh=mesh)
    experts = stored["moe_layers"]["mlp"]["experts"]
    for leaf in EXPERT_LEAVES:
        for part in (experts[leaf].values, experts[leaf].scales):
            assert {s.data.shape[1] for s in part.addressable_shards} == {1}, leaf
    ref = leaves(one_device[1])
    for spec in MESHES:
        _, bf16 = k2jax.load(d, mesh=make_mesh(spec))
        for name, a in leaves(bf16).items():
            np.testing.assert_array_equal(bits(a), bits(ref[name]), err_msg=f"{spec}: {name}")


# ------------------------------------------------------------------------------------------------------
# The checkpoint is abstract_params' tree: a plain Orbax restore of it, with k2jax's shardings, is k2jax.load.
@pytest.fixture(scope="module")
def conversions(tmp_path_factory):
    """TINY converted four ways: float32, bfloat16, float8 (of an FP8 release), int4 (of a Thinking release)."""
    from k2jax.checkpoint import save_hf
    from k2jax.testing import random_params

    root = tmp_path_factory.mktemp("conversions")
    fp8_src = write_release_checkpoint(TINY, root / "fp8-src", seed=5)
    cfg = k2jax.K2Config.from_hf_config(TINY)
    int4_src = save_hf(random_params(cfg, np.float32, seed=5), cfg, root / "int4-src", int4=True, num_shards=2)
    out = {}
    for dtype in ("float32", "bfloat16", "float8", "int4"):
        out[dtype] = root / dtype
        assert convert_main([str(int4_src if dtype == "int4" else fp8_src), str(out[dtype]), "--dtype", dtype,
                             "--quiet"]) == 0
    return out


@pytest.mark.parametrize("dtype,param_dtype,quant", [("float32", jnp.float32, None), ("bfloat16", jnp.bfloat16, None),
                                                     ("float8", jnp.bfloat16, "fp8"), ("int4", jnp.bfloat16, "int4")])
def test_plain_orbax_restore_on_a_mesh_equals_load(conversions, dtype, param_dtype, quant):
    """The README's recipe, Orbax alone: abstract_params(cfg, dtype, quant) with param_shardings(cfg, mesh,
    quant=quant) on each leaf -> the same tree, placements and bits as k2jax.load on that mesh."""
    import orbax.checkpoint as ocp

    d = conversions[dtype]
    cfg = k2jax.K2Config.from_hf_config(d)
    mesh = make_mesh("data=2,expert=2,tensor=2")
    abstract = k2jax.abstract_params(cfg, param_dtype, quant)
    shardings = k2jax.param_shardings(cfg, mesh, quant=quant)
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    plain = ocp.StandardCheckpointer().restore(os.path.abspath(d), target)
    _, loaded = k2jax.load(d, mesh=mesh, quant=quant)
    assert jax.tree.structure(plain) == jax.tree.structure(loaded) == jax.tree.structure(abstract)
    got, want = leaves_by_path(plain), leaves_by_path(loaded)
    assert got.keys() == want.keys()
    for name, a in got.items():
        assert (a.shape, a.dtype, a.sharding) == (want[name].shape, want[name].dtype, want[name].sharding), name
        np.testing.assert_array_equal(bits(a), bits(want[name]), err_msg=name)
    if quant is not None:  # really held quantized, as the manifest says
        assert json.loads((d / "k2jax_manifest.json").read_text())["quant"] == quant
        assert isinstance(plain["moe_layers"]["mlp"]["experts"]["up_proj"], k2jax.QuantizedWeight)


def test_layout_version_1(ckpt, conversions, one_device, tmp_path):
    """The previous layout (quantized weights' scales as sibling arrays): a float8 / int4 conversion is refused
    with a message to convert again; a bfloat16 one, the same tree as today's, is read as it is."""
    for name, src in (("bf16", ckpt), ("f8", conversions["float8"])):
        shutil.copytree(src, tmp_path / name)
        m = json.loads((tmp_path / name / "k2jax_manifest.json").read_text())
        (tmp_path / name / "k2jax_manifest.json").write_text(json.dumps(m | {"layout_version": 1}))
    _, params = k2jax.load(tmp_path / "bf16")
    np.testing.assert_array_equal(bits(params["lm_head"]), bits(one_device[1]["lm_head"]))
    with pytest.raises(ValueError, match=r"layout version 1 .*convert it again, `k2jax convert SRC .* --dtype float8 "
                                         r"--overwrite`"):
        k2jax.load(tmp_path / "f8", quant="fp8")


def test_a_load_traces_the_model_once(conversions, monkeypatch):
    """One load (here a float8 conversion read on a mesh and requantized to INT4: the stored tree, two layouts'
    shardings, the held tree) traces the model's init once."""
    from k2jax.nn import model

    calls = []
    init = model.K2Model.init
    monkeypatch.setattr(model.K2Model, "init", lambda self, *a, **k: calls.append(1) or init(self, *a, **k))
    model._traced.cache_clear()
    k2jax.load(conversions["float8"], mesh=make_mesh("expert=4,tensor=2"), quant="int4")
    assert len(calls) == 1


def leaves_by_path(tree) -> dict:
    return {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(tree)}


# ------------------------------------------------------------------------------------------------------
def _config(changes: dict) -> k2jax.K2Config:
    return k2jax.K2Config.from_hf_config(TINY | changes)


@pytest.mark.parametrize("changes, tensor, problem", [
    (dict(n_routed_experts=16), "moe_layers.mlp.experts.down_proj",
     "needs shape (2, 16, 32, 64), the checkpoint holds (2, 8, 32, 64)"),
    (dict(hidden_size=128), "dense_layers.input_layernorm.weight",
     "needs shape (1, 128), the checkpoint holds (1, 64)"),
    (dict(num_hidden_layers=4), "moe_layers.input_layernorm.weight", "needs shape (3, 64)"),
    (dict(moe_intermediate_size=64), "moe_layers.mlp.experts.down_proj", "(2, 8, 64, 64)"),
    (dict(q_lora_rank=None), "dense_layers.self_attn.q_a_layernorm.weight",
     "in the checkpoint (1, 32) but not in the given cfg"),
], ids=["experts", "hidden", "layers", "expert_hidden", "no_q_lora"])
def test_mismatched_config_is_refused_naming_the_first_tensor(ckpt, changes, tensor, problem):
    with pytest.raises(ValueError, match="first mismatched tensor") as e:
        k2jax.load(ckpt, cfg=_config(changes), mesh=make_mesh("expert=8"))
    assert f"first mismatched tensor {tensor}: " in str(e.value) and problem in str(e.value), str(e.value)


def test_config_json_that_does_not_match_is_refused(ckpt, tmp_path):
    d = tmp_path / "edited"
    shutil.copytree(ckpt, d)
    hf = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(hf | dict(kv_lora_rank=24)))
    with pytest.raises(ValueError, match=r"does not match its config.json: first mismatched tensor "
                                         r"dense_layers.self_attn.kv_a_layernorm.weight: .*\(1, 24\).*\(1, 16\)"):
        k2jax.load(d, mesh=make_mesh("expert=8"))


def test_a_matching_cfg_with_other_settings_is_used(ckpt, one_device):
    cfg = _config(dict(rope_theta=1e6, max_position_embeddings=4096))
    got_cfg, params = k2jax.load(ckpt, cfg=cfg)
    assert got_cfg is cfg
    np.testing.assert_array_equal(bits(params["lm_head"]), bits(one_device[1]["lm_head"]))


# ------------------------------------------------------------------------------------------------------
# Two processes of 4 CPU devices each (jax.distributed on localhost) restore the wide checkpoint on one
# expert=8 mesh; each reports what it holds and the bytes it read from disk (rchar of /proc/self/io: every
# read/pread, whatever thread made it) during a second restore, after a first one has imported everything.
_WORKER = r"""
import json, sys
import jax
rank, port, ckpt = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=rank)
import k2jax
from k2jax.checkpoint.orbax_layout import leaves_by_name

def rchar():
    return int(next(l for l in open("/proc/self/io") if l.startswith("rchar:")).split()[1])

mesh = k2jax.make_mesh("expert=8")
k2jax.load(ckpt, mesh=mesh)  # discarded
before = rchar()
cfg, params = k2jax.load(ckpt, mesh=mesh)
read = rchar() - before
experts = params["moe_layers"]["mlp"]["experts"]
print("RESULT", json.dumps({
    "read": read, "local_devices": len(jax.local_devices()), "devices": len(jax.devices()),
    "experts_held": sorted({(s.index[1].start, s.index[1].stop) for a in experts.values()
                            for s in a.addressable_shards}),
    "shard_experts": sorted({s.data.shape[1] for a in experts.values() for s in a.addressable_shards}),
    # per stored array, the distinct regions this process's devices hold: [[start, stop] per dim] each
    "regions": {name: sorted({tuple((sl.indices(n)[0], sl.indices(n)[1]) for sl, n in zip(s.index, a.shape))
                              for s in a.addressable_shards})
                for name, a in leaves_by_name(params).items()},
}), flush=True)
"""



def test_each_process_reads_only_the_shards_its_devices_hold(wide):
    port = free_port()
    env = os.environ | {"XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    # rchar counts every read of the process: XLA's persistent compilation cache would add its entries' bytes
    # (4 MB measured) to the checkpoint's.
    env = {k: v for k, v in env.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    outs = run_all([[sys.executable, "-c", _WORKER, str(rank), str(port), str(wide)] for rank in range(2)],
                   [env, env], timeout=180, cwd=REPO)
    results = [result(o) for o in outs]

    manifest = json.loads((wide / "k2jax_manifest.json").read_text())
    E = WIDE["n_routed_experts"]
    expert_bytes = sum(int(np.prod(spec["shape"])) * jnp.dtype(spec["dtype"]).itemsize
                       for name, spec in manifest["leaves"].items() if name.startswith("moe_layers.mlp.experts."))
    for rank, r in enumerate(results):
        assert (r["devices"], r["local_devices"]) == (8, 4)
        assert r["shard_experts"] == [E // 8]
        assert r["experts_held"] == [[k, k + E // 8] for k in range(rank * E // 2, (rank + 1) * E // 2, E // 8)]
        # What the process must read: each storage chunk its devices' regions touch, once (`least`). What it
        # may read: Orbax reads once per distinct region, so a chunk that two of its devices' regions share
        # (a shared-expert slot split over `mlp`) may be read once for each (`most`); reads of one chunk at
        # the same time are sometimes merged, so the figure lies between the two.
        least = most = expert_most = 0
        for name, regions in r["regions"].items():
            spec = stored_array(wide, name)
            chunk_bytes = int(np.prod(spec["chunks"])) * jnp.dtype(spec["dtype"]).itemsize
            touched = [[set(range(a // c, -(-b // c))) for (a, b), c in zip(region, spec["chunks"])]
                       for region in regions]
            n_each = [int(np.prod([len(ids) for ids in t])) for t in touched]
            union = set()
            for t in touched:
                union |= set(itertools.product(*t))
            least += len(union) * chunk_bytes
            most += sum(n_each) * chunk_bytes
            if name.startswith("moe_layers.mlp.experts."):
                assert sum(n_each) == len(union), name  # an expert slot is one chunk, on one device
                expert_most += sum(n_each) * chunk_bytes
        print(f"process {rank}: read {r['read']} B, its chunks {least}..{most} B, expert stacks {expert_bytes} B")
        assert expert_most == expert_bytes // 2
        assert most - least < expert_bytes // 4  # so `most` below excludes reading a whole copy of the experts
        # slack: metadata files (.zarray, the manifest, Orbax's), measured below 64 KB
        assert least <= r["read"] <= most + (256 << 10), (rank, r["read"], least, most)


def test_host_memory_of_a_restore_is_its_in_flight_bound(wide):
    """Host buffers (numpy, seen by tracemalloc; device buffers of the CPU backend are not) peak at the
    in-flight bound plus what stays aliased by the CPU devices afterwards: never the model or an expert stack,
    though the 8 devices of this process hold every expert."""
    mesh = make_mesh("expert=8")
    cap = 6 << 20
    leaf_bytes = int(np.prod(stored_array(wide, "moe_layers.mlp.experts.up_proj")["shape"])) * 2
    shard_bytes = leaf_bytes // 8
    k2jax.load(wide, mesh=mesh, max_inflight_bytes=cap)  # discarded; imports and thread pools, outside the count
    tracemalloc.start()
    try:
        _, params = k2jax.load(wide, mesh=mesh, max_inflight_bytes=cap)
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    total = sum(a.nbytes for a in jax.tree_util.tree_leaves(params))
    print(f"host peak {peak / 2**20:.1f} MiB, kept {kept / 2**20:.1f} MiB, model {total / 2**20:.1f} MiB, "
          f"expert leaf {leaf_bytes / 2**20:.1f} MiB")
    assert peak >= shard_bytes  # the measurement does see the shard buffers
    # In flight: reads up to the bound, a shard on its way to its device after its read's reservation ended,
    # and Python's own small allocations.
    assert peak <= kept + cap + shard_bytes + (1 << 20)
    assert peak - kept < leaf_bytes / 2
