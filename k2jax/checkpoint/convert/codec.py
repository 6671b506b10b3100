"""Per-tensor work: read one HF tensor, check its data, dequantize it or keep it quantized, re-layout it into
k2jax's einsum layout, and write it into its (layer, expert) slot of the stacked array.

Speed: the CPU is the limit, not the disk. The FP8 weights are dequantized and transposed in cache-friendly
passes (fp8.dequantize_fp8_transposed), fresh memory is avoided (each fresh page is a fault: buffers are reused
per thread), and a big tensor goes in pieces of whole chunks (rows of the source), so its buffers are reused
like everyone else's.
"""

from __future__ import annotations

import math

import numpy as np

from k2jax.checkpoint import int4 as int4_format
from k2jax.checkpoint.chunk_writer import ChunkWriter, open_array
from k2jax.checkpoint.fp8 import count_nonfinite, dequantize_fp8_blocks, dequantize_fp8_transposed, transpose
from k2jax.checkpoint.hf_validate import Source
from k2jax.checkpoint.names import Relayout, slot_shape
from k2jax.checkpoint.orbax_layout import CONVERSIONS, DTYPES, leaf_name
from k2jax.checkpoint.safetensors_io import Checkpoint, Scratch
from k2jax.config import K2Config
from k2jax.quant_policy import quantized_layout

PIECE_BYTES = 64 << 20  # a big tensor is converted in pieces of about this much output (whole chunks)


class TensorConverter:
    """Converts one source tensor per call (thread-safe: each thread has its own buffers), into the arrays
    `leaves` (stored name -> spec, see orbax_layout.leaf_specs) of a `dtype` conversion at `dst`."""

    def __init__(self, cfg: K2Config, ckpt: Checkpoint, dst, dtype: str, block, leaves: dict,
                 direct: bool):
        self.cfg, self.ckpt, self.block, self.leaves = cfg, ckpt, tuple(block), leaves
        self.quant = CONVERSIONS[dtype][1]
        for n, spec in leaves.items():
            open_array(dst, n, spec, create=True)
        self.writer = ChunkWriter(dst, leaves, direct)
        self.scratch = Scratch()
        self.leaf_dtype = {n: DTYPES[s["dtype"]] for n, s in leaves.items()}

    def held(self, src: Source) -> bool:
        """Whether this conversion stores the tensor's param quantized (as QuantizedWeight values and scales)."""
        return self.quant is not None and quantized_layout(src.target.leaf, self.quant) is not None

    def __call__(self, src: Source) -> str | None:
        """Convert one tensor; -> a problem found in its data (nothing written, or for a tensor in pieces
        nothing after the piece it is in; its unit is not marked done either way), or None."""
        t, ckpt = src.target, self.ckpt
        name, held = leaf_name(t.leaf), self.held(src)
        values = name + ".values" if held else name
        if src.dtype == "INT4":  # pack-quantized (values 0..15 cannot be NaN; the scales were checked)
            packed, scale = ckpt.read(src.packed), ckpt.read(src.scale)
            if held:  # as stored: the same 4-bit values, repacked along the output dim
                v, s = int4_format.to_k2jax(packed, scale)
                self.writer.write(values, t.index, v, self.scratch)
                self.writer.write(name + ".scales", t.index, s, self.scratch)
            else:
                x = int4_format.dequantize_packed_int4(packed, scale, self.leaf_dtype[name])
                self.writer.write(name, t.index, transpose(x), self.scratch)
            return None
        shape = ckpt.tensors[t.name].shape
        slot = slot_shape(t, self.cfg)
        transposed = t.transform.forward is Relayout.TRANSPOSE.forward and len(shape) == 2  # all of the TRANSPOSE_*
        scale = None if src.scale is None else ckpt.read(src.scale)
        dequantize = scale is not None and not held
        pieces = self._pieces(values, shape, slot, transposed, dequantize)
        bad = 0
        for rows in pieces:
            n, x = self._convert_rows(src, values, rows, transposed, scale if dequantize else None)
            bad += n
            if not bad:
                whole = len(pieces) == 1
                start = None if whole else (0, rows[0]) if transposed else (rows[0], 0)
                self.writer.write(values, t.index, x.reshape(slot) if whole else x, self.scratch, start)
        if bad:
            return f"{t.name!r} ({ckpt.file_of(t.name)}): {bad} NaN/inf value(s) in the data"
        if held:  # float8: e4m3 as stored, its block scales transposed like the weight
            self.writer.write(name + ".scales", t.index, np.ascontiguousarray(scale.astype(np.float32).T),
                              self.scratch)
        return None

    def _pieces(self, name, shape, slot, transposed, dequantize) -> list[tuple[int, int]]:
        """Row ranges of the source to convert one at a time: about PIECE_BYTES of output each, in whole chunks
        (and whole scale blocks); [(0, rows)] for a tensor that is small or not a plain 2-D slot."""
        rows = shape[0] if shape else 0
        if len(shape) != 2 or tuple(slot) != (tuple(shape[::-1]) if transposed else tuple(shape)) or \
                (dequantize and not transposed):
            return [(0, rows)]
        chunks = self.leaves[name]["chunks"][-2:]
        step = chunks[1] if transposed else chunks[0]  # source rows per chunk
        if dequantize:
            step = math.lcm(step, self.block[0])
        step *= max(1, PIECE_BYTES // (step * shape[1] * self.leaf_dtype[name].itemsize))
        return [(r, min(r + step, rows)) for r in range(0, rows, step)] or [(0, rows)]

    def _convert_rows(self, src, name, rows, transposed, scale) -> tuple[int, np.ndarray]:
        """Source rows [a, b) -> (count of non-finite values, converted: [b - a, ...] or transposed); scale: the
        FP8 block scales to dequantize with, None to keep the stored values."""
        t, ckpt, scratch, dtype = src.target, self.ckpt, self.scratch, self.leaf_dtype[name]
        raw = ckpt.read(t.name, scratch, rows if len(ckpt.tensors[t.name].shape) else None)
        if scale is not None and transposed:  # every FP8 weight, bf16/f32 output
            # as load_hf: products in float32, one rounding to the target dtype; the pass also counts NaN/inf
            if raw.ctypes.data % 64:  # jax copies a misaligned input itself, several times slower than this
                raw = _copy(raw, scratch.array("in", raw.shape, raw.dtype))
            b = self.block[0]
            x, bad = dequantize_fp8_transposed(raw, scale[rows[0] // b:-(-rows[1] // b)], self.block, dtype,
                                               scratch.array("out", raw.shape[::-1], dtype))
            return bad, x
        bad = count_nonfinite(raw)
        if scale is not None:
            raw = dequantize_fp8_blocks(raw, scale, self.block, np.float32)
        raw = raw.astype(dtype, copy=False)
        return bad, transpose(raw, scratch.array("out", raw.shape[::-1], dtype)) if transposed else raw


def _copy(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    np.copyto(out, x)
    return out
