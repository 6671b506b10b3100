"""Per-tensor work, in two steps the pool runs on different threads: `read` one piece of an HF tensor (all of a
small one, rows of whole chunks of a big one) into a buffer the pool lends; `convert` it: check its data,
dequantize it or keep it quantized, re-layout it into k2jax's einsum layout, and write it into its (layer,
expert) slot of the stacked array.

Speed: the transposes move whole cache lines (fp8.transpose, fp8.dequantize_fp8_transposed), fresh memory is
avoided (each fresh page is a fault: buffers are reused per thread, and the pool reuses its read buffers), and
a big tensor goes in pieces of whole chunks, so its buffers are reused like everyone else's.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from k2jax.checkpoint import int4 as int4_format
from k2jax.checkpoint.chunk_writer import ChunkWriter, open_array
from k2jax.checkpoint.fp8 import count_nonfinite, dequantize_fp8_blocks, dequantize_fp8_transposed, transpose
from k2jax.checkpoint.hf_validate import Source
from k2jax.checkpoint.names import Relayout, slot_shape
from k2jax.checkpoint.orbax_layout import CONVERSIONS, DTYPES, leaf_name
from k2jax.checkpoint.safetensors_io import Checkpoint, Lent, Scratch
from k2jax.config import K2Config
from k2jax.quant_policy import quantized_layout

PIECE_BYTES = 64 << 20  # a big tensor is converted in pieces of about this much output (whole chunks)


class Piece(NamedTuple):
    """Rows [a, b) of a source tensor's stored data (None: all of it), converted and written on their own."""

    source: Source
    rows: tuple[int, int] | None
    last: bool  # the tensor's last piece (a float8 conversion writes the scales with it)


class Loaded(NamedTuple):
    """A piece as read: its data (a view of the lent buffer), and the scales it is converted with."""

    piece: Piece
    raw: np.ndarray
    scale: np.ndarray | None


class TensorConverter:
    """Reads and converts the pieces of source tensors into the arrays `leaves` (stored name -> spec, see
    orbax_layout.leaf_specs) of a `dtype` conversion at `dst`; thread-safe (each converting thread has its own
    buffers, each read fills the buffer it is given)."""

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

    def pieces(self, src: Source) -> list[Piece]:
        """The pieces `src` is read and converted in (one, unless it is big: see `_pieces`)."""
        if src.dtype == "INT4":
            return [Piece(src, None, True)]
        t = src.target
        shape = self.ckpt.tensors[t.name].shape
        name = leaf_name(t.leaf) + (".values" if self.held(src) else "")
        dequantize = src.scale is not None and not self.held(src)
        rows = self._pieces(name, shape, slot_shape(t, self.cfg), self._transposed(src, shape), dequantize)
        return [Piece(src, r if shape else None, k == len(rows) - 1) for k, r in enumerate(rows)]

    def read_size(self, piece: Piece) -> int:
        """Bytes of the buffer `read(piece, buf)` needs."""
        src = piece.source
        return self.ckpt.read_size(src.packed) if src.dtype == "INT4" else \
            self.ckpt.read_size(src.target.name, piece.rows)

    def read(self, piece: Piece, buf: np.ndarray) -> Loaded:
        """Read a piece's data into `buf` (aligned uint8 of at least read_size(piece) bytes), and its scales."""
        src = piece.source
        name = src.packed if src.dtype == "INT4" else src.target.name
        raw = self.ckpt.read(name, Lent(buf), piece.rows)
        return Loaded(piece, raw, None if src.scale is None else self.ckpt.read(src.scale))

    def convert(self, loaded: Loaded) -> int:
        """Convert and write a piece read by `read`; -> the count of NaN/inf values in its data (nothing of the
        piece written then, and its unit never marked done: see `problem`)."""
        (src, rows, last), raw, scale = loaded
        t = src.target
        name, held = leaf_name(t.leaf), self.held(src)
        values = name + ".values" if held else name
        if src.dtype == "INT4":  # pack-quantized (values 0..15 cannot be NaN; the scales were checked)
            if held:  # as stored: the same 4-bit values, repacked along the output dim
                v, s = int4_format.to_k2jax(raw, scale)
                self.writer.write(values, t.index, v, self.scratch)
                self.writer.write(name + ".scales", t.index, s, self.scratch)
            else:
                x = int4_format.dequantize_packed_int4_transposed(raw, scale, self.leaf_dtype[name])
                self.writer.write(name, t.index, x, self.scratch)
            return 0
        shape = self.ckpt.tensors[t.name].shape
        transposed, dequantize = self._transposed(src, shape), scale is not None and not held
        bad, x = self._convert_rows(src, values, raw, rows, transposed, scale if dequantize else None)
        if bad:
            return bad
        whole = rows is None or rows == (0, shape[0])
        start = None if whole else (0, rows[0]) if transposed else (rows[0], 0)
        self.writer.write(values, t.index, x.reshape(slot_shape(t, self.cfg)) if whole else x, self.scratch, start)
        if held and last:  # float8: e4m3 as stored, its block scales transposed like the weight
            self.writer.write(name + ".scales", t.index, np.ascontiguousarray(scale.astype(np.float32).T),
                              self.scratch)
        return 0

    def problem(self, src: Source, bad: int) -> str:
        """The message for `bad` NaN/inf values found in a tensor's data."""
        return f"{src.target.name!r} ({self.ckpt.file_of(src.stored)}): {bad} NaN/inf value(s) in the data"

    @staticmethod
    def _transposed(src: Source, shape) -> bool:
        return src.target.transform.forward is Relayout.TRANSPOSE.forward and len(shape) == 2  # the TRANSPOSE_*

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

    def _convert_rows(self, src, name, raw, rows, transposed, scale) -> tuple[int, np.ndarray]:
        """Source rows [a, b) as read (raw) -> (count of non-finite values, converted: [b - a, ...] or
        transposed); scale: the FP8 block scales to dequantize with, None to keep the stored values."""
        scratch, dtype = self.scratch, self.leaf_dtype[name]
        if scale is not None and transposed:  # every FP8 weight, bf16/f32 output
            # as load_hf: products in float32, one rounding to the target dtype; the pass also counts NaN/inf
            b = self.block[0]
            x, bad = dequantize_fp8_transposed(raw, scale[rows[0] // b:-(-rows[1] // b)], self.block, dtype,
                                               scratch.array("out", raw.shape[::-1], dtype),
                                               scratch.array("in", raw.shape[::-1], np.uint8))
            return bad, x
        bad = count_nonfinite(raw)
        if scale is not None:
            raw = dequantize_fp8_blocks(raw, scale, self.block, np.float32)
        raw = raw.astype(dtype, copy=False)
        return bad, transpose(raw, scratch.array("out", raw.shape[::-1], dtype)) if transposed else raw

