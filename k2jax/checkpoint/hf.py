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
    dtype: str  # safetensors code
    scale: str | None = None


@dataclasses.dataclass
class Plan:
    """The validated weights of a checkpoint (or of one block of it) and the problems found."""

    sources: list[Source]
    problems: list[str]
    block: tuple[int, int]

    def float_dtype(self) -> np.dtype:
        """The checkpoint's own float dtype: that of its weights other than the router (FP8 counts as
        bfloat16, the release's torch_dtype); mixed dtypes promote (bf16 + f16 -> f32)."""
        dt = None
        for s in self.sources:
            code = "BF16" if s.dtype == "F8_E4M3" else s.dtype
            if s.target.path[:2] == ("mlp", "gate") or code not in N_DTYPES:
                continue
            dt = N_DTYPES[code] if dt is None else np.dtype(jnp.promote_types(dt, N_DTYPES[code]))
        return np.dtype(np.float32) if dt is None else dt


def fp8_block(cfg: K2Config) -> tuple[int, int]:
    """FP8 block size from config.json's quantization_config (default [128, 128])."""
    qc = cfg.quantization_config or {}
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
    problems = list(ckpt.problems)

    def where(name):
        return f"{name!r} ({ckpt.file_of(name)})"

    whole = names is None
    names = list(ckpt.tensors) if whole else names
    present = set(names)
    sources, seen = [], {}
    for name in names:
        info = ckpt.tensors[name]
        if N.is_scale(name):
            weight = N.weight_of_scale(name)
            if weight not in present and _resolves(weight, cfg):
                problems.append(f"FP8 scale {where(name)} has no weight {weight!r}")
            continue
        try:
            target = N.resolve(name, cfg)
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
    if whole:
        problems += _missing(cfg, set(seen.values()) | ckpt.unavailable)
    return Plan(sources, problems, block)


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
def load_hf(path: str | os.PathLike, dtype=None) -> tuple[K2Config, dict[str, Any]]:
    """Load a HuggingFace DeepSeek-V3 / Kimi K2 checkpoint directory into k2jax params, in memory.

    Returns (cfg, params) with params exactly the tree, shapes and dtypes of `abstract_params(cfg, dtype)`
    as jax arrays. dtype None keeps the checkpoint's own float dtype (bf16 for the FP8 release). FP8 weights
    are dequantized in float32 with their block scales, then cast. All problems are reported in one
    ValueError before any weight is read.
    """
    from k2jax.nn.model import abstract_params

    cfg = K2Config.from_hf_config(path)
    with Checkpoint(path) as ckpt:
        plan = check_checkpoint(cfg, ckpt)
        raise_problems(plan.problems, path)
        dtype = plan.float_dtype() if dtype is None else jnp.dtype(dtype)
        leaves = {tuple(k.key for k in p): v for p, v in
                  jax.tree_util.tree_leaves_with_path(abstract_params(cfg, dtype))}
        # One preallocated array per (stacked) leaf, filled slot by slot: no list-then-stack copy.
        bufs = {k: np.empty(v.shape, v.dtype) for k, v in leaves.items()}
        for src in plan.sources:
            t = src.target
            x = ckpt.read(t.name)
            if src.scale is not None:
                x = dequantize(x, ckpt.read(src.scale), plan.block, np.float32)
            bufs[t.leaf][t.index] = t.transform.forward(x, N.slot_shape(t, cfg))
    return cfg, jax.device_put(_unflatten(bufs))


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
            block=DEFAULT_BLOCK) -> pathlib.Path:
    """Write params in the released HF layout: config.json, `model-{k}-of-{n}.safetensors` and
    model.safetensors.index.json (num_shards None: one model.safetensors, no index), with the
    `rotary_emb.inv_freq` buffers the release carries.

    fp8: every linear weight inside the blocks becomes F8_E4M3 + float32 `weight_scale_inv` (block `block`),
    embed / lm_head / norms / router bf16, the router bias float32; otherwise each tensor keeps its param
    dtype. Returns the directory.
    """
    if num_shards is not None and num_shards < 1:
        raise ValueError(f"save_hf: num_shards must be >= 1 or None, got {num_shards}")
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    flat = {tuple(k.key for k in p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(params)}
    tensors: dict[str, np.ndarray] = {}
    for i in range(cfg.num_hidden_layers):
        # The release interleaves these buffers with the weights; the loader skips them.
        P = cfg.qk_rope_head_dim
        tensors[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = (
            1.0 / cfg.rope_theta ** (np.arange(0, P, 2, dtype=np.float32) / P)).astype(np.float32)
    for name in N.expected_names(cfg):
        t = N.resolve(name, cfg)
        x = t.transform.inverse(flat[t.leaf][t.index])
        if fp8 and t.fp8:
            tensors[name], tensors[N.scale_name(name)] = quantize(x, block)
        elif fp8:
            keep_f32 = t.path[-1] == "e_score_correction_bias"
            tensors[name] = x.astype(np.float32 if keep_f32 else jnp.bfloat16)
        else:
            tensors[name] = x
    hf = cfg.to_hf_config()
    if fp8:
        hf["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": list(block)}
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
