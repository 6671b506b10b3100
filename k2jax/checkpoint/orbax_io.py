"""The converted checkpoint on disk: a standard Orbax checkpoint written slot by slot, its manifest, restore.

Layout of a converted directory DST (layout version 1):

    DST/_METADATA                 Orbax tree metadata (plain, non-OCDBT PyTree checkpoint)
    DST/<a.b.c>/                  one zarr (v2) array per param leaf, named by its '.'-joined tree path,
                                  at its final (stacked) shape, e.g. moe_layers.mlp.experts.gate_proj [L, E, D, F]
    DST/config.json               the model's HF config
    DST/k2jax_manifest.json       written last, atomically: the completion marker (see `MANIFEST`)
    DST/.k2jax_convert/           only while converting: the job and the units already written (resume state)

Arrays are chunked one (layer, expert) slot at a time ([1, 1, D, F] for experts), with big dims split so a
chunk stays under CHUNK_BYTES. So the converter writes each HF tensor into whole chunks of the stacked array
(no read-modify-write, bounded memory), and a restore with target shardings reads, per device, only the
chunks its shard touches (no full copy anywhere; the MoE weights exist once).

Plain Orbax reads it without k2jax:

    import orbax.checkpoint as ocp
    params = ocp.StandardCheckpointer().restore(DST, abstract)   # abstract: ShapeDtypeStructs with .sharding

where `abstract` is `k2jax.abstract_params(cfg, dtype)` with a sharding set on each leaf (a different dtype
than stored is cast on read). Without shardings Orbax returns numpy arrays. A `float8` conversion holds
e4m3 weights plus `<name>_scale_inv` float32 leaves beside them (see `fp8_leaves`); an `int4` conversion
holds the routed experts as uint8 leaves of two 4-bit values each plus `<name>_scale` bfloat16 leaves (see
`int4_leaves`): restore those leaves with the manifest's shapes and dtypes ("leaves"), not abstract_params'.
"""

from __future__ import annotations

import errno
import itertools
import json
import math
import os
import pathlib
from typing import Any

import ml_dtypes
import numpy as np

LAYOUT_VERSION = 1
MANIFEST = "k2jax_manifest.json"
PROGRESS = ".k2jax_convert"
ORBAX_METADATA = "_METADATA"
CHUNK_BYTES = 64 << 20
# Default bound on the shard reads a restore has in flight (host memory), see `restore`.
MAX_INFLIGHT_BYTES = 8 << 30
SCALE_SUFFIX = "_scale_inv"
INT4_SCALE_SUFFIX = "_scale"

_DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32),
           "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn), "uint8": np.dtype(np.uint8)}


class IncompleteCheckpointError(ValueError):
    """The directory is not a complete converted checkpoint (interrupted, or not a conversion at all)."""


def dtype_name(dt) -> str:
    return np.dtype(dt).name


def leaf_name(path: tuple[str, ...]) -> str:
    """('moe_layers', 'mlp', 'experts', 'gate_proj') -> 'moe_layers.mlp.experts.gate_proj' (Orbax's name)."""
    return ".".join(path)


def chunk_shape(shape: tuple[int, ...], stack_axes: int, itemsize: int) -> tuple[int, ...]:
    """One slot of the leading `stack_axes` (layer, expert) per chunk; then halve the largest even dim until a
    chunk is at most CHUNK_BYTES (so a sharded restore reads about its shard, not the whole slot)."""
    chunk = [1] * stack_axes + list(shape[stack_axes:])
    while math.prod(chunk) * itemsize > CHUNK_BYTES:
        dims = [i for i in range(stack_axes, len(chunk)) if chunk[i] % 2 == 0]
        if not dims:
            break
        i = max(dims, key=lambda i: chunk[i])
        chunk[i] //= 2
    return tuple(chunk)


# ------------------------------------------------------------------------------------------------------
# Writing (used by k2jax.checkpoint.convert)
CHUNK_TMP = ".__tmp_k2jax"  # a chunk being written; renamed into place when whole


def open_array(dst: pathlib.Path, name: str, spec: dict, create: bool):
    """The zarr array of one leaf (`spec`: {"shape", "dtype", "chunks"} as in the manifest), created (its
    .zarray) if absent; a ValueError if an existing one does not match."""
    import tensorstore as ts

    return ts.open({"driver": "zarr", "kvstore": {"driver": "file", "path": os.fspath(dst / name)},
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

    def __init__(self, dst: pathlib.Path, leaves: dict[str, dict], direct: bool):
        self.dst, self.leaves = dst, leaves
        self.direct = direct and hasattr(os, "O_DIRECT")

    def write(self, name: str, index: tuple[int, ...], x: np.ndarray, scratch, start=None) -> None:
        """Write x, C-contiguous, as the part of the slot `index` (leading stacked axes) of leaf `name` that
        begins at `start` (default: all of the slot), a part made of whole chunks. scratch: a
        safetensors_io.Scratch for chunks that need a copy (not contiguous in x, or x not aligned)."""
        from k2jax.checkpoint.safetensors_io import ALIGN

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
            self._write_file(os.path.join(self.dst, name, key), part.reshape(-1).view(np.uint8))

    def _write_file(self, path: str, data: np.ndarray) -> None:
        from k2jax.checkpoint.safetensors_io import ALIGN

        tmp = path + CHUNK_TMP
        mv = memoryview(data)
        head = len(mv) - len(mv) % ALIGN if self.direct else 0  # O_DIRECT: whole blocks; the rest buffered
        fd, direct = self._open(tmp, head > 0)
        try:
            if direct:
                try:
                    _pwrite_all(fd, mv[:head], 0)
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    self.direct, head = False, 0  # the filesystem refuses O_DIRECT writes after all
                if head < len(mv):
                    import fcntl  # (Linux: O_DIRECT exists)

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


def write_orbax_metadata(dst: pathlib.Path, leaves: dict[str, dict]) -> None:
    """Orbax's `_METADATA` for the leaves (name -> spec): what `PyTreeCheckpointHandler` writes for a
    non-OCDBT zarr-v2 checkpoint of the same tree."""
    tree = {}
    for name, spec in leaves.items():
        keys = name.split(".")
        tree[str(tuple(keys))] = {
            "key_metadata": [{"key": k, "key_type": 2} for k in keys],  # 2 = dict key
            "value_metadata": {"value_type": "jax.Array", "skip_deserialize": False, "write_shape": spec["chunks"]},
        }
    meta = {"tree_metadata": tree, "use_ocdbt": False, "use_zarr3": False,
            "store_array_data_equal_to_fill_value": True, "custom_metadata": None}
    atomic_write(dst / ORBAX_METADATA, json.dumps(meta, indent=1))


def atomic_write(path: pathlib.Path, text: str) -> None:
    """Write, fsync, rename: a reader sees the old file or the whole new one, never a part."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------------------------
# Reading
def read_manifest(ckpt_dir: str | os.PathLike) -> dict:
    """The manifest of a complete conversion; IncompleteCheckpointError (with the reason) otherwise."""
    d = pathlib.Path(ckpt_dir)
    if not d.is_dir():
        raise FileNotFoundError(f"{d}: no such checkpoint directory")
    m = d / MANIFEST
    if not m.is_file():
        if (d / PROGRESS).is_dir():
            raise IncompleteCheckpointError(
                f"{d}: incomplete conversion (interrupted or still running; no {MANIFEST}): rerun the same "
                f"`k2jax convert` command to finish it")
        raise IncompleteCheckpointError(f"{d}: not a k2jax checkpoint (no {MANIFEST}); convert a HuggingFace "
                                        f"checkpoint with `k2jax convert SRC DST`, or use k2jax.load_hf")
    try:
        manifest = json.loads(m.read_text())
    except json.JSONDecodeError as e:
        raise IncompleteCheckpointError(f"{m}: corrupt manifest: {e}") from None
    if manifest.get("layout_version") != LAYOUT_VERSION:
        raise ValueError(f"{m}: layout version {manifest.get('layout_version')!r}, this k2jax reads "
                         f"{LAYOUT_VERSION}: convert again with this version")
    return manifest


def fp8_leaves(manifest: dict) -> dict[str, dict]:
    """float8 checkpoints: weight leaf name -> {"scale": scale leaf name, "in_ndim": k}. The weight is in k2jax
    layout; its first k slot dims flattened are HF's input dim, the rest its output dim, and the scale leaf is
    [*stack, ceil(in / block), ceil(out / block)] (HF's scale_inv transposed, like the weight)."""
    return manifest.get("fp8", {})


def int4_leaves(manifest: dict) -> dict[str, dict]:
    """int4 checkpoints: weight leaf name -> {"scale": scale leaf name, "in_ndim": 1}. The weight leaf is
    k2jax.ops.quant.QuantizedWeight's int4 values: uint8 [*stack, in, out/2], two 4-bit values (value + 8, low
    nibble first) per byte along the output dim; the scale leaf bfloat16 [*stack, in/32, out]."""
    return manifest.get("int4", {})


def _unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for name, v in flat.items():
        node = tree
        *head, last = name.split(".")
        for k in head:
            node = node.setdefault(k, {})
        node[last] = v
    return tree


def _flatten(tree, prefix=()) -> dict[str, Any]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out |= _flatten(v, prefix + (k,))
        else:
            out[leaf_name(prefix + (k,))] = v
    return out


def stored_array(ckpt_dir: str | os.PathLike, name: str) -> dict:
    """{"shape", "dtype", "chunks"} of one stored leaf, from the array's own zarr metadata."""
    path = pathlib.Path(ckpt_dir) / name / ".zarray"
    try:
        z = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise IncompleteCheckpointError(f"{ckpt_dir}: tensor {name}: cannot read its array metadata: {e}") from None
    return {"shape": list(z["shape"]), "dtype": np.dtype(z["dtype"]).name, "chunks": list(z["chunks"])}


def read_bytes(spec: dict, index: tuple[slice, ...]) -> int:
    """Bytes read from disk for the region `index` of a stored leaf: every chunk it touches, whole (the same
    estimate Orbax reserves against its in-flight limit)."""
    n = np.dtype(spec["dtype"]).itemsize
    for sl, dim, chunk in zip(index, spec["shape"], spec["chunks"]):
        start, stop, _ = sl.indices(dim)
        n *= -(-stop // chunk) * chunk - start // chunk * chunk
    return n


def restore(ckpt_dir: str | os.PathLike, target: dict, shardings: dict | None = None,
            max_inflight_bytes: int | None = None) -> dict:
    """Orbax restore of (a subset of) the stored leaves.

    target: nested dict of jax.ShapeDtypeStruct (shapes as stored; a different float dtype is cast on read).
    shardings: the same tree of jax.sharding.Sharding (e.g. `k2jax.sharding.param_shardings(cfg, mesh)`),
    or None for the first local device.

    What is read, and where it lives: each process reads, for each leaf, once per distinct shard among its own
    (addressable) devices, only the chunks that shard overlaps, into a host buffer of that one shard, and puts it
    on the devices that hold it. So of an expert stack a process reads only the (layer, expert) slots its
    devices hold (each slot whole when `tensor` splits it: one chunk), and no device receives more than its
    shard. Shard reads run concurrently, at most `max_inflight_bytes` of them at once (default
    MAX_INFLIGHT_BYTES, raised to fit the largest single read): the host memory a restore needs is that, not
    the model or an expert stack, even where one process's devices hold every expert.
    """
    import jax
    import orbax.checkpoint as ocp

    if shardings is None:
        one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        shardings = jax.tree.map(lambda _: one, target)
    flat_t, flat_s = _flatten(target), _flatten(shardings)
    largest = 0
    for name, t in flat_t.items():
        spec = stored_array(ckpt_dir, name)
        if tuple(spec["shape"]) != tuple(t.shape):
            raise ValueError(f"{ckpt_dir}: tensor {name}: requested shape {tuple(t.shape)}, stored "
                             f"{tuple(spec['shape'])}")
        for index in flat_s[name].addressable_devices_indices_map(t.shape).values():
            largest = max(largest, read_bytes(spec, index))
    # Orbax refuses a read of at least its limit, and starts one only while more than it is free.
    limit = max(MAX_INFLIGHT_BYTES if max_inflight_bytes is None else max_inflight_bytes, largest + 1)
    args = jax.tree.map(lambda s, sh: ocp.ArrayRestoreArgs(sharding=sh, global_shape=s.shape, dtype=s.dtype),
                        target, shardings)
    abstract = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), target, shardings)
    handler = ocp.PyTreeCheckpointHandler(restore_concurrent_gb=limit / 1e9)  # Orbax counts in units of 1e9 B
    with ocp.Checkpointer(handler) as ckptr:
        return ckptr.restore(os.path.abspath(ckpt_dir),
                             args=ocp.args.PyTreeRestore(item=abstract, restore_args=args))


def check_matches(ckpt_dir, manifest: dict, want: dict[str, Any], what: str) -> None:
    """Raise ValueError naming the first tensor (in tree order) where the checkpoint and `want` (leaf name ->
    ShapeDtypeStruct of the params of a config) differ: missing, unexpected, or another shape; `what` names
    the config in the message."""
    int4 = int4_leaves(manifest)
    scales = {f["scale"] for f in (*fp8_leaves(manifest).values(), *int4.values())}
    stored = {n: dict(s, shape=[*s["shape"][:-1], 2 * s["shape"][-1]]) if n in int4 else s  # logical shapes
              for n, s in manifest["leaves"].items() if n not in scales}
    for name in sorted(stored.keys() | want.keys(), key=lambda n: n.split(".")):
        if name not in stored:
            problem = f"in {what} {tuple(want[name].shape)} but not in the checkpoint"
        elif name not in want:
            problem = f"in the checkpoint {tuple(stored[name]['shape'])} but not in {what}"
        elif tuple(stored[name]["shape"]) != tuple(want[name].shape):
            problem = (f"{what} needs shape {tuple(want[name].shape)}, "
                       f"the checkpoint holds {tuple(stored[name]['shape'])}")
        else:
            continue
        raise ValueError(f"{ckpt_dir}: the checkpoint does not match {what}: first mismatched tensor {name}: {problem}")


def load(ckpt_dir: str | os.PathLike, dtype=None, mesh=None, shardings=None, cfg=None,
         max_inflight_bytes: int | None = None, quant: str | None = None):
    """Restore a converted checkpoint -> (K2Config, params).

    params is exactly `abstract_params(cfg, dtype)` (the router stays float32) as jax arrays. dtype None keeps
    the stored float dtype (a float8 or int4 conversion loads as bfloat16); "float8" returns a float8 conversion
    as stored: e4m3 weights plus their `*_scale_inv` leaves. FP8 / INT4 weights loaded into bf16/f32 are
    dequantized on device, one layer at a time.
    quant: hold weights quantized on device, as k2jax.ops.quant.QuantizedWeight leaves (see k2jax.load_hf):
      "fp8"   a `--dtype float8` conversion's e4m3 weights with their block scales;
      "int4"  the routed experts in INT4 groups of 32: an `--dtype int4` conversion's as stored, or a
              `--dtype float8` conversion's requantized on device one layer at a time (lossy).
    A conversion that holds nothing of the kind (bfloat16 / float32) is refused with a ValueError.
    mesh: place each leaf by `k2jax.sharding.param_shardings(cfg, mesh)` (a quantized weight's values like
    its param, its scales along the same stacked axes); shardings: an explicit tree of shardings instead
    (for the float8 tree as well); neither: one device.
    Either way each process reads only the chunks of its own devices' shards (see `restore`, which also
    explains max_inflight_bytes).
    cfg: the K2Config to load the weights into, instead of the checkpoint's config.json (e.g. with other
    runtime settings); a cfg whose params differ from the stored tensors is refused with a ValueError naming
    the first mismatched tensor. An interrupted conversion is refused with IncompleteCheckpointError.
    """
    import jax
    import jax.numpy as jnp

    from k2jax.config import K2Config
    from k2jax.nn.model import abstract_params
    from k2jax.nn.quantized import check_quant
    from k2jax.ops.quant import is_quantized

    manifest = read_manifest(ckpt_dir)
    what = "the given cfg" if cfg is not None else "its config.json"
    cfg = K2Config.from_hf_config(ckpt_dir) if cfg is None else cfg
    stored = manifest["dtype"]
    fp8, int4 = fp8_leaves(manifest), int4_leaves(manifest)
    float8 = dtype is not None and str(dtype) in ("float8", "float8_e4m3fn")
    check_quant(quant)
    if float8 and quant is not None:
        raise ValueError(f"{ckpt_dir}: dtype float8 returns the stored leaves as they are; quant={quant!r} holds "
                         f"them as QuantizedWeight: give one of the two")
    if quant is not None and not (stored == "float8" or (stored == "int4" and quant == "int4")):
        raise ValueError(f"{ckpt_dir}: quant={quant!r} needs a conversion that holds "
                         + ("FP8 weights (`k2jax convert --dtype float8` of an FP8 release)" if quant == "fp8" else
                            "INT4 experts (`--dtype int4` of a Kimi-K2-Thinking checkpoint) or FP8 weights "
                            "(`--dtype float8`, requantized)")
                         + f"; this one is {stored}: load it with quant=None")
    if dtype is None or float8:
        dtype = jnp.bfloat16 if stored in ("float8", "int4") else _DTYPES[stored]
    want = {leaf_name(tuple(k.key for k in p)): v
            for p, v in jax.tree_util.tree_leaves_with_path(abstract_params(cfg, dtype))}
    check_matches(ckpt_dir, manifest, want, what)
    if quant == "fp8" and tuple(manifest["fp8_block"]) != (128, 128):
        raise ValueError(f"{ckpt_dir}: quant='fp8' holds 128x128 blocks; this conversion has {manifest['fp8_block']}")
    if float8:
        if stored != "float8":
            raise ValueError(f"{ckpt_dir}: dtype float8 needs a `--dtype float8` conversion; this one is {stored}")
        target = {n: jax.ShapeDtypeStruct(tuple(s["shape"]), _DTYPES[s["dtype"]])
                  for n, s in manifest["leaves"].items()}
        target = _unflatten(target)
        if shardings is None and mesh is not None:
            shardings = _float8_shardings(cfg, mesh, target, fp8)
        return cfg, restore(ckpt_dir, target, shardings, max_inflight_bytes)
    # Where each stored array goes. On a mesh: a plain leaf by param_shardings; a quantized leaf's values and
    # scales as the tree of its stored format places them (scales with their blocks), whatever it becomes.
    held_sh = {}
    if shardings is None and mesh is not None:
        from k2jax.placement import param_shardings

        # One warning per fallback param, from the layout the params are held in.
        shardings = param_shardings(cfg, mesh, warn=quant is None)
        for fmt in ({"fp8"} if fp8 else set()) | ({"int4"} if int4 else set()) | ({quant} - {None}):
            held_sh[fmt] = _flatten(param_shardings(cfg, mesh, quant=fmt, warn=fmt == quant))
    flat_sh = None if shardings is None else _flatten(shardings)
    one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

    def sharding_of(name):
        return one if flat_sh is None else flat_sh[name]

    def stored_sharding(name, fmt, part, stack):
        """The sharding of a stored quantized leaf's `part` ("values" | "scales")."""
        if fmt in held_sh:
            return getattr(held_sh[fmt][name], part)
        return sharding_of(name) if part == "values" else _scale_sharding(sharding_of(name), stack)

    # Plain leaves: cast on read (bf16 -> f32 is exact). Quantized leaves: read as stored, then kept,
    # dequantized or requantized.
    keep = {leaf_name(tuple(k.key for k in p)) for p, v in jax.tree_util.tree_leaves_with_path(
        abstract_params(cfg, quant=quant), is_leaf=is_quantized) if is_quantized(v)}
    target, shard = {}, {}
    for n, v in want.items():
        shard[n] = sharding_of(n)
        q = fp8.get(n) or int4.get(n)
        if q is None:
            target[n] = jax.ShapeDtypeStruct(v.shape, v.dtype)
            continue
        fmt = "fp8" if n in fp8 else "int4"
        spec = manifest["leaves"][n]
        sspec = manifest["leaves"][q["scale"]]
        target[n] = jax.ShapeDtypeStruct(tuple(spec["shape"]), _DTYPES[spec["dtype"]])
        target[q["scale"]] = jax.ShapeDtypeStruct(tuple(sspec["shape"]), _DTYPES[sspec["dtype"]])
        shard[n] = stored_sharding(n, fmt, "values", len(sspec["shape"]) - 2)
        shard[q["scale"]] = stored_sharding(n, fmt, "scales", len(sspec["shape"]) - 2)
    flat = _flatten(restore(ckpt_dir, _unflatten(target), _unflatten(shard), max_inflight_bytes))
    block = tuple(manifest["fp8_block"])
    from k2jax.ops.quant import QuantizedWeight

    for n, info in (*fp8.items(), *int4.items()):
        fmt = "fp8" if n in fp8 else "int4"
        w, s = flat[n], flat.pop(info["scale"])
        if n in keep and fmt == quant:
            flat[n] = QuantizedWeight(w, s, fmt, info["in_ndim"])
        elif n in keep:  # an FP8 routed expert held as INT4: requantized, layer by layer
            out_sh = ((held_sh[quant][n].values, held_sh[quant][n].scales) if quant in held_sh else
                      (sharding_of(n), _scale_sharding(sharding_of(n), s.ndim - 2)))
            flat[n] = _requantize_fn(info["in_ndim"], block, *out_sh)(w, s)
        elif fmt == "fp8":
            flat[n] = _dequantize_fn(w.shape, info["in_ndim"], block, jnp.dtype(want[n].dtype), sharding_of(n))(w, s)
        else:
            flat[n] = _dequantize_int4_fn(jnp.dtype(want[n].dtype), sharding_of(n))(w, s)
        del w, s
    return cfg, _unflatten(flat)


def _requantize_fn(in_ndim, block, v_sh, s_sh):
    """jit: (e4m3 [L, ...], f32 block scales) -> QuantizedWeight int4 with values on v_sh and scales on s_sh,
    one layer's float32 copy at a time."""
    import jax

    from k2jax.checkpoint.fp8 import dequantize
    from k2jax.ops.quant import quantize

    def one_layer(ws):
        w, s = ws
        lead = s.ndim - 2
        slot = w.shape[lead:]
        w2 = w.reshape(*w.shape[:lead], math.prod(slot[:in_ndim]), math.prod(slot[in_ndim:]))
        x = dequantize(w2, s, block[::-1], np.float32).reshape(w.shape)
        q = quantize(x, "int4", in_ndim, lead)
        return q.values, q.scales

    def f(w, s):
        v, sc = jax.lax.map(one_layer, (w, s))
        return v, sc

    def run(w, s):
        from k2jax.ops.quant import QuantizedWeight

        v, sc = jax.jit(f, out_shardings=(v_sh, s_sh))(w, s)
        return QuantizedWeight(v, sc, "int4", in_ndim)

    return run


def _dequantize_int4_fn(dtype, sharding):
    """jit: (packed uint8 [L, ...], bf16 scales) -> dtype [L, ...], mapped over the layer axis."""
    import jax

    from k2jax.ops.quant import QuantizedWeight

    def one_layer(ws):
        return QuantizedWeight(ws[0], ws[1], "int4").dequantize(dtype)

    return jax.jit(lambda w, s: jax.lax.map(one_layer, (w, s)), out_shardings=sharding)


def _scale_sharding(sharding, stack: int):
    """A float8 weight's scale [*stack, in blocks, out blocks]: split over the stack (layer, expert) axes like
    its weight, whole over the block axes (which the weight's mesh axes need not divide)."""
    import jax

    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = tuple(sharding.spec)[:stack]
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))
    return sharding


def _float8_shardings(cfg, mesh, target, fp8):
    """The float8 tree's shardings: each weight as its param, each scale as `_scale_sharding`."""
    from k2jax.placement import param_shardings

    flat = _flatten(param_shardings(cfg, mesh))
    scales = {f["scale"]: (w, len(_flatten(target)[f["scale"]].shape) - 2) for w, f in fp8.items()}
    return _unflatten({n: _scale_sharding(flat[scales[n][0]], scales[n][1]) if n in scales else flat[n]
                       for n in _flatten(target)})


def _dequantize_fn(shape, in_ndim, block, dtype, sharding):
    """jit: (e4m3 [L, *stack, *slot], f32 scale [L, *stack, ceil(in/b0), ceil(out/b1)]) -> dtype [L, ...],
    mapped over the layer axis so float32 temporaries exist for one layer at a time."""
    import jax

    from k2jax.checkpoint.fp8 import dequantize

    def one_layer(ws):
        w, s = ws
        lead = s.ndim - 2
        slot = w.shape[lead:]
        w2 = w.reshape(*w.shape[:lead], math.prod(slot[:in_ndim]), math.prod(slot[in_ndim:]))
        # the weight is HF's [out, in] transposed: its block is (block_in, block_out)
        return dequantize(w2, s, block[::-1], np.float32).astype(dtype).reshape(w.shape)

    return jax.jit(lambda w, s: jax.lax.map(one_layer, (w, s)), out_shardings=sharding)
