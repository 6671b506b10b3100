"""The worker pool: source tensors converted on N threads (a worker waits for the disk in between, so twice the
CPUs by default), at most 2 x workers in flight, each unit marked done as its last tensor lands."""

from __future__ import annotations

import concurrent.futures as cf
from typing import Callable

from tqdm import tqdm

from k2jax.checkpoint.convert.destination import mark_done, unit_of
from k2jax.checkpoint.convert.errors import ConvertError, first_line
from k2jax.checkpoint.hf_validate import Source
from k2jax.checkpoint.safetensors_io import Checkpoint


def run_pool(convert_one: Callable[[Source], str | None], ckpt: Checkpoint, sources: list[Source], dst,
             workers: int, quiet: bool, stats) -> list[str]:
    """Convert `sources` (convert_one(source) -> a problem or None) on `workers` threads; -> the problems found
    in the data. A unit is marked done in DST once all of its tensors converted without a problem; `stats`
    (convert.job.Stats) counts tensors, bytes and units. An I/O error stops everything (ConvertError)."""
    nbytes = {id(s): ckpt.tensors[s.stored].nbytes + (ckpt.tensors[s.scale].nbytes if s.scale else 0)
              for s in sources}
    pending: dict[str, int] = {}
    for s in sources:
        pending[unit_of(s)] = pending.get(unit_of(s), 0) + 1
    problems, failed_units = [], set()
    bar = tqdm(total=sum(nbytes.values()), unit="B", unit_scale=True, unit_divisor=1024, disable=quiet,
               desc="convert", smoothing=0.1, dynamic_ncols=True)
    it = iter(sources)
    with cf.ThreadPoolExecutor(workers, thread_name_prefix="k2jax-convert") as pool, bar:
        inflight: dict[cf.Future, Source] = {}
        try:
            while True:
                while len(inflight) < 2 * workers and (s := next(it, None)) is not None:
                    inflight[pool.submit(convert_one, s)] = s
                if not inflight:
                    break
                finished, _ = cf.wait(inflight, return_when=cf.FIRST_COMPLETED)
                for f in finished:
                    s = inflight.pop(f)
                    unit = unit_of(s)
                    try:
                        problem = f.result()
                    except Exception as e:  # I/O: nothing sensible to continue with
                        raise ConvertError(f"{s.stored!r} ({ckpt.file_of(s.stored)}): "
                                           f"{type(e).__name__}: {first_line(e)}") from None
                    if problem:
                        problems.append(problem)
                        failed_units.add(unit)
                    stats.tensors += 1
                    stats.bytes_read += nbytes[id(s)]
                    bar.update(nbytes[id(s)])
                    pending[unit] -= 1
                    if pending[unit] == 0 and unit not in failed_units:
                        mark_done(dst, unit)
                        stats.units_converted += 1
        except BaseException:
            for f in inflight:
                f.cancel()
            raise
    return problems
