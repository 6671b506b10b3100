"""The converter's writer: each slot of a leaf's zarr array written as the chunk files tensorstore would write,
with O_DIRECT where the filesystem allows it (see ChunkWriter), or as objects of a gs:// DST through tensorstore's
gcs kvstore. The layout is k2jax.checkpoint.orbax_layout's."""

from __future__ import annotations

import errno
import itertools
import os

import numpy as np
import tensorstore as ts

from k2jax.checkpoint.safetensors_io import ALIGN
from k2jax.checkpoint.storage import open_dir

CHUNK_TMP = ".__tmp_k2jax"  # a chunk being written; renamed into place when whole


def open_array(dst, name: str, spec: dict, create: bool):
    """The zarr array of one leaf (`spec`: {"shape", "dtype", "chunks"} as in the manifest) in DST (a path or a
    storage.LocalDir / GcsDir), created (its .zarray) if absent; a ValueError if an existing one does not match."""
    return ts.open({"driver": "zarr", "kvstore": open_dir(dst).kvstore(name),
                    "metadata": {"shape": spec["shape"], "chunks": spec["chunks"], "compressor": None,
                                 "dtype": np.dtype(spec["dtype"]).str if spec["dtype"] in ("float32", "uint8")
                                 else spec["dtype"]}},
                   create=create, open=True, context=ts.Context({"cache_pool": {"total_bytes_limit": 0}})).result()


class ChunkWriter:
    """Writes one slot of a leaf's zarr array (created by `open_array`) as its chunk files, exactly the files
    tensorstore writes for an uncompressed zarr v2 array: each chunk's C-order bytes, named by its grid index
    joined with '.' (e.g. 3.17.0.0). Each chunk goes to a temporary name and is renamed into place, so a
    chunk file is whole or absent.

    With direct=True chunks are written with O_DIRECT where the filesystem allows it: a conversion writes
    every byte once and never reads it back, and filling the page cache (page allocation, reclaim and
    writeback) costs more CPU than the conversion itself; the data goes from our buffer to the disk.
    """

    def __init__(self, dst, leaves: dict[str, dict], direct: bool):
        d = open_dir(dst)
        self.remote = d if d.remote else None  # a GcsDir: chunks are objects, written whole by one request
        self.dst, self.leaves = (None if d.remote else d.path), leaves
        self.direct = direct and hasattr(os, "O_DIRECT") and not d.remote

    def write(self, name: str, index: tuple[int, ...], x: np.ndarray, scratch, start=None) -> None:
        """Write x, C-contiguous, as the part of the slot `index` (leading stacked axes) of leaf `name` that
        begins at `start` (default: all of the slot), a part made of whole chunks. scratch: a
        safetensors_io.Scratch for chunks that need a copy (not contiguous in x, or x not aligned)."""
        spec = self.leaves[name]
        shape, chunks = spec["shape"][len(index):], spec["chunks"][len(index):]
        start = (0,) * len(shape) if start is None else tuple(start)
        if len(x.shape) != len(shape) or any(s % c or e % c or s + e > d
                                             for s, e, c, d in zip(start, x.shape, chunks, shape)):
            raise ValueError(f"{name}: part {x.shape} at {start} of slot {index} {shape} is not whole chunks "
                             f"{chunks}")
        for cell in itertools.product(*[range(e // c) for e, c in zip(x.shape, chunks)]):
            part = x[tuple(slice(i * c, (i + 1) * c) for i, c in zip(cell, chunks))]
            if not part.flags.c_contiguous or (self.direct and part.ctypes.data % ALIGN):
                buf = scratch.array("chunk", part.shape, part.dtype)
                np.copyto(buf, part)
                part = buf
            key = ".".join(str(i) for i in (*index, *(s // c + i for s, c, i in zip(start, chunks, cell))))
            if self.remote is not None:
                self.remote.write(f"{name}/{key}", part.reshape(-1).view(np.uint8).tobytes())
            else:
                self._write_file(os.path.join(self.dst, name, key), part.reshape(-1).view(np.uint8))

    def _write_file(self, path: str, data: np.ndarray) -> None:
        tmp = path + CHUNK_TMP
        mv = memoryview(data)
        head = len(mv) - len(mv) % ALIGN if self.direct else 0  # O_DIRECT: whole blocks; the rest buffered
        fd, direct = self._open(tmp, head > 0)
        try:
            if direct:
                # Sized first, so the O_DIRECT write fills a hole instead of extending the file: an extending
                # direct write on ext4 costs twice the CPU (its size update goes through the journal per write)
                # and runs 30% slower.
                os.ftruncate(fd, len(mv))
                try:
                    _pwrite_all(fd, mv[:head], 0)
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    self.direct, head = False, 0  # the filesystem refuses O_DIRECT writes after all
                if head < len(mv):
                    import fcntl  # POSIX only, and only reached where O_DIRECT exists (not on Windows)

                    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            else:
                head = 0
            _pwrite_all(fd, mv[head:], head)
        finally:
            os.close(fd)
        os.replace(tmp, path)

    def _open(self, path: str, direct: bool) -> tuple[int, bool]:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_BINARY", 0)
        if direct:
            try:
                return os.open(path, flags | os.O_DIRECT, 0o666), True
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self.direct = False  # e.g. tmpfs
        return os.open(path, flags, 0o666), False


def _pwrite_all(fd: int, mv: memoryview, offset: int) -> None:
    if not hasattr(os, "pwrite"):  # Windows
        os.lseek(fd, offset, os.SEEK_SET)
    while len(mv):
        k = os.pwrite(fd, mv, offset) if hasattr(os, "pwrite") else os.write(fd, mv)
        mv, offset = mv[k:], offset + k
