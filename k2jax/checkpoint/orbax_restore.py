"""Reading a converted checkpoint: `restore` (an Orbax restore of the stored tree with target shardings, host
memory bounded) and `k2jax.load` (restore, plus at most one conversion when the stored format is not the one
asked for). The layout is k2jax.checkpoint.orbax_layout's: the tree of `abstract_params(cfg, dtype, quant)`.

The same restore with Orbax alone, no k2jax code in the read path:

    import orbax.checkpoint as ocp
    abstract = k2jax.abstract_params(cfg, jnp.bfloat16, quant)          # quant: as converted (None, "fp8", "int4")
    shardings = k2jax.param_shardings(cfg, mesh, quant=quant)
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    params = ocp.StandardCheckpointer().restore(DST, target)            # == k2jax.load(DST, mesh=mesh, quant=quant)
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from k2jax.checkpoint.hf_source import load_config
from k2jax.checkpoint.orbax_layout import (CONVERSIONS, check_matches, leaves_by_name, read_bytes, read_manifest,
                                           stored_array)
from k2jax.checkpoint.storage import open_dir
from k2jax.nn.model import abstract_params
from k2jax.nn.quantized import requantize_params
from k2jax.quant_policy import check_quant
from k2jax.placement import param_shardings

# Default bound on the shard reads a restore has in flight (host memory), see `restore`.
MAX_INFLIGHT_BYTES = 8 << 30


def restore(ckpt_dir: str | os.PathLike, target, shardings=None, max_inflight_bytes: int | None = None):
    """Orbax restore of (a subset of) the stored tree, from a local directory or a gs:// URL (tensorstore's gcs
    kvstore under Orbax).

    target: a tree of jax.ShapeDtypeStruct (QuantizedWeight nodes included) with the stored shapes (a different
    float dtype is cast on read). shardings: the same tree of jax.sharding.Sharding (e.g.
    `k2jax.param_shardings(cfg, mesh, quant=...)`), or None for the first local device.

    What is read, and where it lives: each process reads, for each array, once per distinct shard among its own
    (addressable) devices, only the chunks that shard overlaps, into a host buffer of that one shard, and puts it
    on the devices that hold it. So of an expert stack a process reads only the (layer, expert) slots its
    devices hold (each slot whole when `tensor` splits it: one chunk), and no device receives more than its
    shard. Shard reads run concurrently, at most `max_inflight_bytes` of them at once (default
    MAX_INFLIGHT_BYTES, raised to fit the largest single read): the host memory a restore needs is that, not
    the model or an expert stack, even where one process's devices hold every expert.
    """
    d = open_dir(ckpt_dir)
    if shardings is None:
        one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        shardings = jax.tree.map(lambda _: one, target)
    flat_s = leaves_by_name(shardings)
    largest = 0
    for name, t in leaves_by_name(target).items():
        spec = stored_array(d, name)
        if tuple(spec["shape"]) != tuple(t.shape):
            raise ValueError(f"{d}: tensor {name}: requested shape {tuple(t.shape)}, stored "
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
        return ckptr.restore(d.orbax_path(), args=ocp.args.PyTreeRestore(item=abstract, restore_args=args))


def load(ckpt_dir: str | os.PathLike, dtype=None, mesh=None, shardings=None, cfg=None,
         max_inflight_bytes: int | None = None, quant: str | None = None):
    """Restore a converted checkpoint -> (K2Config, params), params exactly `abstract_params(cfg, dtype, quant)`
    as jax arrays (the router stays float32).

    dtype: of the plain params; None keeps the stored one (a float8 or int4 conversion: bfloat16).
    quant: hold weights quantized on device as k2jax.ops.quant.QuantizedWeight leaves (k2jax.quant_policy):
      None    everything plain: a float8 / int4 conversion's quantized weights dequantized on device;
      "fp8"   a `--dtype float8` conversion's e4m3 weights with their block scales, as stored;
      "int4"  the routed experts in INT4 groups of 32: an `--dtype int4` conversion's as stored, or a
              `--dtype float8` conversion's requantized on device (lossy; its other weights dequantized).
    The checkpoint is restored as stored (the tree of its conversion, read straight onto the devices), then
    converted once where it is not what `quant` asks for (k2jax.nn.quantized.requantize_params: one layer at a
    time). Anything else (quant "fp8" of an int4 conversion, a quant of a bfloat16 one) is refused with a
    ValueError.

    mesh: place each leaf by `k2jax.param_shardings(cfg, mesh, quant=quant)` (a quantized weight's scales with
    their blocks); shardings: an explicit tree of shardings of the result instead; neither: one device.
    Either way each process reads only the chunks of its own devices' shards (see `restore`, which also
    explains max_inflight_bytes).
    cfg: the K2Config to load the weights into, instead of the checkpoint's config.json (e.g. with other
    runtime settings); a cfg whose params differ from the stored tensors is refused with a ValueError naming
    the first mismatched tensor. An interrupted conversion is refused with IncompleteCheckpointError.
    """
    ckpt_dir = open_dir(ckpt_dir)
    manifest = read_manifest(ckpt_dir)
    what = "the given cfg" if cfg is not None else "its config.json"
    cfg = load_config(str(ckpt_dir)) if cfg is None else cfg
    check_quant(quant)
    if dtype is not None and str(dtype) in ("float8", "float8_e4m3fn"):
        raise ValueError(f"{ckpt_dir}: dtype={str(dtype)!r}: a float8 conversion's e4m3 weights and scales load as "
                         f"they are stored with quant='fp8' (QuantizedWeight leaves); dtype is the plain params'")
    stored_dtype, stored_quant = CONVERSIONS[manifest["dtype"]]
    if quant not in (None, stored_quant) and not (quant == "int4" and stored_quant == "fp8"):
        raise ValueError(f"{ckpt_dir}: quant={quant!r} needs a conversion that holds "
                         + ("FP8 weights (`k2jax convert --dtype float8` of an FP8 release)" if quant == "fp8" else
                            "INT4 experts (`--dtype int4` of a Kimi-K2-Thinking checkpoint) or FP8 weights "
                            "(`--dtype float8`, requantized)")
                         + f"; this one is {manifest['dtype']}: load it with quant=None")
    dtype = jnp.dtype(stored_dtype if dtype is None else dtype)
    target = abstract_params(cfg, dtype, stored_quant)  # the stored tree: abstract_params is traced once per cfg
    check_matches(ckpt_dir, manifest, leaves_by_name(target), what)
    if mesh is None and shardings is not None:
        mesh = _mesh_of(shardings)
    if stored_quant == quant:  # as stored: the restore is the load
        if shardings is None and mesh is not None:
            shardings = param_shardings(cfg, mesh, quant=quant)  # one warning per param that falls back
        return cfg, restore(ckpt_dir, target, shardings, max_inflight_bytes)
    # Read as stored, then one conversion into the held layout; on a mesh each stored array is placed as the
    # stored layout places it (scales with their blocks), each result as the held layout does.
    read_sh = None if mesh is None else param_shardings(cfg, mesh, quant=stored_quant, warn=False)
    if shardings is None and mesh is not None:
        shardings = param_shardings(cfg, mesh, quant=quant)  # warns for the layout held
    stored = restore(ckpt_dir, target, read_sh, max_inflight_bytes)
    return cfg, requantize_params(stored, quant, dtype, shardings)


def _mesh_of(shardings):
    """The mesh of an explicit shardings tree (its first NamedSharding's), or None."""
    for s in jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)):
        if isinstance(s, jax.sharding.NamedSharding):
            return s.mesh
    return None
