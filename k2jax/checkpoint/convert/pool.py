"""The pool: reads and conversions in flight together. READERS threads read the source tensors' pieces in file
order, ahead of the converting threads, into buffers lent out of a budget of READ_AHEAD_BYTES; `workers`
threads convert each piece and write its chunks. So the disk always has reads and writes queued, as `cp` keeps
it busy, while each thread waits on one request at a time (O_DIRECT: no page cache to read ahead or write
behind for us). Each unit is marked done as its last tensor lands.

Memory: the read-ahead budget (or one piece, if bigger), plus per converting thread its buffers (`memory_bound`).
"""

from __future__ import annotations

import concurrent.futures as cf

from tqdm import tqdm

from k2jax.checkpoint.convert.codec import PIECE_BYTES, Piece, TensorConverter
from k2jax.checkpoint.convert.destination import mark_done, unit_of
from k2jax.checkpoint.convert.errors import ConvertError, first_line
from k2jax.checkpoint.hf_validate import Source
from k2jax.checkpoint.safetensors_io import Checkpoint, Scratch, aligned_empty

READERS = 2  # reads in flight (each thread waits on one)
READ_AHEAD_BYTES = 128 << 20  # pieces read and not yet converted, at most (or one piece, if bigger)
BUFFERS_PER_WORKER = 4  # a converting thread's: misaligned input copied, XLA's result, output, a chunk's copy


def memory_bound(workers: int) -> tuple[int, str]:
    """(bytes, how) the conversion's buffers stay within, whatever the file sizes: the read-ahead and each
    converting thread's buffers, each at most a piece (PIECE_BYTES of output) or a kept scratch buffer; a
    tensor that cannot be split (not a plain 2-D slot) counts as one piece."""
    per = max(PIECE_BYTES, Scratch.KEEP_BYTES)
    return (READ_AHEAD_BYTES + workers * BUFFERS_PER_WORKER * per,
            f"{READ_AHEAD_BYTES >> 20} MiB read ahead + {workers} threads x {BUFFERS_PER_WORKER} buffers (input, "
            f"XLA's result, output, a chunk) of at most {per >> 20} MiB or one unsplittable tensor")


class _Buffers:
    """Aligned read buffers lent out up to a byte budget (one is always lent, whatever its size), kept for reuse
    while they fit the budget (a fresh buffer's pages fault in on first touch). Used from one thread."""

    def __init__(self, budget: int):
        self.budget, self.lent, self.free = budget, 0, []

    def can_lend(self, nbytes: int) -> bool:
        return self.lent == 0 or self.lent + nbytes <= self.budget

    def lend(self, nbytes: int):
        fits = [i for i, b in enumerate(self.free) if b.nbytes >= nbytes]
        buf = self.free.pop(min(fits, key=lambda i: self.free[i].nbytes)) if fits else aligned_empty(nbytes)
        self.lent += buf.nbytes
        return buf

    def take_back(self, buf) -> None:
        self.lent -= buf.nbytes
        self.free.append(buf)
        while self.free and self.lent + sum(b.nbytes for b in self.free) > self.budget:
            self.free.pop(max(range(len(self.free)), key=lambda i: self.free[i].nbytes))


def run_pool(conv: TensorConverter, ckpt: Checkpoint, sources: list[Source], dst, workers: int, quiet: bool,
             stats) -> list[str]:
    """Convert `sources` (their pieces read on READERS threads, converted and written on `workers` threads);
    -> the problems found in the data. A unit is marked done in DST once all of its tensors converted without a
    problem; `stats` (convert.job.Stats) counts tensors, bytes and units. An I/O error stops everything
    (ConvertError naming the tensor and file)."""
    nbytes = {id(s): ckpt.tensors[s.stored].nbytes + (ckpt.tensors[s.scale].nbytes if s.scale else 0)
              for s in sources}
    pending: dict[str, int] = {}
    for s in sources:
        pending[unit_of(s)] = pending.get(unit_of(s), 0) + 1
    plan = {id(s): conv.pieces(s) for s in sources}
    pieces = iter([p for s in sources for p in plan[id(s)]])
    left = {k: len(v) for k, v in plan.items()}  # pieces not converted yet, per tensor
    bad = dict.fromkeys(plan, 0)
    problems, failed_units = [], set()
    buffers = _Buffers(READ_AHEAD_BYTES)
    bar = tqdm(total=sum(nbytes.values()), unit="B", unit_scale=True, unit_divisor=1024, disable=quiet,
               desc="convert", smoothing=0.1, dynamic_ncols=True)
    with cf.ThreadPoolExecutor(READERS, thread_name_prefix="k2jax-read") as readers, \
            cf.ThreadPoolExecutor(workers, thread_name_prefix="k2jax-convert") as converters, bar:
        reading: dict[cf.Future, tuple[Piece, object]] = {}
        converting: dict[cf.Future, tuple[Piece, object]] = {}
        nxt = next(pieces, None)
        try:
            while True:
                while nxt is not None and len(reading) < 2 * READERS and \
                        buffers.can_lend(size := conv.read_size(nxt)):
                    buf = buffers.lend(size)
                    reading[readers.submit(conv.read, nxt, buf)] = (nxt, buf)
                    nxt = next(pieces, None)
                if not reading and not converting:
                    break
                finished, _ = cf.wait([*reading, *converting], return_when=cf.FIRST_COMPLETED)
                for f in finished:
                    if f in reading:
                        piece, buf = reading.pop(f)
                        loaded = _result(f, piece, ckpt)
                        converting[converters.submit(conv.convert, loaded)] = (piece, buf)
                        continue
                    piece, buf = converting.pop(f)
                    buffers.take_back(buf)
                    s = piece.source
                    bad[id(s)] += _result(f, piece, ckpt)
                    left[id(s)] -= 1
                    if left[id(s)]:
                        continue
                    unit = unit_of(s)
                    if bad[id(s)]:
                        problems.append(conv.problem(s, bad[id(s)]))
                        failed_units.add(unit)
                    stats.tensors += 1
                    stats.bytes_read += nbytes[id(s)]
                    bar.update(nbytes[id(s)])
                    pending[unit] -= 1
                    if pending[unit] == 0 and unit not in failed_units:
                        mark_done(dst, unit)
                        stats.units_converted += 1
        except BaseException:
            for f in [*reading, *converting]:
                f.cancel()
            raise
    return problems


def _result(f: cf.Future, piece: Piece, ckpt: Checkpoint):
    try:
        return f.result()
    except Exception as e:  # I/O: nothing sensible to continue with
        s = piece.source
        raise ConvertError(f"{s.stored!r} ({ckpt.file_of(s.stored)}): {type(e).__name__}: {first_line(e)}") \
            from None
