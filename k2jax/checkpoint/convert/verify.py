"""Verification of the source before anything is written: the files and headers, every tensor against the
config (k2jax.checkpoint.hf_validate), what the chosen --dtype needs, the --layers range, and the job's
fingerprint. SRC is a local directory, a gs:// URL or a Hugging Face repo id (k2jax.checkpoint.hf_source)."""

from __future__ import annotations

import hashlib
import json
import re

from k2jax.checkpoint.convert.errors import ConvertError
from k2jax.checkpoint.hf_source import open_source, safetensors_files
from k2jax.checkpoint.hf_validate import Validation, check_checkpoint, raise_problems
from k2jax.checkpoint.orbax_layout import CONVERSIONS, LAYOUT_VERSION
from k2jax.checkpoint.safetensors_io import INDEX_NAME, SINGLE_NAME, Checkpoint
from k2jax.config import K2Config
from k2jax.quant_policy import FORMATS

DTYPES = tuple(CONVERSIONS)


def raise_all(problems: list[str], where) -> None:
    """ConvertError listing every problem (none: nothing raised); nothing has been written when it raises."""
    raise_problems(problems, where, ConvertError, "problem(s), nothing converted")


def open_files(src, revision: str | None = None, quiet: bool = False):
    """(FileSource, config.json dict) of SRC: a local directory, a gs:// URL or a Hub repo id (hf_source)."""
    try:
        return open_source(src, revision, quiet)
    except (FileNotFoundError, NotADirectoryError, PermissionError) as e:
        raise ConvertError(f"SRC {e}") from None
    except OSError as e:
        raise ConvertError(f"SRC {e}") from None


def open_checkpoint(files, direct: bool = False) -> Checkpoint:
    """The checkpoint of a FileSource (tensor data read with O_DIRECT if `direct`, where local); every unreadable
    header is reported together."""
    if not files.exists(INDEX_NAME) and not files.exists(SINGLE_NAME):
        raise ConvertError(f"SRC {files}: neither {INDEX_NAME} nor {SINGLE_NAME} found")
    problems = []
    opened = {}
    for f in safetensors_files(files):
        if not files.exists(f):
            continue  # reported by Checkpoint with the tensors it was meant to hold
        try:
            opened[f] = files.open(f, direct)
        except (ValueError, OSError) as e:
            problems.append(str(e))
    if problems:
        for sf in opened.values():
            sf.close()
    raise_all(problems, files)
    return Checkpoint(_Opened(files, opened), direct)


class _Opened:
    """A FileSource whose safetensors files are already open (their headers read once, not twice)."""

    def __init__(self, files, opened: dict):
        self.files, self.opened = files, opened

    def __str__(self) -> str:
        return str(self.files)

    def __getattr__(self, attr):
        return getattr(self.files, attr)

    def open(self, f: str, direct: bool = False):
        return self.opened.pop(f) if f in self.opened else self.files.open(f, direct)


def check_source(cfg: K2Config, ckpt: Checkpoint, src, dtype: str, prefix: str, read_data: bool = True) -> Validation:
    """Validate the whole source for a `--dtype` conversion (every header; the scales' values too unless
    read_data is False: see hf_validate.data_problems); ConvertError listing every problem."""
    checked = check_checkpoint(cfg, ckpt, prefix=prefix, read_data=read_data)
    problems = list(checked.problems)
    if dtype == "float8":
        problems += [f"{s.stored!r} ({ckpt.file_of(s.stored)}): {s.dtype}, but --dtype float8 keeps "
                     f"the release's F8_E4M3 weights (convert a float checkpoint with --dtype bfloat16)"
                     for s in checked.sources if s.target.fp8 and s.dtype != "F8_E4M3"]
        if tuple(checked.block) != FORMATS["fp8"].block and not problems:
            problems.append(f"config.json: weight_block_size {list(checked.block)}: --dtype float8 stores the "
                            f"{FORMATS['fp8'].block} blocks k2jax holds (k2jax.quant_policy); convert with "
                            f"--dtype bfloat16")
    if dtype == "int4":
        problems += [f"{s.stored!r} ({ckpt.file_of(s.stored)}): {s.dtype}, but --dtype int4 keeps the INT4 routed "
                     f"experts of a pack-quantized checkpoint (Kimi-K2-Thinking) as stored; convert an FP8 "
                     f"release with --dtype float8 and load it with quant='int4' (requantized, lossy)"
                     for s in checked.sources if s.target.int4 and s.dtype != "INT4"][:1]
    raise_all(problems, src)
    return checked


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


def fingerprint(config: bytes, ckpt: Checkpoint, dtype: str) -> str:
    """What makes a conversion's bytes: the source (config.json's bytes, file names and sizes, every header, not
    where they are: the same release on disk, in a bucket or on the Hub is the same job), the output dtype and
    the layout. A rerun resumes only a job with the same fingerprint."""
    h = hashlib.sha256()
    h.update(config)
    for f in sorted(ckpt.files):
        sf = ckpt.files[f]
        h.update(json.dumps([f, sf.size, sorted(t[:-1] for t in sf.tensors.values())]).encode())  # (not t.file)
    h.update(json.dumps([dtype, LAYOUT_VERSION]).encode())
    return h.hexdigest()
