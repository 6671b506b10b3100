"""The destination's state: fresh, resumed or already done, and the units (the global tensors, then one per
decoder layer) marked done as they are written. A unit's marker is written only after all of its chunks are on
disk, so a rerun after a kill (any signal, any moment) redoes only unfinished units and writes the same bytes."""

from __future__ import annotations

import json
import os
import pathlib
import shutil

from k2jax.checkpoint.convert.errors import ConvertError
from k2jax.checkpoint.hf_validate import Source
from k2jax.checkpoint.orbax_layout import MANIFEST, PROGRESS, atomic_write

GLOBAL_UNIT = "globals"


def unit_of(src: Source) -> str:
    """The unit a source tensor belongs to: its decoder layer, or the global tensors."""
    layer = src.target.hf_layer
    return GLOBAL_UNIT if layer is None else layer_unit(layer)


def layer_unit(layer: int) -> str:
    return f"layer-{layer:05d}"


def all_units(num_layers: int) -> set[str]:
    return {GLOBAL_UNIT} | {layer_unit(i) for i in range(num_layers)}


def done_dir(dst: pathlib.Path) -> pathlib.Path:
    return dst / PROGRESS / "done"


def done_units(dst: pathlib.Path) -> set[str]:
    """The units some run has finished."""
    return {p.name for p in done_dir(dst).iterdir()}


def mark_done(dst: pathlib.Path, unit: str) -> None:
    """Record a unit as finished (after all of its chunks are written)."""
    atomic_write(done_dir(dst) / unit, "")


def prepare_dst(dst: pathlib.Path, job: str, overwrite: bool) -> str:
    """-> "fresh" | "resume" | "done" (the same job already complete). Refuses to touch anything else."""
    if dst.exists() and not dst.is_dir():
        raise ConvertError(f"DST {dst} exists and is not a directory")
    manifest, progress = dst / MANIFEST, dst / PROGRESS
    if dst.is_dir() and any(dst.iterdir()):
        if manifest.is_file():
            same = _job_of(manifest) == job
            if not overwrite:
                if same:
                    shutil.rmtree(progress, ignore_errors=True)  # left by a kill just after completion
                    return "done"
                raise ConvertError(f"DST {dst} is a complete k2jax checkpoint (of another source or dtype): "
                                   f"pass --overwrite to replace it")
            manifest.unlink()  # first: from here on it no longer passes for complete
        elif progress.is_dir():
            if _job_of(progress / "job.json") == job:
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
        done_dir(dst).mkdir(parents=True, exist_ok=True)
        atomic_write(progress / "job.json", json.dumps({"job": job}))
    except OSError as e:
        raise ConvertError(f"DST {dst}: cannot write there: {e.strerror or e}") from None
    return "fresh"


def _job_of(path: pathlib.Path) -> str | None:
    try:
        return json.loads(path.read_text()).get("job")
    except (json.JSONDecodeError, OSError):
        return None


def _remove_partial_writes(dst: pathlib.Path) -> None:
    """Delete what a killed write leaves (tensorstore's lock and temp files, our chunks' temporary names; chunks
    land by rename, so a chunk file itself is whole or absent): the resumed checkpoint then has exactly a fresh
    run's files."""
    for leaf in os.scandir(dst):
        if leaf.is_dir() and leaf.name != PROGRESS:
            for f in os.scandir(leaf.path):
                if ".__lock" in f.name or ".__tmp_" in f.name:
                    os.unlink(f.path)
