"""Validation of a HuggingFace checkpoint against a config, before any weight is read: every header, the small
FP8 / INT4 scales, the index; all problems collected and reported together (`raise_problems`). Shared by the
in-memory loader (k2jax.checkpoint.hf_read) and the streaming converter.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib

import jax.numpy as jnp
import numpy as np

from k2jax.checkpoint import int4 as int4_format
from k2jax.checkpoint import names as hf_names
from k2jax.checkpoint.fp8 import DEFAULT_BLOCK, scale_shape
from k2jax.checkpoint.safetensors_io import Checkpoint
from k2jax.config import K2Config
from k2jax.quant_policy import FORMATS

MAX_LISTED = 200  # problems listed in one error; the rest are counted
N_DTYPES = {"F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
            "BF16": np.dtype(jnp.bfloat16)}
FLOAT_CODES = tuple(N_DTYPES)


def text_prefix(path) -> str:
    """Where the text model's tensors are in the checkpoint at `path` (a directory with config.json, or one
    .safetensors file beside it; or config.json's parsed dict): names.TEXT_PREFIX when config.json nests the text
    model's config in `text_config` (Kimi-K2.5 / K2.6, KimiK25ForConditionalGeneration), else ""."""
    if isinstance(path, dict):
        raw = path
    else:
        p = pathlib.Path(path)
        config = (p if p.is_dir() else p.parent) / "config.json"
        try:
            raw = json.loads(config.read_text())
        except (OSError, json.JSONDecodeError):
            return ""  # reported by K2Config.from_hf_config
    return hf_names.TEXT_PREFIX if isinstance(raw, dict) and isinstance(raw.get("text_config"), dict) else ""


def raise_problems(problems: list[str], where, error=ValueError, what: str = "problem(s)") -> None:
    """Raise `error` listing `problems` (the first MAX_LISTED, the rest counted) under `where`; nothing if none."""
    if problems:
        more = f"\n  ... and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
        raise error(f"{where}: {len(problems)} {what}:\n  - " + "\n  - ".join(problems[:MAX_LISTED]) + more)


@dataclasses.dataclass
class Source:
    """One HF weight to load: where it goes and, for FP8, its scale companion."""

    target: hf_names.Target
    dtype: str  # safetensors code; "INT4" for a pack-quantized weight (target.name is then its logical name)
    scale: str | None = None  # FP8: `<weight>_scale_inv`; INT4: `<weight>_scale`
    packed: str | None = None  # INT4: `<weight>_packed` (the tensor read for the values)

    @property
    def stored(self) -> str:
        """The tensor that holds the weight's values in the checkpoint."""
        return self.packed or self.target.name


@dataclasses.dataclass
class Validation:
    """The validated weights of a checkpoint (or of one block of it) and the problems found."""

    sources: list[Source]
    problems: list[str]
    block: tuple[int, int]
    fmt: str | None = None  # quantization_config's format: None, "fp8" or "int4" (pack-quantized)
    vision: list[str] = dataclasses.field(default_factory=list)  # K2.5's vision tensors, skipped unread

    def vision_note(self, where) -> str | None:
        """The one line saying the vision tower was skipped (None when there was none)."""
        if not self.vision:
            return None
        return (f"{where}: skipping the vision tower and projector ({len(self.vision)} tensors "
                f"{', '.join(sorted({n.split('.')[0] + '.*' for n in self.vision}))}, never read): k2jax runs the "
                f"text model under {hf_names.TEXT_PREFIX!r}")

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


def check_checkpoint(cfg: K2Config, ckpt: Checkpoint, names: list[str] | None = None,
                     prefix: str = "", read_data: bool = True) -> Validation:
    """Resolve and validate the tensors `names` (default: all in the checkpoint) against `cfg`.

    Problems found: unknown tensors, tensors used twice, wrong dtypes or shapes, FP8 weights without a
    (well-shaped, finite, positive) scale, orphan scales, and, when checking the whole checkpoint, missing
    tensors. Each names the tensor and its file. prefix: where the text model's tensors are (see
    `text_prefix`); with one, the vision tensors beside it are listed in Validation.vision and not read.
    read_data False: the headers only; the scales' values are left to `data_problems` (e.g. each host of a
    multi-host conversion checks those of its own layers).
    """
    block = fp8_block(cfg)
    fmt, problems = int4_format.check_config(cfg.quantization_config)
    problems = list(ckpt.problems) + problems
    vision = []

    def where(name):
        return f"{name!r} ({ckpt.file_of(name)})"

    whole = names is None
    names = list(ckpt.tensors) if whole else names
    present = set(names)
    sources, seen = [], {}
    experts: dict[int, dict[bool, str]] = {}  # HF layer -> {stored INT4?: a tensor}, for the mix check
    for name in names:
        info = ckpt.tensors[name]
        if prefix and hf_names.is_vision(name):
            vision.append(name)
            continue
        if hf_names.is_scale(name):
            weight = hf_names.weight_of_scale(name)
            if weight not in present and _resolves(weight, cfg, prefix):
                problems.append(f"FP8 scale {where(name)} has no weight {weight!r}")
            continue
        part = hf_names.int4_part(name)
        if part is not None and part != "_packed":
            packed = hf_names.int4_names(hf_names.weight_of_int4(name))["packed"]
            if packed not in present and _resolves(hf_names.weight_of_int4(name), cfg, prefix):
                problems.append(f"INT4 tensor {where(name)} has no {packed!r}")
            continue
        weight = hf_names.weight_of_int4(name) if part else name
        try:
            target = hf_names.resolve(weight, cfg, prefix)
        except hf_names.UnknownTensorError as e:
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
        want = target.transform.source_shape(hf_names.slot_shape(target, cfg))
        if target.int4:
            experts.setdefault(target.hf_layer, {}).setdefault(bool(part), name)
        if part:  # INT4 pack-quantized
            found = _check_int4(ckpt, cfg, fmt, target, name, want, present, read_data)
            problems += found
            sources.append(Source(target, "INT4", hf_names.int4_names(weight)["scale"], name))
            continue
        if info.shape != want:
            problems.append(f"{where(name)}: shape {list(info.shape)}, config.json implies {list(want)}")
        src = Source(target, info.dtype)
        scale = hf_names.scale_name(name)
        if info.dtype == "F8_E4M3":
            if scale not in ckpt.tensors:
                problems.append(f"{where(name)}: F8_E4M3 weight without its scale {scale!r}")
            else:
                src.scale = scale
                problems += _check_scale(ckpt, scale, info.shape, block, read_data)
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
                            f"quantization_config ({int4_format.QUANT_METHOD}) quantizes the routed experts: expected "
                            f"{hf_names.int4_names(kinds[False])['packed']!r} and its scale")
    if whole:
        found = {hf_names.weight_of_int4(n) if hf_names.int4_part(n) else n for n in set(seen.values()) | ckpt.unavailable}
        problems += _missing(cfg, found, prefix)
    return Validation(sources, problems, block, fmt, vision)


def _check_int4(ckpt: Checkpoint, cfg: K2Config, fmt, target: hf_names.Target, packed: str, want, present,
                read: bool = True) -> list[str]:
    """Problems of one pack-quantized weight (`packed` is its `_packed` tensor; want: HF [out, in])."""
    info, names = ckpt.tensors[packed], hf_names.int4_names(target.name)

    def where(name):
        return f"{name!r} ({ckpt.file_of(name)})"

    if fmt != "int4":
        return [f"{where(packed)}: an INT4 pack-quantized tensor, but config.json has no {int4_format.QUANT_METHOD} "
                f"{int4_format.FORMAT!r} quantization_config (found {(cfg.quantization_config or {}).get('quant_method')!r})"]
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
    if inn % int4_format.GROUP:
        return problems + [f"{where(packed)}: the group size {int4_format.GROUP} does not divide its input dim {inn} "
                           f"(weight [{out}, {inn}] as config.json implies)"]
    if info.dtype != "I32" or info.shape != int4_format.packed_shape(out, inn):
        problems.append(f"{where(packed)}: {info.dtype} {list(info.shape)}, expected I32 "
                        f"{list(int4_format.packed_shape(out, inn))} (8 values per int32 of the weight [{out}, {inn}] "
                        f"config.json implies)")
    s = names["scale"]
    if s not in ckpt.tensors or s not in present:
        problems.append(f"{where(packed)}: INT4 weight without its scale {s!r}")
    elif ckpt.tensors[s].shape != int4_format.scale_shape(out, inn) or ckpt.tensors[s].dtype not in FLOAT_CODES:
        problems.append(f"{where(s)}: {ckpt.tensors[s].dtype} {list(ckpt.tensors[s].shape)}, expected a float "
                        f"{list(int4_format.scale_shape(out, inn))} = one per output row and group of {int4_format.GROUP} inputs")
    elif read:
        problems += _int4_scale_values(ckpt, s)
    sh = names["shape"]
    if sh not in ckpt.tensors or sh not in present:
        problems.append(f"{where(packed)}: INT4 weight without its {sh!r}")
    elif ckpt.tensors[sh].dtype not in ("I64", "I32") or ckpt.tensors[sh].shape != (2,):
        problems.append(f"{where(sh)}: {ckpt.tensors[sh].dtype} {list(ckpt.tensors[sh].shape)}, expected I64 [2]")
    elif read:
        problems += _int4_shape_values(ckpt, sh, out, inn)
    return problems


def _int4_scale_values(ckpt: Checkpoint, s: str) -> list[str]:
    x = ckpt.read(s).astype(np.float32)
    bad = ~np.isfinite(x) | (x <= 0)
    if bad.any():
        return [f"{s!r} ({ckpt.file_of(s)}): {int(bad.sum())} scale(s) not finite and positive, e.g. "
                f"{x[bad].flat[0]} at [row, group] {[int(i) for i in np.argwhere(bad)[0]]}"]
    return []


def _int4_shape_values(ckpt: Checkpoint, sh: str, out: int, inn: int) -> list[str]:
    got = [int(v) for v in ckpt.read(sh)]
    if got != [out, inn]:
        return [f"{sh!r} ({ckpt.file_of(sh)}): {got}, but config.json implies the weight is [{out}, {inn}]"]
    return []


def _resolves(name: str, cfg: K2Config, prefix: str) -> bool:
    try:
        return hf_names.resolve(name, cfg, prefix) is not None
    except hf_names.UnknownTensorError:
        return True  # report the orphan scale; the weight's own name problem is reported elsewhere


def _check_scale(ckpt: Checkpoint, scale: str, weight_shape, block, read: bool = True) -> list[str]:
    info, where = ckpt.tensors[scale], f"{scale!r} ({ckpt.file_of(scale)})"
    if len(weight_shape) != 2:
        return [f"{where}: block scales need a 2-D weight, got {list(weight_shape)}"]
    want = scale_shape(weight_shape, block)
    if info.shape != want:
        return [f"{where}: shape {list(info.shape)}, expected {list(want)} = ceil({list(weight_shape)} / "
                f"{list(block)})"]
    if info.dtype not in FLOAT_CODES:
        return [f"{where}: dtype {info.dtype} is not a float type"]
    return _scale_values(ckpt, scale) if read else []


def _scale_values(ckpt: Checkpoint, scale: str) -> list[str]:
    where = f"{scale!r} ({ckpt.file_of(scale)})"
    s = ckpt.read(scale).astype(np.float32)
    bad = ~np.isfinite(s) | (s <= 0)
    if bad.any():
        return [f"{where}: {int(bad.sum())} scale(s) not finite and positive, e.g. {s[bad].flat[0]} at "
                f"block {[int(i) for i in np.argwhere(bad)[0]]}"]
    return []


def data_problems(cfg: K2Config, ckpt: Checkpoint, checked: Validation, which=None) -> list[str]:
    """The value checks `check_checkpoint(read_data=False)` left out (FP8 and INT4 scales finite and positive,
    INT4 shape tensors), for the sources `which(source)` selects (default: all). Run after the header checks
    passed (so every tensor read here is there and well-shaped)."""
    problems = []
    for src in checked.sources:
        if src.scale is None or (which is not None and not which(src)):
            continue
        if src.dtype != "INT4":
            problems += _scale_values(ckpt, src.scale)
            continue
        out, inn = src.target.transform.source_shape(hf_names.slot_shape(src.target, cfg))
        problems += _int4_scale_values(ckpt, src.scale)
        problems += _int4_shape_values(ckpt, hf_names.int4_names(src.target.name)["shape"], out, inn)
    return problems


def _missing(cfg: K2Config, found: set[str], prefix: str) -> list[str]:
    """Expected weights not in `found`, summarised per whole layer and per whole expert."""
    out = [f"missing tensor {n!r}" for n in hf_names.global_names(cfg, prefix) if n not in found]
    per_expert = sum("{e}" in t for t, *_ in hf_names.RULES)
    for i in range(cfg.num_hidden_layers):
        want = hf_names.layer_names(cfg, i, prefix)
        gone = [n for n in want if n not in found]
        if gone and len(gone) == len(want):
            out.append(f"missing layer {i}: none of its {len(want)} tensors {prefix}model.layers.{i}.* is present")
            continue
        by_expert: dict[int, list[str]] = {}
        for n in gone:
            e = hf_names.resolve(n, cfg, prefix).expert
            if e is None:
                out.append(f"missing tensor {n!r}")
            else:
                by_expert.setdefault(e, []).append(n)
        for e, ns in by_expert.items():
            if len(ns) == per_expert:
                out.append(f"missing expert {e} of layer {i}: no {prefix}model.layers.{i}.mlp.experts.{e}.* tensor")
            else:
                out += [f"missing tensor {n!r}" for n in ns]
    return out


def quant_problems(checked: Validation, quant: str | None, ckpt: Checkpoint) -> list[str]:
    """Why a checkpoint cannot be held as `quant` (one line per kind of stored weight that does not fit)."""
    if quant is None:
        return []
    need = "F8_E4M3" if quant == "fp8" else ("F8_E4M3", "INT4")
    bad = [s for s in checked.sources if (s.target.fp8 if quant == "fp8" else s.target.int4) and s.dtype not in need]
    held_block = FORMATS["fp8"].block
    if quant == "fp8" and tuple(checked.block) != held_block and any(x.dtype == "F8_E4M3" for x in checked.sources):
        return [f"quant='fp8' holds {held_block[0]}x{held_block[1]} blocks (k2jax.quant_policy); this checkpoint's "
                f"weight_block_size is {list(checked.block)}: load with quant=None"]
    if not bad:
        return []
    s = bad[0]
    kind = ("keeps the FP8 (e4m3) weights of a release like Kimi-K2-Instruct" if quant == "fp8" else
            "keeps INT4 routed experts as stored (Kimi-K2-Thinking) or requantizes an FP8 release's")
    return [f"quant={quant!r} {kind}, but {len(bad)} of them are stored as {s.dtype}, e.g. {s.stored!r} "
            f"({ckpt.file_of(s.stored)}): load with quant=None (and quantize the params yourself if you want "
            f"that, k2jax.quantize_params)"]
