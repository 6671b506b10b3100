"""Safetensors checkpoints: index, headers (parsed and validated here), lazy per-tensor reads.

File layout: 8-byte little-endian header length n, n bytes of JSON {name: {dtype, shape, data_offsets},
"__metadata__": {...}}, then the data; offsets are relative to the end of the header. Headers are parsed
here, not by the safetensors library, so that every error names the file and the tensor.

A file is local (SafetensorsFile) or remote (RemoteSafetensorsFile: a gs:// object, or a Hugging Face Hub file
read for its header only, through an fsspec filesystem: gcsfs, huggingface_hub's HfFileSystem): a remote read is
one ranged request for just the bytes asked for, never a download of the file. A checkpoint's files come from a
`FileSource` (k2jax.checkpoint.hf_source): a local directory, a gs:// prefix, or a Hub repo.

Local reads use os.pread on one descriptor per file (no shared file position): `read` may be called from many
threads at once, one tensor per call. With direct=True (the converter) tensor data is read with O_DIRECT,
bypassing the page cache: a streaming pass reads every byte once, and filling the page cache costs more CPU
than the copy itself (page allocation and reclaim), which is what bounds a conversion on a few cores.
"""

from __future__ import annotations

import errno
import functools
import json
import math
import os
import pathlib
import struct
import sys
import threading
from typing import NamedTuple

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# The safetensors library refuses headers above 100 MB; a length beyond that is corruption, not a header.
MAX_HEADER_BYTES = 100_000_000

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"), "U32": np.dtype("<u4"), "U16": np.dtype("<u2"), "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}

# O_DIRECT: buffer address, file offset and length in multiples of this (covers 512 B and 4 KiB sectors).
ALIGN = 4096
# Smaller tensors (FP8 scales, norms) are read through the page cache even with direct=True: a disk request
# each would cost more than the copy, and the scales the verification read are still there for the conversion.
DIRECT_MIN_BYTES = 256 << 10

if sys.byteorder != "little":  # bfloat16 / float8 have no byte-swapped numpy dtypes
    raise ImportError("k2jax.checkpoint.safetensors_io needs a little-endian host")


class SafetensorsError(ValueError):
    """A malformed safetensors file or index; the message names the file (and tensor)."""


class TensorInfo(NamedTuple):
    """One tensor's header entry. begin/end are absolute byte offsets in `file`."""

    name: str
    dtype: str  # safetensors code, e.g. "BF16", "F8_E4M3"
    shape: tuple[int, ...]
    begin: int
    end: int
    file: str

    @property
    def np_dtype(self) -> np.dtype:
        return DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


# ------------------------------------------------------------------------------------------------------
def aligned_empty(nbytes: int) -> np.ndarray:
    """uint8 [nbytes rounded up to ALIGN], its address a multiple of ALIGN (what O_DIRECT needs)."""
    n = -(-nbytes // ALIGN) * ALIGN
    raw = np.empty(n + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start:start + n]


class Scratch:
    """Aligned buffers reused per thread and purpose: a fresh allocation per tensor costs a page fault per
    page (a few CPU-ns per byte on some VMs, as much as the work itself). Buffers above KEEP_BYTES are not
    kept, so memory stays a few tensors' worth."""

    KEEP_BYTES = 80 << 20  # a chunk (orbax_layout.CHUNK_BYTES) and then some

    def __init__(self):
        self._local = threading.local()

    def get(self, purpose: str, nbytes: int) -> np.ndarray:
        """uint8 [>= nbytes, a multiple of ALIGN], aligned; valid until this thread's next get(purpose)."""
        bufs = self._local.__dict__.setdefault("bufs", {})
        buf = bufs.get(purpose)
        if buf is None or buf.nbytes < nbytes:
            buf = aligned_empty(nbytes)
            if buf.nbytes <= self.KEEP_BYTES:
                bufs[purpose] = buf
        return buf[:-(-nbytes // ALIGN) * ALIGN]

    def array(self, purpose: str, shape, dtype) -> np.ndarray:
        """An aligned C-contiguous array of `shape`, `dtype` from get(purpose)."""
        dtype = np.dtype(dtype)
        n = math.prod(shape) * dtype.itemsize
        return self.get(purpose, n)[:n].view(dtype).reshape(shape)


class Lent(Scratch):
    """A Scratch that hands out one given buffer (uint8, aligned, at least `read_size` bytes) for every purpose:
    `read(name, Lent(buf))` fills buf (the converter's reads go into buffers it lends and takes back)."""

    def __init__(self, buf: np.ndarray):
        super().__init__()
        self.buf = buf

    def get(self, purpose: str, nbytes: int) -> np.ndarray:
        n = -(-nbytes // ALIGN) * ALIGN
        if n > self.buf.nbytes:
            raise ValueError(f"Lent: {nbytes} bytes asked of a buffer of {self.buf.nbytes}")
        return self.buf[:n]


def _no_duplicate_keys(pairs):
    keys = [k for k, _ in pairs]
    if len(keys) != len(set(keys)):
        dup = next(k for k in keys if keys.count(k) > 1)
        raise SafetensorsError(f"duplicate key {dup!r}")
    return dict(pairs)


def parse_header(raw: bytes, file_size: int, where: str) -> tuple[dict[str, TensorInfo], dict]:
    """Validate a header (the JSON bytes) of a file of `file_size` bytes -> ({name: TensorInfo}, metadata)."""
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except SafetensorsError as e:
        raise SafetensorsError(f"{where}: header: {e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(f"{where}: header is not valid UTF-8 JSON: {e}") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{where}: header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise SafetensorsError(f"{where}: __metadata__ is not an object")
    data_start = 8 + len(raw)
    data_size = file_size - data_start
    tensors = {}
    for name, entry in header.items():
        def bad(why):
            return SafetensorsError(f"{where}: tensor {name!r}: {why}")
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
            raise bad(f"entry must have dtype, shape and data_offsets, got {entry!r}")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in DTYPES:
            raise bad(f"unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise bad(f"shape must be a list of non-negative integers, got {shape!r}")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise bad(f"data_offsets must be [begin, end] with 0 <= begin <= end, got {offsets!r}")
        nbytes = math.prod(shape) * DTYPES[dtype].itemsize
        if offsets[1] - offsets[0] != nbytes:
            raise bad(f"data_offsets {offsets} span {offsets[1] - offsets[0]} bytes, but {dtype} {shape} "
                      f"needs {nbytes}")
        if offsets[1] > data_size:
            raise bad(f"data ends at byte {offsets[1]} of the data section, which has only {data_size} bytes "
                      f"(file truncated or offsets corrupt)")
        tensors[name] = TensorInfo(name, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1],
                                   where)
    spans = sorted((t.begin, t.end, t.name) for t in tensors.values() if t.end > t.begin)
    for (_, e0, n0), (b1, _, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise SafetensorsError(f"{where}: tensors {n0!r} and {n1!r} overlap")
    return tensors, metadata


class SafetensorsFile:
    """One .safetensors file: header validated on open, tensors read lazily and thread-safely; with direct=True
    tensor data is read with O_DIRECT where the filesystem allows it (else through the page cache)."""

    def __init__(self, path: str | os.PathLike, direct: bool = False):
        self.path = os.fspath(path)
        self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        self._dfd = -1  # the O_DIRECT descriptor, if any
        self._direct = False  # reads use it (until the filesystem refuses one)
        self._lock = threading.Lock()  # only for platforms without os.pread
        try:
            self.size = os.fstat(self._fd).st_size
            self.tensors, self.metadata = self._read_header()
            if direct and hasattr(os, "O_DIRECT") and hasattr(os, "preadv"):
                try:
                    self._dfd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
                    self._direct = True
                except OSError:  # e.g. tmpfs: EINVAL
                    pass
        except BaseException:
            self.close()
            raise

    def _read_header(self):
        where = self.path
        if self.size < 8:
            raise SafetensorsError(f"{where}: only {self.size} bytes, too short for a safetensors file")
        (n,) = struct.unpack("<Q", self._pread(8, 0))
        if n == 0 or n > MAX_HEADER_BYTES:
            raise SafetensorsError(f"{where}: header length {n} is absurd (limit {MAX_HEADER_BYTES}, file is "
                                   f"{self.size} bytes): not a safetensors file, or a corrupt one")
        if 8 + n > self.size:
            raise SafetensorsError(f"{where}: header length {n} runs past the end of the file ({self.size} "
                                   f"bytes): file truncated")
        return parse_header(self._pread(n, 8), self.size, where)

    def _pread(self, n: int, offset: int, out: memoryview | None = None) -> bytes | memoryview:
        buf = memoryview(bytearray(n)) if out is None else out
        got = 0
        while got < n:
            if hasattr(os, "preadv"):
                k = os.preadv(self._fd, [buf[got:]], offset + got)
            else:
                with self._lock:
                    os.lseek(self._fd, offset + got, os.SEEK_SET)
                    k = os.readv(self._fd, [buf[got:]])
            if k == 0:
                raise SafetensorsError(f"{self.path}: unexpected end of file at byte {offset + got} "
                                       f"(file shrank or truncated)")
            got += k
        return buf if out is not None else bytes(buf)

    def span(self, name: str, rows: tuple[int, int] | None = None) -> tuple[TensorInfo, tuple[int, ...], int, int]:
        """(info, shape, begin, end) of the tensor `name`, or of its rows [a, b) (a contiguous part)."""
        info = self.tensors.get(name)
        if info is None:
            raise KeyError(f"{self.path}: no tensor {name!r}")
        shape, begin, end = info.shape, info.begin, info.end
        if rows is not None:
            if not shape or not 0 <= rows[0] <= rows[1] <= shape[0]:
                raise ValueError(f"{self.path}: tensor {name!r} {list(shape)}: no rows {rows}")
            row = math.prod(shape[1:]) * info.np_dtype.itemsize
            shape, begin, end = (rows[1] - rows[0], *shape[1:]), begin + rows[0] * row, begin + rows[1] * row
        return info, shape, begin, end

    def read_size(self, name: str, rows: tuple[int, int] | None = None) -> int:
        """Bytes `read(name, scratch, rows)` takes from its scratch (an O_DIRECT read: the aligned span around
        the data, whole blocks)."""
        _, _, begin, end = self.span(name, rows)
        if not self._direct or end - begin < DIRECT_MIN_BYTES:
            return end - begin
        return -(-(end - (begin - begin % ALIGN)) // ALIGN) * ALIGN

    def read(self, name: str, scratch: Scratch | None = None, rows: tuple[int, int] | None = None) -> np.ndarray:
        """The tensor `name` (or its rows [a, b) when rows=(a, b): a contiguous part) as a writable numpy array
        (bf16/fp8 as ml_dtypes types): a fresh one, or with `scratch` a view of its "read" buffer (valid until
        this thread's next read with it)."""
        info, shape, begin, end = self.span(name, rows)
        if not self._direct or end - begin < DIRECT_MIN_BYTES:
            arr = np.empty(shape, info.np_dtype) if scratch is None else scratch.array("read", shape, info.np_dtype)
            if end > begin:
                self._pread(end - begin, begin, memoryview(arr.reshape(-1).view(np.uint8)))
            return arr
        # O_DIRECT: read the aligned span around the tensor, return the tensor's part of it
        start = begin - begin % ALIGN
        need = end - start
        buf = aligned_empty(need) if scratch is None else scratch.get("read", need)
        self._pread_direct(buf, start, need)
        return buf[begin - start:need].view(info.np_dtype).reshape(shape)

    def _pread_direct(self, buf: np.ndarray, offset: int, need: int) -> None:
        """Read at least `need` bytes at `offset` (aligned) into `buf` (aligned, a whole number of blocks
        long, maybe past the end of the file: a read at the end returns short)."""
        mv, got = memoryview(buf), 0
        while got < need:
            if got % ALIGN:  # a short read before the end (not expected): finish through the page cache
                self._pread(need - got, offset + got, mv[got:need])
                return
            try:
                k = os.preadv(self._dfd, [mv[got:]], offset + got)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._direct = False  # the filesystem refuses O_DIRECT reads after all
                self._pread(need - got, offset + got, mv[got:need])
                return
            if k == 0:
                raise SafetensorsError(f"{self.path}: unexpected end of file at byte {offset + got} "
                                       f"(file shrank or truncated)")
            got += k

    def close(self):
        for attr in ("_fd", "_dfd"):
            if getattr(self, attr, -1) >= 0:
                os.close(getattr(self, attr))
                setattr(self, attr, -1)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class RemoteSafetensorsFile(SafetensorsFile):
    """A .safetensors file in object storage or on the Hub, read through an fsspec filesystem `fs` (thread-safe:
    gcsfs and HfFileSystem run their requests on their own event loop or session): the header with two ranged
    reads on open, each tensor (or rows of it) with one ranged read of exactly its bytes. `name` is what
    messages call it (e.g. its gs:// URL); `size`, if known, saves a metadata request. `errors` turns a client
    error into one naming the file."""

    def __init__(self, fs, path: str, name: str, size: int | None = None, errors=None):
        self.fs, self.key, self.path = fs, path, name
        self._errors = errors or (lambda e: e)
        self._fd = self._dfd = -1
        self._direct = False
        self.size = self._call(lambda: fs.size(path)) if size is None else size
        self.tensors, self.metadata = self._read_header()

    def _call(self, fn):
        try:
            return fn()
        except SafetensorsError:
            raise
        except Exception as e:  # noqa: BLE001 - the client's own error types, named by `errors`
            raise self._errors(e) from None

    def _pread(self, n: int, offset: int, out: memoryview | None = None) -> bytes | memoryview:
        data = self._call(lambda: self.fs.cat_file(self.key, start=offset, end=offset + n)) if n else b""
        if len(data) != n:
            raise SafetensorsError(f"{self.path}: unexpected end of object at byte {offset + len(data)} (wanted "
                                   f"{n} bytes at {offset}; the object shrank or is truncated)")
        if out is None:
            return bytes(data)
        out[:n] = data
        return out


# ------------------------------------------------------------------------------------------------------
class LocalFiles:
    """The files of a local checkpoint directory (the FileSource interface; remote ones are in
    k2jax.checkpoint.hf_source): `name(f)` is what messages call file `f`, `exists(f)`, `read(f)` its bytes,
    `open(f, direct)` a SafetensorsFile."""

    def __init__(self, root: str | os.PathLike):
        self.root = pathlib.Path(root)

    def __str__(self) -> str:
        return str(self.root)

    def name(self, f: str) -> str:
        return str(self.root / f)

    def exists(self, f: str) -> bool:
        return (self.root / f).is_file()

    def read(self, f: str) -> bytes:
        return (self.root / f).read_bytes()

    def open(self, f: str, direct: bool = False) -> SafetensorsFile:
        return SafetensorsFile(self.root / f, direct)

    def fetch(self, files) -> None:
        """Nothing to fetch: the files are here."""


class Checkpoint:
    """A HuggingFace safetensors checkpoint: a directory with `model.safetensors.index.json` (sharded) or
    `model.safetensors`, a single .safetensors file, or the same files elsewhere (`source`, a FileSource:
    k2jax.checkpoint.hf_source).

    `tensors` maps every readable tensor name to its TensorInfo; `problems` lists inconsistencies between
    the index and the files (each naming tensor and file), for the caller to report with its own;
    `unavailable` holds the indexed names those problems make unreadable (not to be reported again as
    missing). A malformed file raises SafetensorsError at once.
    """

    def __init__(self, path, direct: bool = False):
        self.direct = direct  # read tensor data with O_DIRECT (see SafetensorsFile)
        if isinstance(path, (str, os.PathLike)):
            self.path = pathlib.Path(path)
            single = self.path.is_file()
            self.source = LocalFiles(self.path.parent if single else self.path)
        else:
            self.source, single = path, False
            self.path = str(path)
        self.problems: list[str] = []
        self.files: dict[str, SafetensorsFile] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self.unavailable: set[str] = set()
        try:
            self._open(self.path.name if single else None)
        except BaseException:
            self.close()
            raise

    def _open(self, single: str | None):
        src = self.source
        if single is not None or not src.exists(INDEX_NAME):
            single = single or SINGLE_NAME
            if not src.exists(single):
                raise FileNotFoundError(f"{src}: neither {INDEX_NAME} nor {SINGLE_NAME} found")
            self._open_files([single])
            self.tensors = self._all_tensors()
            return
        weight_map = parse_index(src.read(INDEX_NAME), src.name(INDEX_NAME))
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not src.exists(f)]
        for f in missing:
            names = [k for k, v in weight_map.items() if v == f]
            self.problems.append(f"{INDEX_NAME} maps {len(names)} tensor(s) (e.g. {names[0]!r}) to {f}, "
                                 f"which does not exist")
        self._open_files([f for f in files if f not in missing])
        found = self._all_tensors()
        for name, f in weight_map.items():
            info = self.files[f].tensors.get(name) if f in self.files else None
            if info is not None:
                self.tensors[name] = info
                continue
            self.unavailable.add(name)
            if name in found:
                self.problems.append(f"tensor {name!r}: {INDEX_NAME} maps it to {f}, but it is in "
                                     f"{self._base(found[name].file)}")
            elif f in self.files:
                self.problems.append(f"tensor {name!r}: {INDEX_NAME} maps it to {f}, whose header lacks it")
        for name, info in found.items():
            if name not in weight_map:
                self.problems.append(f"tensor {name!r} in {self._base(info.file)} is not listed in "
                                     f"{INDEX_NAME}")

    def _open_files(self, names: list[str]):
        for f in names:
            self.files[f] = self.source.open(f, self.direct)
            self._by_name[self.files[f].path] = f

    @functools.cached_property
    def _by_name(self) -> dict[str, str]:
        """A file's full name (TensorInfo.file) -> its name in the checkpoint."""
        return {}

    def _base(self, file: str) -> str:
        return self._by_name.get(file) or os.path.basename(file)

    def _all_tensors(self) -> dict[str, TensorInfo]:
        """Union of the files' headers; a name in two files is reported (the first file keeps it)."""
        out: dict[str, TensorInfo] = {}
        for f, sf in self.files.items():
            for name, info in sf.tensors.items():
                if name in out:
                    self.problems.append(f"tensor {name!r} is in two files: "
                                         f"{self._base(out[name].file)} and {f}")
                else:
                    out[name] = info
        return out

    def file_of(self, name: str) -> str:
        return self._base(self.tensors[name].file)

    def read_size(self, name: str, rows: tuple[int, int] | None = None) -> int:
        """Bytes a `read` of the tensor (or its rows) takes from its scratch (see SafetensorsFile.read_size)."""
        return self.files[self.file_of(name)].read_size(name, rows)

    def read(self, name: str, scratch: Scratch | None = None, rows: tuple[int, int] | None = None) -> np.ndarray:
        """One tensor (or some of its rows) as numpy (thread-safe; see SafetensorsFile.read)."""
        return self.files[self.file_of(name)].read(name, scratch, rows)

    def close(self):
        for sf in self.files.values():
            sf.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_index(path: str | os.PathLike) -> dict[str, str]:
    """`model.safetensors.index.json` -> weight_map {tensor name: file name}, validated."""
    return parse_index(pathlib.Path(path).read_bytes(), path)


def parse_index(raw: bytes, path) -> dict[str, str]:
    """The bytes of `model.safetensors.index.json` (at `path`, for messages) -> weight_map, validated."""
    try:
        index = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SafetensorsError(f"{path}: not valid JSON: {e}") from None
    wm = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise SafetensorsError(f"{path}: expected {{'weight_map': {{tensor name: file name}}}}")
    for name, f in wm.items():
        # File names are plain names next to the index; anything else would read outside the checkpoint.
        if f != os.path.basename(f) or f in ("", ".", ".."):
            raise SafetensorsError(f"{path}: tensor {name!r} maps to {f!r}, not a file name in this directory")
    return wm


def write_file(path: str | os.PathLike, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None):
    """Write a .safetensors file with the reference library (so files we read are the ones others write)."""
    # (not np.ascontiguousarray: it turns 0-d arrays into 1-d)
    save_file({k: v if v.flags.c_contiguous else v.copy(order="C") for k, v in tensors.items()},
              os.fspath(path), metadata=metadata)
