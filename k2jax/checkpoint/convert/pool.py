"""The pool: reads and conversions in flight together. READERS threads read the source tensors' pieces in file
order, ahead of the converting threads, into buffers lent out of a budget of READ_AHEAD_BYTES; `workers`
threads convert each piece and write its chunks. So the disk always has reads and writes queued, as `cp` keeps
it busy, while each thread waits on one request at a time (O_DIRECT: no page cache to read ahead or write
behind for us). Each unit is marked done as its last tensor lands.

Memory: the read-ahead budget (or one piece, if bigger), plus per converting thread its buffers (`memory_bound`).
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import queue
import threading

from tqdm import tqdm

from k2jax.checkpoint.convert.codec import PIECE_BYTES, Loaded, TensorConverter
from k2jax.checkpoint.convert.destination import mark_done, unit_of
from k2jax.checkpoint.convert.errors import ConvertError, first_line
from k2jax.checkpoint.hf_validate import Source
from k2jax.checkpoint.safetensors_io import Checkpoint, Scratch, aligned_empty

READERS = 2  # reads in flight (each thread waits on one)
# Converting threads by default. Each mostly waits on its write, but on a 2-CPU host 4 threads converted as
# fast as 8 (interleaved runs) with half the buffers.
WORKERS = min(8, 2 * (os.cpu_count() or 1))
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
    while they fit the budget (a fresh buffer's pages fault in on first touch). Thread-safe: `lend` waits for
    buffers to come back, unless `stop` is set (then it returns None)."""

    def __init__(self, budget: int, stop: threading.Event):
        self.budget, self.stop, self.lent, self.free = budget, stop, 0, []
        self.cv = threading.Condition()

    def lend(self, nbytes: int):
        with self.cv:
            while self.lent and self.lent + nbytes > self.budget:
                if self.stop.is_set():
                    return None
                self.cv.wait(0.5)
            fits = [i for i, b in enumerate(self.free) if b.nbytes >= nbytes]
            buf = self.free.pop(min(fits, key=lambda i: self.free[i].nbytes)) if fits else None
            self.lent += nbytes if buf is None else buf.nbytes
        if buf is None:
            buf = aligned_empty(nbytes)
            with self.cv:
                self.lent += buf.nbytes - nbytes
        return buf

    def take_back(self, buf) -> None:
        with self.cv:
            self.lent -= buf.nbytes
            self.free.append(buf)
            while self.free and self.lent + sum(b.nbytes for b in self.free) > self.budget:
                self.free.pop(max(range(len(self.free)), key=lambda i: self.free[i].nbytes))
            self.cv.notify_all()


def run_pool(conv: TensorConverter, ckpt: Checkpoint, sources: list[Source], dst, workers: int, quiet: bool,
             stats) -> list[str]:
    """Convert `sources` (their pieces read on READERS threads, converted and written on `workers` threads);
    -> the problems found in the data. A unit is marked done in DST once all of its tensors converted without a
    problem; `stats` (convert.job.Stats) counts tensors, bytes and units. An I/O error stops everything
    (ConvertError naming the tensor and file).

    A reader hands each piece it read straight to the converting threads, and a converting thread gives its
    buffer back as it finishes: the pipeline runs without this thread, which only keeps the books (units done,
    progress) from the results queue."""
    nbytes = {id(s): ckpt.tensors[s.stored].nbytes + (ckpt.tensors[s.scale].nbytes if s.scale else 0)
              for s in sources}
    pending: dict[str, int] = {}
    for s in sources:
        pending[unit_of(s)] = pending.get(unit_of(s), 0) + 1
    plan = {id(s): conv.pieces(s) for s in sources}
    todo = [p for s in sources for p in plan[id(s)]]
    left = {k: len(v) for k, v in plan.items()}  # pieces not converted yet, per tensor
    bad = dict.fromkeys(plan, 0)
    problems, failed_units = [], set()
    stop = threading.Event()
    buffers = _Buffers(READ_AHEAD_BYTES, stop)
    results: queue.Queue = queue.Queue()
    pieces, take = iter(todo), threading.Lock()

    def convert(loaded: Loaded, buf) -> None:
        try:
            results.put((loaded.piece, None if stop.is_set() else conv.convert(loaded), None))
        except BaseException as e:  # noqa: BLE001 - raised by the bookkeeping thread
            results.put((loaded.piece, None, e))
        finally:
            buffers.take_back(buf)

    def read() -> None:
        while not stop.is_set():
            with take:
                piece = next(pieces, None)
            if piece is None:
                return
            buf = buffers.lend(conv.read_size(piece))
            if buf is None:
                return
            try:
                loaded = conv.read(piece, buf)
            except BaseException as e:  # noqa: BLE001 - raised by the bookkeeping thread
                buffers.take_back(buf)
                results.put((piece, None, e))
                return
            converters.submit(convert, loaded, buf)

    bar = tqdm(total=sum(nbytes.values()), unit="B", unit_scale=True, unit_divisor=1024, disable=quiet,
               desc="convert", smoothing=0.1, dynamic_ncols=True)
    converters = cf.ThreadPoolExecutor(workers, thread_name_prefix="k2jax-convert")
    readers = [threading.Thread(target=read, name=f"k2jax-read-{i}", daemon=True) for i in range(READERS)]
    try:
        with bar:
            for r in readers:
                r.start()
            for _ in range(len(todo)):
                while True:
                    try:
                        piece, n, error = results.get(timeout=1.0)
                        break
                    except queue.Empty:
                        continue
                s = piece.source
                if error is not None:
                    if isinstance(error, Exception):
                        raise ConvertError(f"{s.stored!r} ({ckpt.file_of(s.stored)}): {type(error).__name__}: "
                                           f"{first_line(error)}") from None
                    raise error
                bad[id(s)] += n
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
    finally:
        stop.set()
        for r in readers:
            r.join()
        converters.shutdown(wait=True, cancel_futures=True)
    return problems
