"""HuggingFace checkpoints in memory: `load_hf` (release layout, FP8 or not) and `save_hf` (the same layout,
for synthetic checkpoints and tests). For small models; the streaming converter handles the 1T one.

`check_checkpoint` is the validation (shared with the streaming converter): it looks at every header, reads
only the small FP8 scales, and collects all problems before any weight is read.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from k2jax.checkpoint import int4 as I4
from k2jax.checkpoint import names as N
from k2jax.checkpoint.fp8 import DEFAULT_BLOCK, dequantize, quantize, scale_shape
from k2jax.checkpoint.safetensors_io import INDEX_NAME, SINGLE_NAME, Checkpoint, write_file
from k2jax.config import K2Config

MAX_LISTED = 200  # problems listed in one error; the rest are counted
N_DTYPES = {"F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
            "BF16": np.dtype(jnp.bfloat16)}
FLOAT_CODES = tuple(N_DTYPES)


@dataclasses.dataclass
class Source:
    """One HF weight to load: where it goes and, for FP8, its scale companion."""

    target: N.Target
    dtype: str  # safetensors code; "INT4" for a pack-quantized weight (target.name is then its logical name)
    scale: str | None = None  # FP8: `<weight>_scale_inv`; INT4: `<weight>_scale`
    packed: str | None = None  # INT4: `<weight>_packed` (the tensor read for the values)

    @property
    def stored(self) -> str:
        """The tensor that holds the weight's values in the checkpoint."""
        return self.packed or self.target.name


@dataclasses.dataclass
class Plan:
    """The validated weights of a checkpoint (or of one block of it) and the problems found."""

    sources: list[Source]
    problems: list[str]
    block: tuple[int, int]
    fmt: str | None = None  # quantization_config's format: None, "fp8" or "int4" (pack-quantized)

    def float_dtype(self) -> np.dtype:
        """The checkpoint's own float dtype: that of its weights other than the router (FP8 counts as
        bfloat16, the release's torch_dtype); mixed dtypes promote (bf16 + f16 -> f32)."""
        dt = None
        for s in self.sources:
            code = "BF16" if s.dtype in ("F8_E4M3", "INT4") else s.dtype
            if s.target.path[:2] == ("mlp", "gate") or code not in N_DTYPES:
                continue
            dt = N_DTYPES[code] if dt is None else np.dtype(jnp.promote_types(dt, N_DTYPES[code]))
        return np.dtype(np.float32) if dt is None else dt


def fp8_block(cfg: K2Config) -> tuple[int, int]:
    """FP8 block size from config.json's quantization_config (default [128, 128])."""
    qc = cfg.quantization_config or {}
    if qc.get("quant_method") not in (None, "fp8"):
        return DEFAULT_BLOCK
    block = qc.get("weight_block_size") or DEFAULT_BLOCK
    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise ValueError(f"config.json: quantization_config.weight_block_size must be two positive integers, "
                         f"got {block!r}")
    return tuple(block)


def check_checkpoint(cfg: K2Config, ckpt: Checkpoint, names: list[str] | None = None) -> Plan:
    """Resolve and validate the tensors `names` (default: all in the checkpoint) against `cfg`.

    Problems found: unknown tensors, tensors used twice, wrong dtypes or shapes, FP8 weights without a
    (well-shaped, finite, positive) scale, orphan scales, and, when checking the whole checkpoint, missing
    tensors. Each names the tensor and its file.
    """
    block = fp8_block(cfg)
    fmt, problems = I4.check_config(cfg.quantization_config)
    problems = list(ckpt.problems) + problems

    def where(name):
        return f"{name!r} ({ckpt.file_of(name)})"

    whole = names is None
    names = list(ckpt.tensors) if whole else names
    present = set(names)
    sources, seen = [], {}
    experts: dict[int, dict[bool, str]] = {}  # HF layer -> {stored INT4?: a tensor}, for the mix check
    for name in names:
        info = ckpt.tensors[name]
        if N.is_scale(name):
            weight = N.weight_of_scale(name)
            if weight not in present and _resolves(weight, cfg):
                problems.append(f"FP8 scale {where(name)} has no weight {weight!r}")
            continue
        part = N.int4_part(name)
        if part is not None and part != "_packed":
            packed = N.int4_names(N.weight_of_int4(name))["packed"]
            if packed not in present and _resolves(N.weight_of_int4(name), cfg):
                problems.append(f"INT4 tensor {where(name)} has no {packed!r}")
            continue
        weight = N.weight_of_int4(name) if part else name
        try:
            target = N.resolve(weight, cfg)
        except N.UnknownTensorError as e:
            problems.append(f"{e} ({ckpt.file_of(name)})")
            continue
        if target is None:
            continue
        slot = (target.leaf, target.index)
        if slot in seen:
            problems.append(f"{where(name)} and {where(seen[slot])} both fill {'/'.join(target.leaf)}"
                            f"{list(target.index)}: tensor used twice")
            continue
        seen[slot] = name
        want = target.transform.source_shape(N.slot_shape(target, cfg))
        if target.int4:
            experts.setdefault(target.hf_layer, {}).setdefault(bool(part), name)
        if part:  # INT4 pack-quantized
            found = _check_int4(ckpt, cfg, fmt, target, name, want, present)
            problems += found
            sources.append(Source(target, "INT4", N.int4_names(weight)["scale"], name))
            continue
        if info.shape != want:
            problems.append(f"{where(name)}: shape {list(info.shape)}, config.json implies {list(want)}")
        src = Source(target, info.dtype)
        scale = N.scale_name(name)
        if info.dtype == "F8_E4M3":
            if scale not in ckpt.tensors:
                problems.append(f"{where(name)}: F8_E4M3 weight without its scale {scale!r}")
            else:
                src.scale = scale
                problems += _check_scale(ckpt, scale, info.shape, block)
        elif info.dtype not in FLOAT_CODES:
            problems.append(f"{where(name)}: dtype {info.dtype} is not a float type")
        elif scale in ckpt.tensors:
            problems.append(f"{where(scale)}: a scale for {name!r}, which is {info.dtype}, not F8_E4M3")
        sources.append(src)
    for layer, kinds in sorted(experts.items()):
        if len(kinds) == 2:
            problems.append(f"layer {layer} mixes INT4 and plain routed experts: {where(kinds[True])} is INT4 "
                            f"pack-quantized, {where(kinds[False])} is {ckpt.tensors[kinds[False]].dtype}; a layer's "
                            f"experts are held as one stacked array, all quantized or none")
        elif fmt == "int4" and False in kinds:
            problems.append(f"{where(kinds[False])}: {ckpt.tensors[kinds[False]].dtype}, but config.json's "
                            f"quantization_config ({I4.QUANT_METHOD}) quantizes the routed experts: expected "
                            f"{N.int4_names(kinds[False])['packed']!r} and its scale")
    if whole:
        found = {N.weight_of_int4(n) if N.int4_part(n) else n for n in set(seen.values()) | ckpt.unavailable}
        problems += _missing(cfg, found)
    return Plan(sources, problems, block, fmt)


def _check_int4(ckpt: Checkpoint, cfg: K2Config, fmt, target: N.Target, packed: str, want, present) -> list[str]:
    """Problems of one pack-quantized weight (`packed` is its `_packed` tensor; want: HF [out, in])."""
    info, names = ckpt.tensors[packed], N.int4_names(target.name)

    def where(name):
        return f"{name!r} ({ckpt.file_of(name)})"

    if fmt != "int4":
        return [f"{where(packed)}: an INT4 pack-quantized tensor, but config.json has no {I4.QUANT_METHOD} "
                f"{I4.FORMAT!r} quantization_config (found {(cfg.quantization_config or {}).get('quant_method')!r})"]
    if not target.int4:
        return [f"{where(packed)}: INT4 is implemented for the routed experts only "
                f"(model.layers.L.mlp.experts.E.*), not {'/'.join(target.leaf)}"]
    if len(want) != 2:
        return [f"{where(packed)}: INT4 needs a 2-D weight, config.json implies {list(want)}"]
    out, inn = want
    problems = []
    zp = target.name + "_zero_point"
    if zp in ckpt.tensors:
        problems.append(f"{where(zp)}: asymmetric INT4 (a zero point) is not implemented")
    if inn % I4.GROUP:
        return problems + [f"{where(packed)}: the group size {I4.GROUP} does not divide its input dim {inn} "
                           f"(weight [{out}, {inn}] as config.json implies)"]
    if info.dtype != "I32" or info.shape != I4.packed_shape(out, inn):
        problems.append(f"{where(packed)}: {info.dtype} {list(info.shape)}, expected I32 "
                        f"{list(I4.packed_shape(out, inn))} (8 values per int32 of the weight [{out}, {inn}] "
                        f"config.json implies)")
    s = names["scale"]
    if s not in ckpt.tensors or s not in present:
        problems.append(f"{where(packed)}: INT4 weight without its scale {s!r}")
    elif ckpt.tensors[s].shape != I4.scale_shape(out, inn) or ckpt.tensors[s].dtype not in FLOAT_CODES:
        problems.append(f"{where(s)}: {ckpt.tensors[s].dtype} {list(ckpt.tensors[s].shape)}, expected a float "
                        f"{list(I4.scale_shape(out, inn))} = one per output row and group of {I4.GROUP} inputs")
    else:
        x = ckpt.read(s).astype(np.float32)
        bad = ~np.isfinite(x) | (x <= 0)
        if bad.any():
            problems.append(f"{where(s)}: {int(bad.sum())} scale(s) not finite and positive, e.g. {x[bad].flat[0]} "
                            f"at [row, group] {[int(i) for i in np.argwhere(bad)[0]]}")
    sh = names["shape"]
    if sh not in ckpt.tensors or sh not in present:
        problems.append(f"{where(packed)}: INT4 weight without its {sh!r}")
    elif ckpt.tensors[sh].dtype not in ("I64", "I32") or ckpt.tensors[sh].shape != (2,):
        problems.append(f"{where(sh)}: {ckpt.tensors[sh].dtype} {list(ckpt.tensors[sh].shape)}, expected I64 [2]")
    else:
        got = [int(v) for v in ckpt.read(sh)]
        if got != [out, inn]:
            problems.append(f"{where(sh)}: {got}, but config.json implies the weight is [{out}, {inn}]")
    return problems


def _resolves(name: str, cfg: K2Config) -> bool:
    try:
        return N.resolve(name, cfg) is not None
    except N.UnknownTensorError:
        return True  # report the orphan scale; the weight's own name problem is reported elsewhere


def _check_scale(ckpt: Checkpoint, scale: str, weight_shape, block) -> list[str]:
    info, where = ckpt.tensors[scale], f"{scale!r} ({ckpt.file_of(scale)})"
    if len(weight_shape) != 2:
        return [f"{where}: block scales need a 2-D weight, got {list(weight_shape)}"]
    want = scale_shape(weight_shape, block)
    if info.shape != want:
        return [f"{where}: shape {list(info.shape)}, expected {list(want)} = ceil({list(weight_shape)} / "
                f"{list(block)})"]
    if info.dtype not in FLOAT_CODES:
        return [f"{where}: dtype {info.dtype} is not a float type"]
    s = ckpt.read(scale).astype(np.float32)
    bad = ~np.isfinite(s) | (s <= 0)
    if bad.any():
        return [f"{where}: {int(bad.sum())} scale(s) not finite and positive, e.g. {s[bad].flat[0]} at "
                f"block {[int(i) for i in np.argwhere(bad)[0]]}"]
    return []


def _missing(cfg: K2Config, found: set[str]) -> list[str]:
    """Expected weights not in `found`, summarised per whole layer and per whole expert."""
    out = [f"missing tensor {n!r}" for n in N.global_names(cfg) if n not in found]
    per_expert = sum("{e}" in t for t, *_ in N.RULES)
    for i in range(cfg.num_hidden_layers):
        want = N.layer_names(cfg, i)
        gone = [n for n in want if n not in found]
        if gone and len(gone) == len(want):
            out.append(f"missing layer {i}: none of its {len(want)} tensors model.layers.{i}.* is present")
            continue
        by_expert: dict[int, list[str]] = {}
        for n in gone:
            e = N.resolve(n, cfg).expert
            if e is None:
                out.append(f"missing tensor {n!r}")
            else:
                by_expert.setdefault(e, []).append(n)
        for e, ns in by_expert.items():
            if len(ns) == per_expert:
                out.append(f"missing expert {e} of layer {i}: no model.layers.{i}.mlp.experts.{e}.* tensor")
            else:
                out += [f"missing tensor {n!r}" for n in ns]
    return out


def raise_problems(problems: list[str], path) -> None:
    if problems:
        listed = problems[:MAX_LISTED]
        more = f"\n  ... and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
        raise ValueError(f"checkpoint {os.fspath(path)}: {len(problems)} problem(s):\n  - "
                         + "\n  - ".join(listed) + more)


# ------------------------------------------------------------------------------------------------------
def load_hf(path: str | os.PathLike, dtype=None, quant: str | None = None) -> tuple[K2Config, dict[str, Any]]:
    """Load a HuggingFace DeepSeek-V3 / Kimi K2 checkpoint directory into k2jax params, in memory.

    Returns (cfg, params) with params exactly the tree, shapes and dtypes of `abstract_params(cfg, dtype)`
    as jax arrays. dtype None keeps the checkpoint's own float dtype (bf16 for the FP8 and INT4 releases).
    All problems are reported in one ValueError before any weight is read.

    quant: what the device holds of the quantized weights.
      None    every weight dequantized (float32 products, one rounding) to dtype;
      "fp8"   an FP8 release's (Kimi-K2-Instruct) e4m3 block weights kept as `QuantizedWeight(fmt="fp8")`
              leaves, transposed into k2jax's layout with their scales;
      "int4"  the routed experts as `QuantizedWeight(fmt="int4")`: a pack-quantized release's (Kimi-K2-Thinking)
              4-bit values as stored; an FP8 release's experts requantized to INT4 groups of 32 (lossy: a
              second rounding on top of FP8's). Everything else dequantized to dtype.
    A plain float checkpoint with quant "fp8" or "int4" is refused (nothing there to keep): load it with
    quant=None and quantize the tree (k2jax.ops.quant.quantize) if that is what you want.
    """
    from k2jax.nn.model import abstract_params
    from k2jax.nn.quantized import check_quant

    cfg = K2Config.from_hf_config(path)
    check_quant(quant)
    with Checkpoint(path) as ckpt:
        plan = check_checkpoint(cfg, ckpt)
        raise_problems(plan.problems + quant_problems(plan, quant, ckpt), path)
        dtype = plan.float_dtype() if dtype is None else jnp.dtype(dtype)
        leaves = {tuple(k.key for k in p): v for p, v in jax.tree_util.tree_leaves_with_path(
            abstract_params(cfg, dtype, quant=quant), is_leaf=_is_qw)}
        # One preallocated array per (stacked) leaf, filled slot by slot: no list-then-stack copy.
        bufs = {k: (np.empty(v.values.shape, v.values.dtype), np.empty(v.scales.shape, v.scales.dtype))
                if _is_qw(v) else np.empty(v.shape, v.dtype) for k, v in leaves.items()}
        for src in plan.sources:
            t = src.target
            slot = N.slot_shape(t, cfg)
            buf = bufs[t.leaf]
            if isinstance(buf, tuple):
                buf[0][t.index], buf[1][t.index] = read_quantized(ckpt, src, plan.block, slot, leaves[t.leaf])
            else:
                buf[t.index] = t.transform.forward(read_dequantized(ckpt, src, plan.block), slot)
    from k2jax.ops.quant import QuantizedWeight

    flat = {k: QuantizedWeight(jnp.asarray(b[0]), jnp.asarray(b[1]), leaves[k].fmt, leaves[k].in_ndim)
            if isinstance(b, tuple) else jnp.asarray(b) for k, b in bufs.items()}
    return cfg, jax.device_put(_unflatten(flat))


def _is_qw(x) -> bool:
    from k2jax.ops.quant import QuantizedWeight

    return isinstance(x, QuantizedWeight)


def quant_problems(plan: Plan, quant: str | None, ckpt: Checkpoint) -> list[str]:
    """Why a checkpoint cannot be held as `quant` (one line per kind of stored weight that does not fit)."""
    if quant is None:
        return []
    need = "F8_E4M3" if quant == "fp8" else ("F8_E4M3", "INT4")
    bad = [s for s in plan.sources if (s.target.fp8 if quant == "fp8" else s.target.int4) and s.dtype not in need]
    if quant == "fp8" and tuple(plan.block) != (128, 128) and any(x.dtype == "F8_E4M3" for x in plan.sources):
        return [f"quant='fp8' holds 128x128 blocks (k2jax.ops.quant); this checkpoint's weight_block_size is "
                f"{list(plan.block)}: load with quant=None"]
    if not bad:
        return []
    s = bad[0]
    kind = ("keeps the FP8 (e4m3) weights of a release like Kimi-K2-Instruct" if quant == "fp8" else
            "keeps INT4 routed experts as stored (Kimi-K2-Thinking) or requantizes an FP8 release's")
    return [f"quant={quant!r} {kind}, but {len(bad)} of them are stored as {s.dtype}, e.g. {s.stored!r} "
            f"({ckpt.file_of(s.stored)}): load with quant=None (and quantize the params yourself if you want "
            f"that, k2jax.ops.quant.quantize)"]


def read_dequantized(ckpt: Checkpoint, src: Source, block, out=None) -> np.ndarray:
    """One source weight in its HF layout as float32 (FP8 and INT4 dequantized), or as stored if plain."""
    if src.dtype == "INT4":
        return I4.dequantize(ckpt.read(src.packed), ckpt.read(src.scale))
    x = ckpt.read(src.target.name)
    if src.scale is not None:
        x = dequantize(x, ckpt.read(src.scale), block, np.float32)
    return x


def read_quantized(ckpt: Checkpoint, src: Source, block, slot, qw) -> tuple[np.ndarray, np.ndarray]:
    """One source weight as a QuantizedWeight slot (values [*slot] or packed [*slot[:-1], out/2], scales), in
    k2jax layout: FP8 / INT4 as stored (only moved), or an FP8 weight requantized to INT4."""
    from k2jax.ops.quant import quantize as q

    t = src.target
    if src.dtype == "INT4":
        v, s = I4.to_k2jax(ckpt.read(src.packed), ckpt.read(src.scale))
        return v.reshape(qw.values.shape[len(t.index):]), s
    if qw.fmt == "fp8":
        w = ckpt.read(t.name)
        if tuple(block) != (128, 128):
            raise ValueError(f"{t.name!r}: quant='fp8' holds 128x128 blocks, the checkpoint has {list(block)}")
        return t.transform.forward(w, slot), np.ascontiguousarray(ckpt.read(src.scale).astype(np.float32).T)
    w = t.transform.forward(read_dequantized(ckpt, src, block).astype(np.float32), slot)  # INT4 from FP8
    r = q(w, "int4", qw.in_ndim)
    return np.asarray(r.values), np.asarray(r.scales)


def _unflatten(flat: dict[tuple[str, ...], Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path, v in flat.items():
        node = tree
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = v
    return tree


# ------------------------------------------------------------------------------------------------------
def save_hf(params, cfg: K2Config, path: str | os.PathLike, fp8: bool = False, num_shards: int | None = 1,
            block=DEFAULT_BLOCK, int4: bool = False) -> pathlib.Path:
    """Write params in the released HF layout: config.json, `model-{k}-of-{n}.safetensors` and
    model.safetensors.index.json (num_shards None: one model.safetensors, no index), with the
    `rotary_emb.inv_freq` buffers the release carries.

    fp8: every linear weight inside the blocks becomes F8_E4M3 + float32 `weight_scale_inv` (block `block`),
    embed / lm_head / norms / router bf16, the router bias float32; otherwise each tensor keeps its param
    dtype. int4: Kimi-K2-Thinking's layout: the routed experts INT4 pack-quantized (k2jax.checkpoint.int4:
    `weight_packed` / `weight_scale` / `weight_shape`, quantized here with absmax groups of 32, or written as
    held when the params hold them as QuantizedWeight(fmt="int4")), everything else bf16 (the router bias
    float32), and its compressed-tensors quantization_config. Returns the directory.
    """
    from k2jax.ops.quant import dequantize as dequantize_qw

    if num_shards is not None and num_shards < 1:
        raise ValueError(f"save_hf: num_shards must be >= 1 or None, got {num_shards}")
    if fp8 and int4:
        raise ValueError("save_hf: fp8 and int4 are two different release layouts; pick one")
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    flat = {tuple(k.key for k in p): v for p, v in jax.tree_util.tree_leaves_with_path(params, is_leaf=_is_qw)}
    held = {k: v for k, v in flat.items() if _is_qw(v)}
    flat = {k: np.asarray(dequantize_qw(v, np.float32) if _is_qw(v) else v) for k, v in flat.items()}
    tensors: dict[str, np.ndarray] = {}
    for i in range(cfg.num_hidden_layers):
        # The release interleaves these buffers with the weights; the loader skips them.
        P = cfg.qk_rope_head_dim
        tensors[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = (
            1.0 / cfg.rope_theta ** (np.arange(0, P, 2, dtype=np.float32) / P)).astype(np.float32)
    for name in N.expected_names(cfg):
        t = N.resolve(name, cfg)
        x = t.transform.inverse(flat[t.leaf][t.index])
        if int4 and t.int4:
            qw = held.get(t.leaf)
            if qw is not None and qw.fmt == "int4":  # as held: no second rounding
                packed, scale = I4.from_k2jax(np.asarray(qw.values[t.index]), np.asarray(qw.scales[t.index]))
            else:
                packed, scale = I4.quantize(x)
            parts = N.int4_names(name)
            tensors[parts["packed"]], tensors[parts["scale"]] = packed, scale
            tensors[parts["shape"]] = np.array(x.shape, np.int64)
        elif int4 or fp8 and not t.fp8:
            keep_f32 = t.path[-1] == "e_score_correction_bias"
            tensors[name] = x.astype(np.float32 if keep_f32 else jnp.bfloat16)
        elif fp8:
            tensors[name], tensors[N.scale_name(name)] = quantize(x, block)
        else:
            tensors[name] = x
    hf = cfg.to_hf_config()
    if fp8:
        hf["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": list(block)}
        hf["torch_dtype"] = "bfloat16"
    elif int4:
        hf["quantization_config"] = I4.quantization_config()
        hf["torch_dtype"] = "bfloat16"
    else:
        hf.pop("quantization_config", None)
        hf["torch_dtype"] = str(flat[("embed_tokens",)].dtype)
    (path / "config.json").write_text(json.dumps(hf, indent=2))
    _write_shards(path, tensors, num_shards)
    return path


def _write_shards(path: pathlib.Path, tensors: dict[str, np.ndarray], num_shards: int | None):
    meta = {"format": "pt"}
    if num_shards is None:
        write_file(path / SINGLE_NAME, tensors, meta)
        return
    order = sorted(tensors, key=_release_order)
    total = sum(tensors[n].nbytes for n in order)
    shards: list[list[str]] = [[] for _ in range(num_shards)]
    acc = 0
    for n in order:  # contiguous runs of roughly equal bytes, like the release's shards
        shards[min(num_shards - 1, acc * num_shards // max(total, 1))].append(n)
        acc += tensors[n].nbytes
    weight_map = {}
    for k, names in enumerate(shards, 1):
        fname = f"model-{k}-of-{num_shards}.safetensors"
        write_file(path / fname, {n: tensors[n] for n in names}, meta)
        weight_map.update({n: fname for n in names})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (path / INDEX_NAME).write_text(json.dumps(index, indent=2))


def _release_order(name: str):
    """Embedding first, then layer by layer, then norm and lm_head."""
    parts = name.split(".")
    if name.startswith("model.layers."):
        return (1, int(parts[2]), name)
    return (0 if "embed" in name else 2, 0, name)
