"""`convert`: a HuggingFace checkpoint -> a k2jax Orbax checkpoint (layout: k2jax.checkpoint.orbax_layout),
step by step: open the source (fetch this process's files from the Hub) -> verify it -> the stored tree's arrays
-> prepare (or resume) DST -> convert the units not yet done on the worker pool -> the manifest, last."""

from __future__ import annotations

import dataclasses
import json
import re
import time

import numpy as np

from k2jax import __version__, distributed
from k2jax.checkpoint.convert.codec import TensorConverter
from k2jax.checkpoint.convert.destination import (GLOBAL_UNIT, all_units, done_units, layer_unit, prepare_dst,
                                                  unit_of)
from k2jax.checkpoint.convert.errors import ConvertError, first_line
from k2jax.checkpoint.convert.pool import WORKERS, run_pool
from k2jax.checkpoint.convert.processes import on_every_process, on_process_zero, processes
from k2jax.checkpoint.convert.verify import (DTYPES, check_source, fingerprint, open_checkpoint, open_files,
                                             parse_layers, raise_all)
from k2jax.checkpoint.hf_source import config_from, safetensors_files, weight_map
from k2jax.checkpoint.hf_validate import data_problems, text_prefix
from k2jax.checkpoint.orbax_layout import (COMMIT_SUCCESS, CONVERSIONS, LAYOUT_VERSION, MANIFEST, PROGRESS, leaf_specs,
                                           write_orbax_metadata)
from k2jax.checkpoint.storage import open_dir
from k2jax.config import text_config


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


def convert(src, dst, dtype: str = "bfloat16", workers: int | None = None, layers: str | None = None,
            overwrite: bool = False, quiet: bool = False, log=print, direct_io: bool = True,
            revision: str | None = None) -> Stats:
    """Convert the HF checkpoint `src` (a local directory, a gs:// URL, or a Hugging Face repo id at `revision`)
    into `dst` (a local directory or a gs:// URL). Returns Stats; raises ConvertError (or OSError /
    SafetensorsError) with every problem found, writing nothing on bad input.

    dtype (CONVERSIONS): bfloat16 / float32 dequantize any FP8 / INT4 weights; float8 keeps an FP8 release's
    e4m3 weights and scales, int4 a Kimi-K2-Thinking release's INT4 experts, as QuantizedWeight leaves.
    layers 'a:b' converts only those decoder layers (and the global tensors when a == 0): runs over disjoint
    ranges, e.g. one per host, fill one DST, and whichever finishes the last unit marks it complete. Under
    jax.distributed each process converts its own share of the layers instead. Either way a process reads (and,
    from the Hub, downloads) only the files and tensors of its own layers, besides every header.
    direct_io: read the source and write the chunks with O_DIRECT where the filesystems allow it (see
    safetensors_io and chunk_writer.ChunkWriter); False: through the page cache.
    """
    t0 = time.perf_counter()
    if dtype not in DTYPES:
        raise ConvertError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    workers = workers or WORKERS
    if workers < 1:
        raise ConvertError(f"--workers {workers}: need at least 1")
    try:
        dst = open_dir(dst)
    except (ValueError, OSError) as e:
        raise ConvertError(f"DST {e}") from None
    files, raw_config = open_files(src, revision, quiet)
    cfg = config_from(raw_config, files.name("config.json"))
    prefix = text_prefix(raw_config)
    index, count = processes()
    if count > 1 and layers is not None:
        raise ConvertError(f"--layers {layers!r}: under jax.distributed each of the {count} processes converts "
                           f"its own share of the layers; drop --layers")
    todo_layers = (parse_layers(layers, cfg.num_hidden_layers) if count == 1
                   else distributed.share(cfg.num_hidden_layers, index, count))
    wanted = {layer_unit(i) for i in todo_layers} | ({GLOBAL_UNIT} if todo_layers.start == 0 else set())
    whole = wanted == all_units(cfg.num_hidden_layers)
    files.fetch(needed_files(files, prefix, wanted))  # a Hub repo: downloads this process's files only
    ckpt = open_checkpoint(files, direct_io)
    with ckpt:
        # The headers everywhere; the scales' values of the layers converted here (each process its own, all
        # processes told of every problem).
        checked = check_source(cfg, ckpt, files, dtype, prefix, read_data=whole and count == 1)
        if not (whole and count == 1):
            mine = lambda: data_problems(cfg, ckpt, checked, lambda s: unit_of(s) in wanted)  # noqa: E731
            raise_all(mine() if count == 1 else on_every_process("verify", mine), files)
        if note := checked.vision_note(files):
            log(note)
        leaves = leaf_specs(cfg, dtype)
        job = fingerprint(files.read("config.json"), ckpt, dtype)

        def make_converter():
            try:
                return TensorConverter(cfg, ckpt, dst, dtype, checked.block, leaves, direct_io)
            except (ValueError, OSError) as e:  # tensorstore: the arrays of an earlier run do not match
                raise ConvertError(f"DST {dst}: cannot create the arrays: {first_line(e)}") from None

        conv = None
        if count == 1:
            state = prepare(dst, job, overwrite)
        else:  # process 0 prepares DST and creates the arrays, then the others open them
            state, conv = on_process_zero("prepare", index, lambda: _prepare_and_create(dst, job, overwrite,
                                                                                        make_converter))
        units = all_units(cfg.num_hidden_layers)
        stats = Stats(units_total=len(units))
        if state == "done":
            stats.units_skipped, stats.complete = len(units), True
            log(f"{dst}: already holds this conversion, complete; nothing to do")
            return stats
        done = done_units(dst)
        run_units = wanted - done
        stats.units_skipped = len(units) - len(run_units)
        sources = [s for s in checked.sources if unit_of(s) in run_units]
        order = {f: k for k, f in enumerate(sorted(ckpt.files, key=_natural))}
        sources.sort(key=lambda s: (order[ckpt.file_of(s.stored)], ckpt.tensors[s.stored].begin))
        if not quiet and done & wanted:
            log(f"{dst}: resuming: {len(done & wanted)} of {len(wanted)} units already converted")
        if count > 1 and not quiet:
            log(f"process {index} of {count}: layers {todo_layers.start}:{todo_layers.stop}"
                + (" and the global tensors" if GLOBAL_UNIT in wanted else ""))
        conv = conv or make_converter()
        if count == 1:
            data_problems_found = run_pool(conv, ckpt, sources, dst, workers, quiet, stats)
        else:  # every process learns every other's problems: all fail together, none waits forever
            data_problems_found = on_every_process("convert", lambda: run_pool(conv, ckpt, sources, dst, workers,
                                                                               quiet, stats))
        raise_all(data_problems_found, files)

        def complete():
            left = len(units - done_units(dst))
            if left == 0:
                finalize(raw_config, dst, ckpt, dtype, leaves, job)
            return left

        # Several processes: process 0 marks DST complete once all have converted theirs; all return after.
        stats.units_left = complete() if count == 1 else int(on_process_zero("finalize", index,
                                                                             lambda: (complete(), None))[0])
        stats.complete = stats.units_left == 0
        stats.seconds = time.perf_counter() - t0
        return stats


def needed_files(files, prefix: str, units: set[str]) -> list[str]:
    """The safetensors files holding a tensor of `units` (by the index's names; all files without an index)."""
    wm = weight_map(files)
    if wm is None:
        return safetensors_files(files)
    layer = re.compile(re.escape(prefix) + r"model\.layers\.(\d+)\.")
    out = set()
    for name, f in wm.items():
        if prefix and not name.startswith(prefix):
            continue  # (a K2.5 vision tensor: never read)
        m = layer.match(name)
        if (layer_unit(int(m.group(1))) if m else GLOBAL_UNIT) in units:
            out.add(f)
    return sorted(out)


def prepare(dst, job: str, overwrite: bool) -> str:
    try:
        return prepare_dst(dst, job, overwrite)
    except OSError as e:
        raise ConvertError(f"DST {e}") from None


def _prepare_and_create(dst, job, overwrite, make_converter):
    state = prepare(dst, job, overwrite)
    return state, (None if state == "done" else make_converter())


def finalize(raw_config: dict, dst, ckpt, dtype: str, leaves: dict, job: str) -> None:
    """config.json, Orbax metadata (and on gs:// Orbax's commit marker), then the manifest: the checkpoint is
    complete once the manifest exists."""
    hf = text_config(raw_config)  # (K2.5: its text model's, converted)
    param_dtype, quant = CONVERSIONS[dtype]
    if quant is None:
        hf.pop("quantization_config", None)
    hf["torch_dtype"] = param_dtype
    dst.write("config.json", json.dumps(hf, indent=2).encode())
    write_orbax_metadata(dst, leaves)
    if dst.remote:
        dst.write(COMMIT_SUCCESS, b"k2jax convert\n")
    manifest = {
        "format": "k2jax orbax checkpoint", "layout_version": LAYOUT_VERSION, "tool_version": __version__,
        "dtype": dtype, "param_dtype": param_dtype, "quant": quant,
        "param_count": _param_count(leaves, quant),
        "job": job,
        "source": {"files": [{"name": f, "size": ckpt.files[f].size} for f in sorted(ckpt.files, key=_natural)],
                   "tensors": len(ckpt.tensors)},
        "leaves": leaves,
    }
    dst.write(MANIFEST, json.dumps(manifest, indent=1).encode())
    dst.delete(PROGRESS)


def _param_count(leaves: dict, quant: str | None) -> int:
    """Parameters stored: every array but the scales, a packed INT4 byte counting two."""
    return sum(int(np.prod(s["shape"])) * (2 if quant == "int4" and n.endswith(".values") else 1)
               for n, s in leaves.items() if not n.endswith(".scales"))


def _natural(name: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]
