"""Writing checkpoints in the released HuggingFace layout: `save_hf` (given params) and
`write_release_checkpoint` (synthetic random weights of any config, for tests, benchmarks and `k2jax demo`).

Both go through one writer (`write_release`): config.json with the release's quantization_config,
`model-{k}-of-{n}.safetensors` shards cut into contiguous runs of about equal bytes (embeddings first, layer by
layer, norm and lm_head last) and model.safetensors.index.json (or one model.safetensors), the
`rotary_emb.inv_freq` buffers the release carries, and per weight the release's tensors for its format:
  None    each weight as given (save_hf: its param dtype);
  "fp8"   the policy table's FP8 weights as F8_E4M3 + float32 `weight_scale_inv` (Kimi-K2-Instruct), the rest
          bf16 but the router bias (float32);
  "int4"  the routed experts as compressed-tensors pack-quantized INT4 `weight_packed` / `weight_scale` /
          `weight_shape` (Kimi-K2-Thinking), the rest as for "fp8".
It streams: one shard's tensors in memory at a time, so multi-GB synthetic checkpoints cost a shard's memory.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import zlib
from typing import Callable

import ml_dtypes
import numpy as np
from flax import traverse_util

from k2jax.checkpoint import int4 as int4_format
from k2jax.checkpoint import names as hf_names
from k2jax.checkpoint.fp8 import DEFAULT_BLOCK, FP8, quantize_fp8_blocks, scale_shape
from k2jax.checkpoint.safetensors_io import INDEX_NAME, SINGLE_NAME, write_file
from k2jax.config import K2Config
from k2jax.ops.quant import dequantize_weight, is_quantized

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)


def fp8_quantization_config(block=DEFAULT_BLOCK) -> dict:
    """The quantization_config of Kimi-K2-Instruct's config.json (block: its weight_block_size)."""
    return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": list(block)}


def release_config(cfg: K2Config, fmt: str | None, block=DEFAULT_BLOCK, torch_dtype: str = "bfloat16") -> dict:
    """config.json of a release of `cfg` in format `fmt` (the weights' own torch_dtype when fmt is None)."""
    hf = cfg.to_hf_config()
    hf.pop("quantization_config", None)
    if fmt == "fp8":
        hf["quantization_config"] = fp8_quantization_config(block)
    elif fmt == "int4":
        hf["quantization_config"] = int4_format.quantization_config()
    hf["torch_dtype"] = "bfloat16" if fmt else torch_dtype
    return hf


def inv_freq(cfg: K2Config) -> np.ndarray:
    """The `rotary_emb.inv_freq` buffer the release carries in every layer (the loader skips it)."""
    P = cfg.qk_rope_head_dim
    return (1.0 / cfg.rope_theta ** (np.arange(0, P, 2, dtype=np.float32) / P)).astype(np.float32)


def _inv_freq_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.rotary_emb.inv_freq"


def tensor_specs(cfg: K2Config, fmt: str | None, plain_dtype: Callable[[hf_names.Target], np.dtype],
                 block=DEFAULT_BLOCK) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Every tensor of the release layout of `cfg` in format `fmt`: name -> (shape, dtype). plain_dtype: the
    dtype of a weight that `fmt` does not quantize (fmt None: all of them)."""
    out = {_inv_freq_name(i): ((cfg.qk_rope_head_dim // 2,), F32) for i in range(cfg.num_hidden_layers)}
    for name in hf_names.expected_names(cfg):
        t = hf_names.resolve(name, cfg)
        shape = t.transform.source_shape(hf_names.slot_shape(t, cfg))
        if fmt == "int4" and t.int4:
            parts = hf_names.int4_names(name)
            out[parts["packed"]] = (int4_format.packed_shape(*shape), np.dtype(np.int32))
            out[parts["scale"]] = (int4_format.scale_shape(*shape), BF16)
            out[parts["shape"]] = ((2,), np.dtype(np.int64))
        elif fmt == "fp8" and t.fp8:
            out[name] = (shape, FP8)
            out[hf_names.scale_name(name)] = (scale_shape(shape, block), F32)
        else:
            out[name] = (shape, np.dtype(plain_dtype(t)))
    return out


def release_dtype(t: hf_names.Target) -> np.dtype:
    """The dtype the FP8 and INT4 releases store a weight they do not quantize in."""
    return F32 if t.path[-1] == "e_score_correction_bias" else BF16


def encode_weight(t: hf_names.Target, w: np.ndarray, fmt: str | None, plain_dtype,
                  block=DEFAULT_BLOCK) -> dict[str, np.ndarray]:
    """One weight w (HF layout, float) -> its release tensors in format `fmt`: quantized if the policy table has
    `fmt` quantize it (lossy, absmax per block / group), else w cast to `plain_dtype`."""
    if fmt == "int4" and t.int4:
        parts = hf_names.int4_names(t.name)
        packed, scale = int4_format.quantize_packed_int4(w)
        return {parts["packed"]: packed, parts["scale"]: scale, parts["shape"]: np.array(w.shape, np.int64)}
    if fmt == "fp8" and t.fp8:
        q, scale = quantize_fp8_blocks(w, block)
        return {t.name: q, hf_names.scale_name(t.name): scale}
    return {t.name: np.asarray(w).astype(plain_dtype)}


def weight_of(name: str) -> str:
    """The weight a release tensor belongs to (a scale's, a packed part's, or itself)."""
    if hf_names.is_scale(name):
        return hf_names.weight_of_scale(name)
    return hf_names.weight_of_int4(name) if hf_names.int4_part(name) else name


def write_release(path, hf_config: dict, specs: dict[str, tuple[tuple[int, ...], np.dtype]],
                  tensors_of: Callable[[str], dict[str, np.ndarray]], num_shards: int | None) -> pathlib.Path:
    """Write config.json and the tensors `specs` names (name -> (shape, dtype)) as the release lays them out;
    tensors_of(weight) gives all the tensors of one weight (see weight_of), and is called once per weight and
    shard. num_shards None: one model.safetensors, no index. -> the directory."""
    if num_shards is not None and num_shards < 1:
        raise ValueError(f"num_shards must be >= 1 or None, got {num_shards}")
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    nbytes = {n: math.prod(s) * np.dtype(d).itemsize for n, (s, d) in specs.items()}
    total = sum(nbytes.values())
    order = sorted(specs, key=_release_order)
    shards: list[list[str]] = [[] for _ in range(num_shards or 1)]
    acc = 0
    for n in order:  # contiguous runs of roughly equal bytes, like the release's shards
        shards[min(len(shards) - 1, acc * len(shards) // max(total, 1))].append(n)
        acc += nbytes[n]
    weight_map = {}
    for k, names in enumerate(shards, 1):
        fname = SINGLE_NAME if num_shards is None else f"model-{k}-of-{num_shards}.safetensors"
        tensors: dict[str, np.ndarray] = {}
        for w in dict.fromkeys(weight_of(n) for n in names):  # a weight's tensors may fall in two shards
            tensors |= tensors_of(w)
        write_file(path / fname, {n: tensors[n] for n in names}, {"format": "pt"})
        weight_map.update({n: fname for n in names})
        del tensors
    if num_shards is not None:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (path / INDEX_NAME).write_text(json.dumps(index, indent=2))
    (path / "config.json").write_text(json.dumps(hf_config, indent=2))
    return path


# ------------------------------------------------------------------------------------------------------
def save_hf(params, cfg: K2Config, path: str | os.PathLike, fp8: bool = False, num_shards: int | None = 1,
            block=DEFAULT_BLOCK, int4: bool = False) -> pathlib.Path:
    """Write params (the stacked tree, plain or with QuantizedWeight leaves) in the released HF layout (see the
    module docstring); num_shards None: one model.safetensors, no index. -> the directory.

    fp8: Kimi-K2-Instruct's layout (F8_E4M3 blocks of `block`); int4: Kimi-K2-Thinking's (the routed experts
    quantized with absmax groups of 32, or written as held when the params hold them as
    QuantizedWeight(fmt="int4")); neither: each tensor in its param dtype (QuantizedWeight leaves dequantized
    to float32).
    """
    if fp8 and int4:
        raise ValueError("save_hf: fp8 and int4 are two different release layouts; pick one")
    fmt = "fp8" if fp8 else "int4" if int4 else None
    flat = traverse_util.flatten_dict(params)
    plain = {k: np.asarray(dequantize_weight(v, np.float32) if is_quantized(v) else v) for k, v in flat.items()}

    def tensors_of(weight: str) -> dict[str, np.ndarray]:
        if weight.endswith(".inv_freq"):
            return {weight: inv_freq(cfg)}
        t = hf_names.resolve(weight, cfg)
        held = flat[t.leaf]
        if fmt == "int4" and t.int4 and is_quantized(held) and held.fmt == "int4":  # as held: no second rounding
            parts = hf_names.int4_names(weight)
            packed, scale = int4_format.from_k2jax(np.asarray(held.values[t.index]), np.asarray(held.scales[t.index]))
            return {parts["packed"]: packed, parts["scale"]: scale,
                    parts["shape"]: np.array(t.transform.source_shape(held.shape[len(t.index):]), np.int64)}
        w = t.transform.inverse(plain[t.leaf][t.index])
        return encode_weight(t, w, fmt, release_dtype(t) if fmt else w.dtype, block)

    specs = tensor_specs(cfg, fmt, lambda t: release_dtype(t) if fmt else plain[t.leaf].dtype, block)
    torch_dtype = str(plain[("embed_tokens",)].dtype)
    return write_release(path, release_config(cfg, fmt, block, torch_dtype), specs, tensors_of, num_shards)


def write_release_checkpoint(cfg: K2Config | dict | str | os.PathLike, path: str | os.PathLike,
                             num_shards: int | None = None, seed: int = 0, block=DEFAULT_BLOCK,
                             fast: bool = False, shard_bytes: int = 1 << 30) -> pathlib.Path:
    """Write a synthetic FP8 checkpoint of `cfg` (K2Config, HF dict or config.json path) in exactly the layout
    of the Kimi-K2-Instruct release at `path`, nothing downloaded; -> path. num_shards None: about
    `shard_bytes` per shard. Same arguments, same bytes.

    Each weight is drawn from its own seed (seed, name), at scales that keep activations O(1) so the model
    computes something sensible: linear weights ~ N(0, 1/in) (then FP8-quantized), embeddings N(0, 1), norms
    1 + N(0, 0.1), router N(0, 9/in) (the oracle's default), bias U[-0.5, 0.5]. fast: FP8 bytes drawn uniformly
    (NaN patterns excluded) with random scales; for benchmarks only.
    """
    cfg = cfg if isinstance(cfg, K2Config) else K2Config.from_hf_config(cfg)
    block = tuple(block)
    specs = tensor_specs(cfg, "fp8", release_dtype, block)
    if num_shards is None:
        num_shards = max(1, math.ceil(sum(math.prod(s) * d.itemsize for s, d in specs.values()) / shard_bytes))

    def tensors_of(weight: str) -> dict[str, np.ndarray]:
        if weight.endswith(".inv_freq"):
            return {weight: inv_freq(cfg)}
        t = hf_names.resolve(weight, cfg)
        rng = np.random.default_rng([seed, zlib.crc32(weight.encode())])
        shape = t.transform.source_shape(hf_names.slot_shape(t, cfg))
        if t.fp8 and fast:
            q = rng.integers(0, 256, shape, dtype=np.uint8)
            q[(q & 0x7F) == 0x7F] ^= 1  # 0x7F / 0xFF are NaN in e4m3fn
            s = rng.uniform(0.5, 1.5, scale_shape(shape, block)).astype(np.float32) / (64 * math.sqrt(shape[1]))
            return {weight: q.view(FP8), hf_names.scale_name(weight): s}
        return encode_weight(t, _random_weight(t, shape, rng), "fp8", release_dtype(t), block)

    return write_release(path, release_config(cfg, "fp8", block), specs, tensors_of, num_shards)


def _random_weight(t: hf_names.Target, shape, rng) -> np.ndarray:
    """A synthetic float32 weight for `t` at its role's scale (see write_release_checkpoint)."""
    if t.path[-1] == "e_score_correction_bias":
        return rng.uniform(-0.5, 0.5, shape).astype(np.float32)
    if t.path[-1] == "weight" and t.path[0] != "mlp":  # RMSNorm weights
        return 1.0 + 0.1 * rng.standard_normal(shape, np.float32)
    if t.path == ("embed_tokens",):
        return rng.standard_normal(shape, np.float32)
    if t.path[:2] == ("mlp", "gate"):
        return rng.standard_normal(shape, np.float32) * (3.0 / math.sqrt(shape[1]))
    return rng.standard_normal(shape, np.float32) / math.sqrt(shape[1])


def _release_order(name: str):
    """Embedding first, then layer by layer, then norm and lm_head."""
    parts = name.split(".")
    if name.startswith("model.layers."):
        return (1, int(parts[2]), name)
    return (0 if "embed" in name else 2, 0, name)
