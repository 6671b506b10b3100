"""`load_hf`: a HuggingFace checkpoint directory (the release layout, FP8, INT4 or plain; Kimi-K2.5's text model
under `language_model.` too) into k2jax params in memory. For small models; the streaming converter
(k2jax.checkpoint.convert) handles the 1T one."""

from __future__ import annotations

import logging
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from k2jax.checkpoint import int4 as int4_format
from k2jax.checkpoint.fp8 import dequantize_fp8_blocks
from k2jax.checkpoint.hf_source import config_from, open_source, safetensors_files
from k2jax.checkpoint.hf_validate import Source, check_checkpoint, quant_problems, raise_problems, text_prefix
from k2jax.checkpoint.safetensors_io import Checkpoint
from k2jax.config import K2Config
from k2jax.nn.model import abstract_params
from k2jax.ops.quant import QuantizedWeight, is_quantized, quantize_weight
from k2jax.quant_policy import FORMATS, check_quant

log = logging.getLogger("k2jax.checkpoint")


def load_hf(path: str | os.PathLike, dtype=None, quant: str | None = None,
            revision: str | None = None) -> tuple[K2Config, dict[str, Any]]:
    """Load a HuggingFace DeepSeek-V3 / Kimi K2 checkpoint into k2jax params, in memory: a local directory, a
    gs:// URL (tensors read in ranges, nothing downloaded whole) or a Hugging Face repo id (at `revision`,
    downloaded into the HF cache; see k2jax.checkpoint.hf_source).

    Returns (cfg, params) with params exactly the tree, shapes and dtypes of `abstract_params(cfg, dtype,
    quant)` as jax arrays. dtype None keeps the checkpoint's own float dtype (bf16 for the FP8 and INT4
    releases). All problems are reported in one ValueError before any weight is read. A Kimi-K2.5 / K2.6
    checkpoint (config.json's `text_config`, tensors under `language_model.`) loads its text model; its vision
    tower and projector are skipped with one log line and never read.

    quant: what the device holds of the quantized weights (k2jax.quant_policy).
      None    every weight dequantized (float32 products, one rounding) to dtype;
      "fp8"   an FP8 release's (Kimi-K2-Instruct) e4m3 block weights kept as `QuantizedWeight(fmt="fp8")`
              leaves, transposed into k2jax's layout with their scales;
      "int4"  the routed experts as `QuantizedWeight(fmt="int4")`: a pack-quantized release's (Kimi-K2-Thinking,
              K2.5) 4-bit values as stored; an FP8 release's experts requantized to INT4 groups of 32 (lossy:
              a second rounding on top of FP8's). Everything else dequantized to dtype.
    A plain float checkpoint with quant "fp8" or "int4" is refused (nothing there to keep): load it with
    quant=None and quantize the tree (k2jax.quantize_params) if that is what you want.
    """
    files, raw = open_source(path, revision)
    cfg = config_from(raw, files.name("config.json"))
    check_quant(quant)
    files.fetch(safetensors_files(files))
    with Checkpoint(files) as ckpt:
        checked = check_checkpoint(cfg, ckpt, prefix=text_prefix(raw))
        raise_problems(checked.problems + quant_problems(checked, quant, ckpt), f"checkpoint {files}")
        if note := checked.vision_note(path):
            log.warning(note)
        dtype = checked.float_dtype() if dtype is None else jnp.dtype(dtype)
        leaves = traverse_util.flatten_dict(abstract_params(cfg, dtype, quant=quant))
        # One preallocated array per (stacked) leaf, filled slot by slot: no list-then-stack copy.
        bufs = {k: (np.empty(v.values.shape, v.values.dtype), np.empty(v.scales.shape, v.scales.dtype))
                if is_quantized(v) else np.empty(v.shape, v.dtype) for k, v in leaves.items()}
        for src in checked.sources:
            t = src.target
            buf = bufs[t.leaf]
            slot = leaves[t.leaf].shape[len(t.index):]
            if isinstance(buf, tuple):
                buf[0][t.index], buf[1][t.index] = read_quantized(ckpt, src, checked.block, slot, leaves[t.leaf])
            else:
                buf[t.index] = t.transform.forward(read_dequantized(ckpt, src, checked.block), slot)
    flat = {k: QuantizedWeight(jnp.asarray(b[0]), jnp.asarray(b[1]), leaves[k].fmt, leaves[k].in_ndim)
            if isinstance(b, tuple) else jnp.asarray(b) for k, b in bufs.items()}
    return cfg, jax.device_put(traverse_util.unflatten_dict(flat))


def read_dequantized(ckpt: Checkpoint, src: Source, block) -> np.ndarray:
    """One source weight in its HF layout as float32 (FP8 and INT4 dequantized), or as stored if plain."""
    if src.dtype == "INT4":
        return int4_format.dequantize_packed_int4(ckpt.read(src.packed), ckpt.read(src.scale))
    x = ckpt.read(src.target.name)
    if src.scale is not None:
        x = dequantize_fp8_blocks(x, ckpt.read(src.scale), block, np.float32)
    return x


def read_quantized(ckpt: Checkpoint, src: Source, block, slot, held: QuantizedWeight) -> tuple[np.ndarray, np.ndarray]:
    """One source weight as a slot of the QuantizedWeight `held` (values [*slot] or packed [*slot[:-1], out/2],
    scales), in k2jax layout: FP8 / INT4 as stored (only moved), or an FP8 weight requantized to INT4."""
    t = src.target
    if src.dtype == "INT4":
        v, s = int4_format.to_k2jax(ckpt.read(src.packed), ckpt.read(src.scale))
        return v.reshape(held.values.shape[len(t.index):]), s
    if held.fmt == "fp8":
        if tuple(block) != FORMATS["fp8"].block:
            raise ValueError(f"{t.name!r}: quant='fp8' holds {FORMATS['fp8'].block} blocks, the checkpoint has "
                             f"{list(block)}")
        return t.transform.forward(ckpt.read(t.name), slot), np.ascontiguousarray(ckpt.read(src.scale).astype(np.float32).T)
    w = t.transform.forward(read_dequantized(ckpt, src, block).astype(np.float32), slot)  # INT4 from FP8
    r = quantize_weight(w, "int4", held.in_ndim)
    return np.asarray(r.values), np.asarray(r.scales)
