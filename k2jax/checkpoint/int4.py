"""INT4 weights as Kimi-K2-Thinking releases them: compressed-tensors' "pack-quantized" format.

A linear weight w [out, in] is stored as three tensors:

    <weight>_packed  int32 [out, in/8]   eight 4-bit values per int32 along the input dim, each value + 8
                                         (0..15); element k of a word in bits 4k..4k+3 (lowest column lowest)
    <weight>_scale   bf16  [out, in/32]  one scale per output row and group of 32 inputs
    <weight>_shape   int64 [2]           [out, in]

    w[o, i] = (nibble[o, i] - 8) * scale[o, i // 32]

k2jax holds it on device as `k2jax.ops.quant.QuantizedWeight(fmt="int4")` in its einsum layout [in, out]:
the same 4-bit values (value + 8), two per uint8 along the output axis, and the scales transposed
[in/32, out]. `to_k2jax` / `from_k2jax` move between the two by bit shuffling only (nothing is rounded); `pack_words` /
`unpack_words` are the int32 word packing itself.

`check_config` reads config.json's quantization_config and refuses, naming the key, whatever this module
does not implement (other bit widths, asymmetric or dynamic schemes, activation quantization, other formats).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from k2jax.checkpoint.fp8 import transpose
from k2jax.ops.quant import quantize_weight
from k2jax.quant_policy import FORMATS

GROUP = FORMATS["int4"].block[0]  # inputs per scale (k2jax.quant_policy)
BITS = 4
PER_WORD = 32 // BITS  # values per int32
BF16 = np.dtype(ml_dtypes.bfloat16)
FORMAT = "pack-quantized"
QUANT_METHOD = "compressed-tensors"


def quantization_config(group_size: int = GROUP) -> dict[str, Any]:
    """The quantization_config of Kimi-K2-Thinking's config.json (what save_hf(int4=True) writes)."""
    return {
        "quant_method": QUANT_METHOD, "format": FORMAT,
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": BITS, "type": "int", "symmetric": True, "strategy": "group",
                        "group_size": group_size, "dynamic": False, "actorder": None, "block_structure": None,
                        "observer": "minmax", "observer_kwargs": {}},
            "input_activations": None, "output_activations": None, "format": FORMAT}},
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
        "kv_cache_scheme": None, "quantization_status": "compressed", "sparsity_config": {},
    }


def check_config(qc: dict | None) -> tuple[str | None, list[str]]:
    """config.json's quantization_config -> (format: None | "fp8" | "int4", problems naming each key)."""
    if qc is None:
        return None, []
    where = "config.json: quantization_config"
    if not isinstance(qc, dict):
        return None, [f"{where} must be an object, got {qc!r}"]
    method = qc.get("quant_method")
    if method == "fp8":
        if qc.get("fmt", "e4m3") != "e4m3":
            return None, [f"{where}.fmt {qc['fmt']!r}: only 'e4m3' FP8 is implemented"]
        if qc.get("activation_scheme", "dynamic") != "dynamic":
            return None, [f"{where}.activation_scheme {qc['activation_scheme']!r}: only 'dynamic' (weights-only "
                          f"FP8, activations computed in bf16) is implemented"]
        return "fp8", []
    if method != QUANT_METHOD:
        return None, [f"{where}.quant_method {method!r}: unknown (implemented: 'fp8' as Kimi-K2-Instruct, "
                      f"{QUANT_METHOD!r} {FORMAT!r} as Kimi-K2-Thinking)"]
    problems = []
    if qc.get("format") != FORMAT:
        problems.append(f"{where}.format {qc.get('format')!r}: unknown ({QUANT_METHOD} is implemented in the "
                        f"{FORMAT!r} format only)")
    if qc.get("quantization_status", "compressed") != "compressed":
        problems.append(f"{where}.quantization_status {qc['quantization_status']!r}: only 'compressed' "
                        f"checkpoints are implemented")
    if qc.get("kv_cache_scheme") is not None:
        problems.append(f"{where}.kv_cache_scheme: KV cache quantization is not implemented")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        problems.append(f"{where}.config_groups: expected one or more groups, got {groups!r}")
        groups = {}
    for gname, g in groups.items():
        key = f"{where}.config_groups.{gname}"
        if not isinstance(g, dict):
            problems.append(f"{key} must be an object")
            continue
        if g.get("format", FORMAT) not in (FORMAT, None):
            problems.append(f"{key}.format {g['format']!r}: unknown (only {FORMAT!r})")
        for act in ("input_activations", "output_activations"):
            if g.get(act) is not None:
                problems.append(f"{key}.{act}: activation quantization is not implemented (weights only)")
        w = g.get("weights")
        if not isinstance(w, dict):
            problems.append(f"{key}.weights: expected an object, got {w!r}")
            continue
        for k, want in (("num_bits", BITS), ("type", "int"), ("symmetric", True), ("strategy", "group"),
                        ("group_size", GROUP), ("dynamic", False), ("actorder", None)):
            if w.get(k, want if k == "actorder" else None) != want:
                problems.append(f"{key}.weights.{k} {w.get(k)!r}: only {want!r} is implemented "
                                f"(symmetric INT4, groups of {GROUP} along the input dim)")
    return ("int4" if not problems else None), problems


def packed_shape(out: int, inn: int) -> tuple[int, int]:
    return (out, inn // PER_WORD)


def scale_shape(out: int, inn: int) -> tuple[int, int]:
    return (out, inn // GROUP)


def unpack_words(packed: np.ndarray) -> np.ndarray:
    """int32 [..., in/8] -> uint8 nibbles [..., in] (value + 8, 0..15), element k from bits 4k..4k+3."""
    b = np.ascontiguousarray(packed).astype("<i4", copy=False).view(np.uint8)  # 4 bytes per word, low first
    return np.stack([b & 0xF, b >> 4], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * PER_WORD)


def pack_words(nibbles: np.ndarray) -> np.ndarray:
    """uint8 nibbles [..., in] (0..15; in a multiple of 8) -> int32 [..., in/8] (inverse of `unpack_words`)."""
    n = np.ascontiguousarray(nibbles, dtype=np.uint8)
    if n.shape[-1] % PER_WORD:
        raise ValueError(f"pack_words: the last dim {n.shape[-1]} is not a multiple of {PER_WORD}")
    pairs = n.reshape(*n.shape[:-1], -1, 2)
    b = (pairs[..., 0] & 0xF) | (pairs[..., 1] << 4)
    return b.reshape(*n.shape[:-1], -1).view("<i4").astype(np.int32, copy=False)


def dequantize_packed_int4(packed: np.ndarray, scale: np.ndarray, dtype=np.float32) -> np.ndarray:
    """The release's INT4 weight -> w [out, in] = (nibble - 8) * scale[o, i // 32], computed in float32 (exact:
    a 4-bit value times a bf16 scale), cast once."""
    q = unpack_words(packed).astype(np.float32) - 8.0
    s = np.repeat(scale.astype(np.float32), GROUP, axis=-1)
    return (q * s).astype(dtype)


def to_k2jax(packed: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """HF (packed int32 [out, in/8], scale [out, in/32]) -> QuantizedWeight's (values uint8 [in, out/2], two
    values per byte along out, low nibble first; scales bf16 [in/32, out]): the same 4-bit values.

    The packed bytes (two inputs each) are transposed as bytes (fp8.transpose), then one XLA loop swaps the
    nibbles of each pair of output rows, contiguous along the output; `to_k2jax_reference` is the plain form."""
    out = packed.shape[0]
    if out % 2:
        raise ValueError(f"INT4 on device packs two values per byte along the output dim: {out} is odd")
    values = np.asarray(_repack_nibbles(transpose(_packed_bytes(packed))))
    return values, transpose(np.ascontiguousarray(scale).astype(BF16, copy=False))


def dequantize_packed_int4_transposed(packed: np.ndarray, scale: np.ndarray, dtype=np.float32) -> np.ndarray:
    """`dequantize_packed_int4(packed, scale, dtype).T`, C-contiguous [in, out], bit for bit: the packed bytes
    and the scales transposed first, then the products in the output's order (contiguous, vectorised)."""
    bt = transpose(_packed_bytes(packed))  # [in/2, out]
    s = transpose(np.ascontiguousarray(scale).astype(BF16, copy=False))  # [in/32, out]
    return np.asarray(_dequantize_transposed(bt, s, np.dtype(dtype)))


def _packed_bytes(packed: np.ndarray) -> np.ndarray:
    """int32 [out, in/8] -> its bytes [out, in/2], each two inputs (the lower one in the low nibble)."""
    return np.ascontiguousarray(packed).astype("<i4", copy=False).view(np.uint8)


@jax.jit
def _repack_nibbles(bt):
    """Bytes [in/2, out] (inputs 2j, 2j+1 per byte) -> [in, out/2] (outputs 2k, 2k+1 per byte)."""
    half, out = bt.shape
    lo, hi = bt[:, 0::2], bt[:, 1::2]  # outputs 2k, 2k+1
    even, odd = (lo & 0xF) | (hi << 4), (lo >> 4) | (hi & 0xF0)  # input 2j, input 2j + 1
    return jnp.stack([even, odd], axis=1).reshape(2 * half, out // 2)


@functools.partial(jax.jit, static_argnums=2)
def _dequantize_transposed(bt, s, dtype):
    """Bytes [in/2, out], bf16 scales [in/32, out] -> (nibble - 8) * scale in float32, cast once: [in, out]."""
    half, out = bt.shape
    q = jnp.stack([bt & 0xF, bt >> 4], axis=1).reshape(2 * half, out).astype(jnp.float32) - 8.0
    w = q.reshape(-1, GROUP, out) * s.astype(jnp.float32)[:, None, :]
    return w.reshape(2 * half, out).astype(dtype)


def to_k2jax_reference(packed: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The plain form of `to_k2jax`."""
    n = unpack_words(packed).T  # [in, out]
    if n.shape[-1] % 2:
        raise ValueError(f"INT4 on device packs two values per byte along the output dim: {n.shape[-1]} is odd")
    pairs = np.ascontiguousarray(n).reshape(n.shape[0], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4), np.ascontiguousarray(scale.astype(BF16).T)


def from_k2jax(values: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of `to_k2jax`: (uint8 [in, out/2], scales [in/32, out]) -> (int32 [out, in/8], bf16 [out, in/32])."""
    v = np.asarray(values, np.uint8)
    n = np.stack([v & 0xF, v >> 4], axis=-1).reshape(v.shape[0], -1)  # [in, out]
    return pack_words(n.T), np.ascontiguousarray(np.asarray(scales).astype(BF16).T)


def quantize_packed_int4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [out, in] -> the release's (packed int32 [out, in/8], bf16 scale [out, in/32]): symmetric absmax per
    group of 32 inputs, through k2jax.ops.quant.quantize_weight (so the file and the device hold one rounding).
    Lossy."""
    qw = quantize_weight(np.asarray(w, np.float32).T, "int4")
    return from_k2jax(np.asarray(qw.values), np.asarray(qw.scales))
