"""The destination's state: fresh, resumed or already done, and the units (the global tensors, then one per
decoder layer) marked done as they are written. A unit's marker is written only after all of its chunks are on
disk, so a rerun after a kill (any signal, any moment) redoes only unfinished units and writes the same bytes."""

from __future__ import annotations

import json
import os

from k2jax.checkpoint.convert.errors import ConvertError
from k2jax.checkpoint.hf_validate import Source
from k2jax.checkpoint.orbax_layout import MANIFEST, PROGRESS

GLOBAL_UNIT = "globals"


def unit_of(src: Source) -> str:
    """The unit a source tensor belongs to: its decoder layer, or the global tensors."""
    layer = src.target.hf_layer
    return GLOBAL_UNIT if layer is None else layer_unit(layer)


def layer_unit(layer: int) -> str:
    return f"layer-{layer:05d}"


def all_units(num_layers: int) -> set[str]:
    return {GLOBAL_UNIT} | {layer_unit(i) for i in range(num_layers)}


DONE = f"{PROGRESS}/done"


def done_units(dst) -> set[str]:
    """The units some run has finished."""
    return {k.rsplit("/", 1)[-1] for k in dst.keys(DONE)}


def mark_done(dst, unit: str) -> None:
    """Record a unit as finished (after all of its chunks are written)."""
    dst.write(f"{DONE}/{unit}", b"done\n")  # (not empty: some GCS emulators drop empty uploads)


def prepare_dst(dst, job: str, overwrite: bool) -> str:
    """-> "fresh" | "resume" | "done" (the same job already complete). Refuses to touch anything else. `dst`:
    a storage.LocalDir or GcsDir."""
    if not dst.remote and dst.path.exists() and not dst.path.is_dir():
        raise ConvertError(f"DST {dst} exists and is not a directory")
    manifest = dst.read(MANIFEST)
    if manifest is not None or dst.any():
        if manifest is not None:
            same = _job_of(manifest) == job
            if not overwrite:
                if same:
                    dst.delete(PROGRESS)  # left by a kill just after completion
                    return "done"
                raise ConvertError(f"DST {dst} is a complete k2jax checkpoint (of another source or dtype): "
                                   f"pass --overwrite to replace it")
            dst.remove(MANIFEST)  # first: from here on it no longer passes for complete
        elif dst.any(PROGRESS):
            if _job_of(dst.read(f"{PROGRESS}/job.json")) == job:
                _remove_partial_writes(dst)
                return "resume"  # even with --overwrite: a rerun of the same command must not lose work
            if not overwrite:
                raise ConvertError(f"DST {dst} holds an unfinished conversion of another source or dtype: pass "
                                   f"--overwrite to discard it")
        else:
            raise ConvertError(f"DST {dst} exists, is not empty and is not a k2jax checkpoint: refusing to write "
                               f"into it (even with --overwrite); choose an empty or new directory")
        dst.delete()
    try:
        dst.write(f"{PROGRESS}/job.json", json.dumps({"job": job}).encode())
    except OSError as e:
        raise ConvertError(f"DST {dst}: cannot write there: {getattr(e, 'strerror', None) or e}") from None
    return "fresh"


def _job_of(raw: bytes | None) -> str | None:
    try:
        return json.loads(raw).get("job") if raw is not None else None
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return None


def _remove_partial_writes(dst) -> None:
    """Delete what a killed write leaves in a local DST (tensorstore's lock and temp files, our chunks' temporary
    names; chunks land by rename, so a chunk file itself is whole or absent): the resumed checkpoint then has
    exactly a fresh run's files. (On gs:// an object is whole or absent: nothing is left.)"""
    if dst.remote:
        return
    for leaf in os.scandir(dst.path):
        if leaf.is_dir() and leaf.name != PROGRESS:
            for f in os.scandir(leaf.path):
                if ".__lock" in f.name or ".__tmp_" in f.name:
                    os.unlink(f.path)
