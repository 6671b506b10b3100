"""Released FP8 safetensors -> k2jax Orbax checkpoint (see orbax_io for the layout): streaming, verified,
resumable.

    source headers --verify all--> plan --per tensor, N threads--> read -> check -> dequantize / keep e4m3
        -> k2jax layout -> write its (layer, expert) slot of the stacked array -> unit done marker
        -> all units done: config.json, Orbax _METADATA, manifest (the completion marker), last

Memory: each worker converts one tensor at a time (a big one in pieces of whole chunks) in buffers it
reuses, so the peak is a few tensors' worth, independent of the number of blocks. Work is tracked in units
(the global tensors, then one unit per decoder layer): a unit's marker is written only after all of its
chunks are on disk, so a rerun after a kill (any signal, any moment) redoes only unfinished units and writes
the same bytes.

Speed: the CPU is the limit, not the disk. Data moves with O_DIRECT (filling and flushing the page cache
would cost more CPU than the conversion itself), the FP8 weights are dequantized and transposed in
cache-friendly passes (fp8.dequantize_transposed), and fresh memory is avoided (each fresh page is a fault).
Workers are twice the CPUs, as a worker waits for the disk in between.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import hashlib
import json
import math
import os
import pathlib
import re
import shutil
import signal
import sys
import time

import numpy as np

from k2jax import distributed as D
from k2jax.checkpoint import int4 as I4
from k2jax.checkpoint import names as N
from k2jax.checkpoint import orbax_io as O
from k2jax.checkpoint.fp8 import count_nonfinite, dequantize, dequantize_transposed, scale_shape, transpose
from k2jax.checkpoint.hf import MAX_LISTED, Source, check_checkpoint
from k2jax.checkpoint.safetensors_io import (INDEX_NAME, SINGLE_NAME, Checkpoint, SafetensorsFile, Scratch,
                                             read_index)
from k2jax.config import K2Config

DTYPES = ("bfloat16", "float32", "float8", "int4")
GLOBAL_UNIT = "globals"
PIECE_BYTES = 64 << 20  # a big tensor is converted in pieces of about this much output (whole chunks)
# Testing hook: SIGKILL this process after that many tensors are written (tests/test_convert.py).
KILL_AFTER_ENV = "K2JAX_CONVERT_TEST_KILL_AFTER"


class ConvertError(ValueError):
    """Bad input or a failed conversion; the message says what and where."""


@dataclasses.dataclass
class Stats:
    units_total: int = 0
    units_converted: int = 0  # by this run
    units_skipped: int = 0  # already done by an earlier (interrupted) run, or outside --layers
    tensors: int = 0
    bytes_read: int = 0
    units_left: int = 0  # not done yet by any run (other --layers ranges)
    seconds: float = 0.0
    complete: bool = False


def unit_of(t: N.Target) -> str:
    return GLOBAL_UNIT if t.hf_layer is None else f"layer-{t.hf_layer:05d}"


# ------------------------------------------------------------------------------------------------------
# Verification (before anything is written)
def open_source(src: pathlib.Path, direct: bool = False) -> tuple[K2Config, Checkpoint]:
    """Config and checkpoint of SRC (tensor data read with O_DIRECT if `direct`); every unreadable header is
    reported together."""
    if not src.exists():
        raise ConvertError(f"SRC {src}: no such file or directory")
    if not src.is_dir():
        raise ConvertError(f"SRC {src}: not a directory (expected a HuggingFace checkpoint directory)")
    cfg = K2Config.from_hf_config(src)
    if (src / INDEX_NAME).is_file():
        files = sorted(set(read_index(src / INDEX_NAME).values()))
    elif (src / SINGLE_NAME).is_file():
        files = [SINGLE_NAME]
    else:
        raise ConvertError(f"SRC {src}: neither {INDEX_NAME} nor {SINGLE_NAME} found")
    problems = []
    for f in files:
        if not (src / f).is_file():
            continue  # reported by Checkpoint with the tensors it was meant to hold
        try:
            SafetensorsFile(src / f).close()
        except (ValueError, OSError) as e:
            problems.append(str(e))
    raise_all(problems, src)
    return cfg, Checkpoint(src, direct)


def raise_all(problems: list[str], where) -> None:
    if problems:
        more = f"\n  ... and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
        raise ConvertError(f"{where}: {len(problems)} problem(s), nothing converted:\n  - "
                           + "\n  - ".join(problems[:MAX_LISTED]) + more)


def plan_leaves(cfg: K2Config, dtype: str, block) -> tuple[dict[str, dict], dict[str, dict], dict[str, dict]]:
    """Leaf name -> {"shape", "dtype", "chunks"} of the converted tree, and the float8 and int4 weights' scale
    info (int4: the routed experts as QuantizedWeight holds them, packed uint8 [*stack, in, out/2] + bf16
    `<name>_scale` [*stack, in/32, out])."""
    import jax
    import jax.numpy as jnp

    from k2jax.nn.model import abstract_params

    tree = abstract_params(cfg, jnp.bfloat16 if dtype in ("float8", "int4") else jnp.dtype(dtype))
    info = {}  # leaf -> Target of one of its tensors (the rule decides fp8 / transform / stack axes)
    layers = {i for i in (0, cfg.num_dense_layers) if i < cfg.num_hidden_layers}
    for name in N.global_names(cfg) + [n for i in sorted(layers) for n in N.layer_names(cfg, i)]:
        t = N.resolve(name, cfg)
        info.setdefault(O.leaf_name(t.leaf), t)
    leaves, fp8, int4 = {}, {}, {}
    for p, v in jax.tree_util.tree_leaves_with_path(tree):
        name = O.leaf_name(tuple(k.key for k in p))
        t = info[name]
        stack = len(t.index)  # leading (layer, expert) axes
        dt = np.dtype(v.dtype)
        if dtype == "float8" and t.fp8:
            dt = O._DTYPES["float8_e4m3fn"]
            slot = v.shape[stack:]
            out, inn = t.transform.source_shape(slot)
            in_ndim = len(slot) - 1 if t.transform is N.T.TRANSPOSE_SPLIT_IN else 1
            sname = name + O.SCALE_SUFFIX
            sshape = (*v.shape[:stack], *scale_shape((inn, out), tuple(block)[::-1]))
            leaves[sname] = _spec(sshape, np.dtype(np.float32), stack)
            fp8[name] = {"scale": sname, "in_ndim": in_ndim}
        if dtype == "int4" and t.int4:
            from k2jax.ops.quant import held_shapes

            held = held_shapes(tuple(v.shape), "int4", 1, stack)
            sname = name + O.INT4_SCALE_SUFFIX
            leaves[sname] = _spec(held.scales.shape, np.dtype(held.scales.dtype), stack)
            int4[name] = {"scale": sname, "in_ndim": 1}
            leaves[name] = _spec(held.values.shape, np.dtype(held.values.dtype), stack)
            continue
        leaves[name] = _spec(v.shape, dt, stack)
    return dict(sorted(leaves.items())), fp8, int4


def _spec(shape, dt, stack):
    return {"shape": list(shape), "dtype": O.dtype_name(dt), "chunks": list(O.chunk_shape(shape, stack, dt.itemsize))}


def parse_layers(spec: str | None, n: int) -> range:
    """'a:b' (either side optional) or 'a' -> the HF layers to convert."""
    if spec is None:
        return range(n)
    m = re.fullmatch(r"\s*(\d*)\s*(:?)\s*(\d*)\s*", spec)
    if not m or (not m.group(2) and not m.group(1)):
        raise ConvertError(f"--layers {spec!r}: expected a:b (layer indices, b exclusive), e.g. 0:30")
    a = int(m.group(1) or 0)
    b = int(m.group(3) or n) if m.group(2) else a + 1
    if not 0 <= a < b <= n:
        raise ConvertError(f"--layers {spec!r}: need 0 <= a < b <= num_hidden_layers ({n})")
    return range(a, b)


def fingerprint(src: pathlib.Path, ckpt: Checkpoint, dtype: str) -> str:
    """What makes a conversion's bytes: the source (config, file names and sizes, every header), the output
    dtype and the layout. A rerun resumes only a job with the same fingerprint."""
    h = hashlib.sha256()
    h.update((src / "config.json").read_bytes())
    for f in sorted(ckpt.files):
        sf = ckpt.files[f]
        h.update(json.dumps([f, sf.size, sorted(sf.tensors.items())]).encode())
    h.update(json.dumps([dtype, O.LAYOUT_VERSION]).encode())
    return h.hexdigest()


# ------------------------------------------------------------------------------------------------------
# Destination state
def prepare_dst(dst: pathlib.Path, job: str, overwrite: bool) -> str:
    """-> "fresh" | "resume" | "done" (the same job already complete). Refuses to touch anything else."""
    if dst.exists() and not dst.is_dir():
        raise ConvertError(f"DST {dst} exists and is not a directory")
    manifest, progress = dst / O.MANIFEST, dst / O.PROGRESS
    if dst.is_dir() and any(dst.iterdir()):
        if manifest.is_file():
            try:
                same = json.loads(manifest.read_text()).get("job") == job
            except (json.JSONDecodeError, OSError):
                same = False
            if not overwrite:
                if same:
                    shutil.rmtree(progress, ignore_errors=True)  # left by a kill just after completion
                    return "done"
                raise ConvertError(f"DST {dst} is a complete k2jax checkpoint (of another source or dtype): "
                                   f"pass --overwrite to replace it")
            manifest.unlink()  # first: from here on it no longer passes for complete
        elif progress.is_dir():
            try:
                same = json.loads((progress / "job.json").read_text()).get("job") == job
            except (json.JSONDecodeError, OSError):
                same = False
            if same:
                _remove_partial_writes(dst)
                return "resume"  # even with --overwrite: a rerun of the same command must not lose work
            if not overwrite:
                raise ConvertError(f"DST {dst} holds an unfinished conversion of another source or dtype: pass "
                                   f"--overwrite to discard it")
        else:
            raise ConvertError(f"DST {dst} exists, is not empty and is not a k2jax checkpoint: refusing to write "
                               f"into it (even with --overwrite); choose an empty or new directory")
        shutil.rmtree(dst)
    try:
        (dst / O.PROGRESS / "done").mkdir(parents=True, exist_ok=True)
        O.atomic_write(dst / O.PROGRESS / "job.json", json.dumps({"job": job}))
    except OSError as e:
        raise ConvertError(f"DST {dst}: cannot write there: {e.strerror or e}") from None
    return "fresh"


def _remove_partial_writes(dst: pathlib.Path) -> None:
    """Delete what a killed tensorstore write leaves (its lock and temp files; chunks land by rename, so a
    chunk file itself is whole or absent): the resumed checkpoint then has exactly a fresh run's files."""
    for leaf in os.scandir(dst):
        if leaf.is_dir() and leaf.name != O.PROGRESS:
            for f in os.scandir(leaf.path):
                if ".__lock" in f.name or ".__tmp_" in f.name:
                    os.unlink(f.path)


# ------------------------------------------------------------------------------------------------------
class _Converter:
    """Per-tensor work: read, check, dequantize or keep, re-layout, write into its slot. A big 2-D tensor goes
    in pieces of whole chunks (rows of the source), so its buffers are reused like everyone else's."""

    def __init__(self, cfg, ckpt, dst, dtype, block, leaves, fp8, direct, int4=None):
        self.cfg, self.ckpt, self.dtype, self.block, self.fp8, self.leaves = cfg, ckpt, dtype, block, fp8, leaves
        self.int4 = int4 or {}
        for n, spec in leaves.items():
            O.open_array(dst, n, spec, create=True)
        self.writer = O.ChunkWriter(dst, leaves, direct)
        self.scratch = Scratch()
        self.leaf_dtype = {n: np.dtype(O._DTYPES[s["dtype"]]) for n, s in leaves.items()}

    def __call__(self, src: Source) -> str | None:
        """Convert one tensor; -> a problem found in its data (nothing written, or for a tensor in pieces
        nothing after the piece it is in; its unit is not marked done either way), or None."""
        t, ckpt = src.target, self.ckpt
        name = O.leaf_name(t.leaf)
        if src.dtype == "INT4":  # pack-quantized (values 0..15 cannot be NaN; the scales were checked)
            packed, scale = ckpt.read(src.packed), ckpt.read(src.scale)
            if name in self.int4:  # as stored: the same 4-bit values, repacked along the output dim
                v, s = I4.to_k2jax(packed, scale)
                self.writer.write(name, t.index, v, self.scratch)
                self.writer.write(self.int4[name]["scale"], t.index, s, self.scratch)
            else:
                x = I4.dequantize(packed, scale, self.leaf_dtype[name])
                self.writer.write(name, t.index, transpose(x), self.scratch)
            return None
        shape = ckpt.tensors[t.name].shape
        slot = N.slot_shape(t, self.cfg)
        transposed = t.transform.forward is N.T.TRANSPOSE.forward and len(shape) == 2  # all of the TRANSPOSE_*
        scale = None if src.scale is None else ckpt.read(src.scale)
        pieces = self._pieces(name, shape, slot, transposed, scale is not None and name not in self.fp8)
        bad = 0
        for rows in pieces:
            n, x = self._convert_rows(src, name, rows, transposed, scale)
            bad += n
            if not bad:
                whole = len(pieces) == 1
                start = None if whole else (0, rows[0]) if transposed else (rows[0], 0)
                self.writer.write(name, t.index, x.reshape(slot) if whole else x, self.scratch, start)
        if bad:
            return f"{t.name!r} ({ckpt.file_of(t.name)}): {bad} NaN/inf value(s) in the data"
        if name in self.fp8:  # float8: e4m3 as stored, its scale beside it (transposed like the weight)
            self.writer.write(self.fp8[name]["scale"], t.index, np.ascontiguousarray(scale.astype(np.float32).T),
                              self.scratch)
        return None

    def _pieces(self, name, shape, slot, transposed, dequantized) -> list[tuple[int, int]]:
        """Row ranges of the source to convert one at a time: about PIECE_BYTES of output each, in whole chunks
        (and whole scale blocks); [(0, rows)] for a tensor that is small or not a plain 2-D slot."""
        rows = shape[0] if shape else 0
        if len(shape) != 2 or tuple(slot) != (tuple(shape[::-1]) if transposed else tuple(shape)) or \
                (dequantized and not transposed):
            return [(0, rows)]
        chunks = self.leaves[name]["chunks"][-2:]
        step = chunks[1] if transposed else chunks[0]  # source rows per chunk
        if dequantized:
            step = math.lcm(step, self.block[0])
        step *= max(1, PIECE_BYTES // (step * shape[1] * self.leaf_dtype[name].itemsize))
        return [(r, min(r + step, rows)) for r in range(0, rows, step)] or [(0, rows)]

    def _convert_rows(self, src, name, rows, transposed, scale) -> tuple[int, np.ndarray]:
        """Source rows [a, b) -> (count of non-finite values, converted: [b - a, ...] or transposed)."""
        t, ckpt, scratch, dtype = src.target, self.ckpt, self.scratch, self.leaf_dtype[name]
        raw = ckpt.read(t.name, scratch, rows if len(ckpt.tensors[t.name].shape) else None)
        if scale is not None and name not in self.fp8 and transposed:  # every FP8 weight, bf16/f32 output
            # as load_hf: products in float32, one rounding to the target dtype; the pass also counts NaN/inf
            if raw.ctypes.data % 64:  # jax copies a misaligned input itself, several times slower than this
                raw = _copy(raw, scratch.array("in", raw.shape, raw.dtype))
            b = self.block[0]
            x, bad = dequantize_transposed(raw, scale[rows[0] // b:-(-rows[1] // b)], self.block, dtype,
                                           scratch.array("out", raw.shape[::-1], dtype))
            return bad, x
        bad = count_nonfinite(raw)
        if scale is not None and name not in self.fp8:
            raw = dequantize(raw, scale, self.block, np.float32)
        raw = raw.astype(dtype, copy=False)
        return bad, transpose(raw, scratch.array("out", raw.shape[::-1], dtype)) if transposed else raw


def _copy(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    np.copyto(out, x)
    return out


def convert(src, dst, dtype: str = "bfloat16", workers: int | None = None, layers: str | None = None,
            overwrite: bool = False, quiet: bool = False, log=print, direct_io: bool = True) -> Stats:
    """Convert the HF checkpoint directory `src` into `dst` (see the module docstring). Returns Stats;
    raises ConvertError (or OSError / SafetensorsError) with every problem found, writing nothing on bad input.

    layers 'a:b' converts only those decoder layers (and the global tensors when a == 0): runs over disjoint
    ranges, e.g. one per host, fill one DST, and whichever finishes the last unit marks it complete.

    direct_io: read the source and write the chunks with O_DIRECT where the filesystems allow it (see
    safetensors_io and orbax_io.ChunkWriter); False: through the page cache.
    """
    t0 = time.perf_counter()
    src, dst = pathlib.Path(src), pathlib.Path(dst)
    if dtype not in DTYPES:
        raise ConvertError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    workers = workers or min(8, 2 * (os.cpu_count() or 1))
    if workers < 1:
        raise ConvertError(f"--workers {workers}: need at least 1")
    cfg, ckpt = open_source(src, direct_io)
    with ckpt:
        plan = check_checkpoint(cfg, ckpt)
        problems = list(plan.problems)
        if dtype == "float8":
            problems += [f"{s.stored!r} ({ckpt.file_of(s.stored)}): {s.dtype}, but --dtype float8 keeps "
                         f"the release's F8_E4M3 weights (convert a float checkpoint with --dtype bfloat16)"
                         for s in plan.sources if s.target.fp8 and s.dtype != "F8_E4M3"]
        if dtype == "int4":
            problems += [f"{s.stored!r} ({ckpt.file_of(s.stored)}): {s.dtype}, but --dtype int4 keeps the INT4 routed "
                         f"experts of a pack-quantized checkpoint (Kimi-K2-Thinking) as stored; convert an FP8 "
                         f"release with --dtype float8 and load it with quant='int4' (requantized, lossy)"
                         for s in plan.sources if s.target.int4 and s.dtype != "INT4"][:1]
        raise_all(problems, src)
        index, count = _processes()
        if count > 1 and layers is not None:
            raise ConvertError(f"--layers {layers!r}: under jax.distributed each of the {count} processes converts "
                               f"its own share of the layers; drop --layers")
        todo_layers = (parse_layers(layers, cfg.num_hidden_layers) if count == 1
                       else D.share(cfg.num_hidden_layers, index, count))
        leaves, fp8, int4 = plan_leaves(cfg, dtype, plan.block)
        job = fingerprint(src, ckpt, dtype)

        def make_converter():
            try:
                return _Converter(cfg, ckpt, dst, dtype, plan.block, leaves, fp8, direct_io, int4)
            except ValueError as e:  # tensorstore: the arrays of an earlier run do not match
                raise ConvertError(f"DST {dst}: cannot create the arrays: {_first_line(e)}") from None

        conv = None
        if count == 1:
            state = prepare_dst(dst, job, overwrite)
        else:  # process 0 prepares DST and creates the arrays, then the others open them
            state, conv = _together("prepare", index, lambda: _prepare_and_create(dst, job, overwrite,
                                                                                  make_converter))
        units = {GLOBAL_UNIT} | {f"layer-{i:05d}" for i in range(cfg.num_hidden_layers)}
        stats = Stats(units_total=len(units))
        if state == "done":
            stats.units_skipped, stats.complete = len(units), True
            log(f"{dst}: already holds this conversion, complete; nothing to do")
            return stats
        done_dir = dst / O.PROGRESS / "done"
        wanted = {f"layer-{i:05d}" for i in todo_layers} | ({GLOBAL_UNIT} if todo_layers.start == 0 else set())
        done = {p.name for p in done_dir.iterdir()}
        run_units = wanted - done
        stats.units_skipped = len(units) - len(run_units)
        sources = [s for s in plan.sources if unit_of(s.target) in run_units]
        order = {f: k for k, f in enumerate(sorted(ckpt.files, key=_natural))}
        sources.sort(key=lambda s: (order[ckpt.file_of(s.stored)], ckpt.tensors[s.stored].begin))
        if not quiet and done & wanted:
            log(f"{dst}: resuming: {len(done & wanted)} of {len(wanted)} units already converted")
        if count > 1 and not quiet:
            log(f"process {index} of {count}: layers {todo_layers.start}:{todo_layers.stop}"
                + (" and the global tensors" if GLOBAL_UNIT in wanted else ""))
        conv = conv or make_converter()
        pending = {u: 0 for u in run_units}
        for s in sources:
            pending[unit_of(s.target)] += 1
        if count == 1:
            data_problems = _run(conv, ckpt, sources, pending, done_dir, workers, quiet, stats)
        else:  # every process learns every other's problems: all fail together, none waits forever
            data_problems = _together_all("convert", lambda: _run(conv, ckpt, sources, pending, done_dir, workers,
                                                                  quiet, stats))
        raise_all(data_problems, src)

        def complete():
            left = len(units - {p.name for p in done_dir.iterdir()})
            if left == 0:
                finalize(src, dst, cfg, ckpt, dtype, plan.block, leaves, fp8, job, int4)
            return left

        # Several processes: process 0 marks DST complete once all have converted theirs; all return after.
        stats.units_left = complete() if count == 1 else int(_together("finalize", index, lambda: (complete(), None))[0])
        stats.complete = stats.units_left == 0
        stats.seconds = time.perf_counter() - t0
        return stats


# ------------------------------------------------------------------------------------------------------
# Several processes (jax.distributed, one per host): they agree through the coordinator's key-value service.
def _processes() -> tuple[int, int]:
    """(this process's index, how many) under jax.distributed; (0, 1) otherwise."""
    if not D.running_distributed():
        return 0, 1
    import jax

    return jax.process_index(), jax.process_count()


def _prepare_and_create(dst, job, overwrite, make_converter):
    state = prepare_dst(dst, job, overwrite)
    return state, (None if state == "done" else make_converter())


def _together(name: str, index: int, fn):
    """Run fn() -> (result, local value) on process 0 only; every process returns (its result, the local value
    on process 0, None elsewhere), or raises process 0's error."""
    value, local, error = "", None, ""
    if index == 0:
        try:
            result, local = fn()
            value = json.dumps(result)
        except ConvertError as e:
            error = str(e)
    posted = D.gather_strings(name, json.dumps({"value": value, "error": error}))
    first = json.loads(posted[0])
    if first["error"]:
        raise ConvertError(first["error"] if index == 0 else f"process 0: {first['error']}")
    return json.loads(first["value"]), local


def _together_all(name: str, fn) -> list[str]:
    """Run fn() -> problems (list of str) on every process; -> all processes' problems, an exception on any
    process counting as one (so all of them raise)."""
    try:
        mine = {"problems": fn()}
    except ConvertError as e:
        mine = {"problems": [str(e)]}
    except Exception as e:  # noqa: BLE001 - reported by every process, then raised here
        mine = {"problems": [f"{type(e).__name__}: {_first_line(e)}"]}
    posted = [json.loads(x) for x in D.gather_strings(name, json.dumps(mine))]
    return [f"process {i}: {p}" for i, r in enumerate(posted) for p in r["problems"]]


def _run(conv, ckpt, sources, pending, done_dir, workers, quiet, stats) -> list[str]:
    """Convert `sources` on `workers` threads, at most 2 x workers in flight; mark units as they finish."""
    from tqdm import tqdm

    kill_after = int(os.environ.get(KILL_AFTER_ENV, "0") or 0)
    nbytes = {id(s): ckpt.tensors[s.stored].nbytes + (ckpt.tensors[s.scale].nbytes if s.scale else 0)
              for s in sources}
    problems, failed_units = [], set()
    for u in [u for u, n in pending.items() if n == 0]:  # a unit with nothing in it (cannot happen in practice)
        _mark(done_dir, u)
    bar = tqdm(total=sum(nbytes.values()), unit="B", unit_scale=True, unit_divisor=1024, disable=quiet,
               desc="convert", smoothing=0.1, dynamic_ncols=True)
    it = iter(sources)
    with cf.ThreadPoolExecutor(workers, thread_name_prefix="k2jax-convert") as pool, bar:
        inflight: dict[cf.Future, Source] = {}
        try:
            while True:
                while len(inflight) < 2 * workers and (s := next(it, None)) is not None:
                    inflight[pool.submit(conv, s)] = s
                if not inflight:
                    break
                finished, _ = cf.wait(inflight, return_when=cf.FIRST_COMPLETED)
                for f in finished:
                    s = inflight.pop(f)
                    unit = unit_of(s.target)
                    try:
                        problem = f.result()
                    except Exception as e:  # I/O: nothing sensible to continue with
                        raise ConvertError(f"{s.stored!r} ({ckpt.file_of(s.stored)}): "
                                           f"{type(e).__name__}: {_first_line(e)}") from None
                    if problem:
                        problems.append(problem)
                        failed_units.add(unit)
                    stats.tensors += 1
                    stats.bytes_read += nbytes[id(s)]
                    bar.update(nbytes[id(s)])
                    pending[unit] -= 1
                    if pending[unit] == 0 and unit not in failed_units:
                        _mark(done_dir, unit)
                        stats.units_converted += 1
                    if kill_after and stats.tensors >= kill_after:
                        os.kill(os.getpid(), signal.SIGKILL)
        except BaseException:
            for f in inflight:
                f.cancel()
            raise
    return problems


def _mark(done_dir: pathlib.Path, unit: str) -> None:
    O.atomic_write(done_dir / unit, "")


def _natural(name: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _first_line(e: BaseException) -> str:
    return re.sub(r"\s*\[source locations=.*", "", str(e).strip().splitlines()[0] if str(e).strip() else repr(e))


def finalize(src, dst, cfg, ckpt, dtype, block, leaves, fp8, job, int4=None) -> None:
    """config.json, Orbax metadata, then the manifest: the checkpoint is complete once the manifest exists."""
    from k2jax import __version__

    hf = json.loads((src / "config.json").read_text())
    if dtype not in ("float8", "int4"):
        hf.pop("quantization_config", None)
    hf["torch_dtype"] = "bfloat16" if dtype in ("float8", "int4") else dtype
    O.atomic_write(dst / "config.json", json.dumps(hf, indent=2))
    O.write_orbax_metadata(dst, leaves)
    int4 = int4 or {}
    scales = {f["scale"] for f in (*fp8.values(), *int4.values())}
    manifest = {
        "format": "k2jax orbax checkpoint", "layout_version": O.LAYOUT_VERSION, "tool_version": __version__,
        "dtype": dtype, "param_count": sum(int(np.prod(s["shape"])) for n, s in leaves.items() if n not in scales),
        "fp8_block": list(block), "job": job,
        "source": {"files": [{"name": f, "size": ckpt.files[f].size} for f in sorted(ckpt.files, key=_natural)],
                   "tensors": len(ckpt.tensors)},
        "leaves": leaves, "fp8": fp8, "int4": int4,
    }
    O.atomic_write(dst / O.MANIFEST, json.dumps(manifest, indent=1))
    shutil.rmtree(dst / O.PROGRESS, ignore_errors=True)


# ------------------------------------------------------------------------------------------------------
# Command line (tools/convert/convert.py and `k2jax convert`)
DESCRIPTION = """\
Convert a HuggingFace DeepSeek-V3 / Kimi K2 checkpoint (the released FP8 safetensors, or bf16/f32) into a
k2jax Orbax checkpoint that `k2jax.load(DST)` (or a plain Orbax restore) reads, sharded, straight onto devices.

Every header and FP8 scale is verified first, against config.json; all problems are listed together and
nothing is written. Conversion streams tensor by tensor on --workers threads (memory: a few tensors, not the
model), and can be killed at any moment: rerun the same command to resume. DST is marked complete only at
the very end (k2jax_manifest.json); a complete DST is replaced only with --overwrite.

On several hosts sharing DST (a shared filesystem), run the same command on each with --distributed (a TPU
slice) or --coordinator/--num-processes/--process-id: each process converts its own contiguous share of the
layers, and every process returns only once DST is complete.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", metavar="SRC", help="HF checkpoint directory: config.json, model.safetensors.index.json "
                                              "(or model.safetensors) and the shard files")
    p.add_argument("dst", metavar="DST", help="output directory (created; resumed if a same-job conversion was "
                                              "interrupted)")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES,
                   help="bfloat16 (default) or float32: FP8 / INT4 weights dequantized with their scales; "
                        "float8: keep an FP8 release's e4m3 weights and store their scales beside them; int4: keep "
                        "a Kimi-K2-Thinking checkpoint's INT4 routed experts as stored (packed 4-bit values + bf16 "
                        "scales), the rest bf16. k2jax.load(DST, quant=...) holds them quantized on device")
    p.add_argument("--workers", type=int, default=None,
                   help="threads reading, dequantizing and writing (default: min(8, 2 x CPUs))")
    p.add_argument("--layers", metavar="A:B", default=None,
                   help="convert only decoder layers A..B-1 (plus embeddings/norm/lm_head when A is 0), e.g. to "
                        "split the work over hosts sharing DST; the last run to finish marks DST complete")
    p.add_argument("--overwrite", action="store_true", help="replace a complete checkpoint (or another job's "
                                                            "unfinished one) at DST")
    p.add_argument("--quiet", action="store_true", help="no progress bar or log lines, only errors")
    p.add_argument("--no-direct-io", dest="direct_io", action="store_false",
                   help="read and write through the page cache (default: O_DIRECT where the filesystem allows it, "
                        "which saves most of the CPU time of a conversion)")
    D.add_arguments(p)


def run(args: argparse.Namespace, prog: str = "k2jax convert") -> int:
    """Run a parsed command line; -> exit status. Errors are one cause (or one list of problems), no traceback."""
    quiet = args.quiet
    log = (lambda *a, **k: None) if quiet else (lambda *a, **k: print(*a, file=sys.stderr, **k))
    try:
        if D.initialize_from_args(args) and not D.is_main():  # one progress bar and report: process 0's
            quiet, log = True, (lambda *a, **k: None)
        stats = convert(args.src, args.dst, dtype=args.dtype, workers=args.workers, layers=args.layers,
                        overwrite=args.overwrite, quiet=quiet, log=log, direct_io=args.direct_io)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    except (ValueError, OSError) as e:  # ConvertError, SafetensorsError, config errors, I/O
        msg = str(e) if isinstance(e, ValueError) else f"{e.filename or ''}: {e.strerror or e}".lstrip(": ")
        print(f"{prog}: error: {msg}", file=sys.stderr)
        return 2
    except Exception as e:  # a bug: still one line, the traceback on request
        if os.environ.get("K2JAX_DEBUG"):
            raise
        print(f"{prog}: internal error: {type(e).__name__}: {_first_line(e)} (K2JAX_DEBUG=1 shows the traceback)",
              file=sys.stderr)
        return 1
    gb = stats.bytes_read / 1e9
    if stats.complete:
        log(f"{args.dst}: complete. {stats.tensors} tensors, {gb:.2f} GB read in {stats.seconds:.1f} s "
            f"({gb / max(stats.seconds, 1e-9):.2f} GB/s); {stats.units_converted} units converted now, "
            f"{stats.units_skipped} already done")
    else:
        log(f"{args.dst}: {stats.units_converted} units converted now, {stats.units_left} left for other --layers "
            f"runs; not complete until every layer range is converted")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="convert.py", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv), prog="convert")
