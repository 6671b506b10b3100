"""The converted checkpoint on disk: a standard Orbax checkpoint of exactly `abstract_params(cfg, dtype, quant)`'s
tree, its chunking, its manifest.

Layout of a converted directory DST (layout version 2):

    DST/_METADATA                 Orbax tree metadata (plain, non-OCDBT PyTree checkpoint)
    DST/<a.b.c>/                  one zarr (v2) array per leaf of the tree, named by its '.'-joined tree path,
                                  at its final (stacked) shape, e.g. moe_layers.mlp.experts.gate_proj [L, E, D, F];
                                  a QuantizedWeight leaf is stored as its two pytree children, e.g.
                                  moe_layers.mlp.experts.gate_proj.values and ...gate_proj.scales
    DST/config.json               the model's HF config
    DST/k2jax_manifest.json       written last, atomically: the completion marker (see `MANIFEST`)
    DST/.k2jax_convert/           only while converting: the job and the units already written (resume state)
    DST/commit_success.txt        on gs:// only: Orbax's own completion marker there (no atomic rename on GCS)

DST is a local directory or a gs:// prefix (k2jax.checkpoint.storage): the same objects either way.

The tree of a `--dtype` (CONVERSIONS): bfloat16 / float32 = abstract_params(cfg, dtype); float8 =
abstract_params(cfg, bfloat16, quant="fp8") (e4m3 values, float32 block scales); int4 = abstract_params(cfg,
bfloat16, quant="int4") (the routed experts as packed 4-bit values with bf16 group scales). So a plain Orbax
restore of `k2jax.abstract_params(cfg, dtype, quant)` with shardings from `k2jax.param_shardings(cfg, mesh,
quant=quant)` reads it (k2jax.checkpoint.orbax_restore, README "Checkpoints").

Arrays are chunked one (layer, expert) slot at a time ([1, 1, D, F] for experts), with big dims split so a
chunk stays under CHUNK_BYTES. So the converter writes each HF tensor into whole chunks of the stacked array
(no read-modify-write, bounded memory), and a restore with target shardings reads, per device, only the
chunks its shard touches (no full copy anywhere; the MoE weights exist once).

Layout version 1 (k2jax before this layout) stored a quantized weight's scales as a sibling leaf
`<name>_scale_inv` / `<name>_scale`: such float8 / int4 conversions are refused with a message to convert
again; its bfloat16 / float32 conversions have exactly this tree and are read as they are.
"""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from k2jax.checkpoint.storage import bucket_exists, open_dir
from k2jax.config import K2Config
from k2jax.nn.model import abstract_params
from k2jax.quant_policy import stacked_axes

LAYOUT_VERSION = 2
MANIFEST = "k2jax_manifest.json"
PROGRESS = ".k2jax_convert"
ORBAX_METADATA = "_METADATA"
COMMIT_SUCCESS = "commit_success.txt"  # what Orbax looks for in a finished checkpoint on GCS
CHUNK_BYTES = 64 << 20
# `--dtype` of a conversion -> the (param dtype, quant) of the tree it stores.
CONVERSIONS = {"bfloat16": ("bfloat16", None), "float32": ("float32", None), "float8": ("bfloat16", "fp8"),
               "int4": ("bfloat16", "int4")}
DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32),
          "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn), "uint8": np.dtype(np.uint8)}


class IncompleteCheckpointError(ValueError):
    """The directory is not a complete converted checkpoint (interrupted, or not a conversion at all)."""


def leaf_name(path) -> str:
    """A param path (dict keys, or a jax key path with QuantizedWeight's `values` / `scales` fields) -> the
    stored array's name, as Orbax names it: 'moe_layers.mlp.experts.gate_proj.values'."""
    return ".".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def leaves_by_name(tree) -> dict:
    """Every array leaf of `tree` (QuantizedWeight nodes opened into values and scales) by its stored name."""
    return {leaf_name(p): v for p, v in jax.tree_util.tree_leaves_with_path(tree)}


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


def stored_tree(cfg: K2Config, dtype: str):
    """The abstract tree a `--dtype` conversion stores (see CONVERSIONS)."""
    param_dtype, quant = CONVERSIONS[dtype]
    return abstract_params(cfg, jnp.dtype(param_dtype), quant)


def leaf_specs(cfg: K2Config, dtype: str) -> dict[str, dict]:
    """Stored name -> {"shape", "dtype", "chunks"} of every array of a `--dtype` conversion, sorted by name."""
    out = {}
    for path, v in jax.tree_util.tree_leaves_with_path(stored_tree(cfg, dtype)):
        keys = tuple(getattr(k, "key", None) for k in path if hasattr(k, "key"))  # the param's dict keys
        dt = np.dtype(v.dtype)
        out[leaf_name(path)] = {"shape": list(v.shape), "dtype": dt.name,
                                "chunks": list(chunk_shape(tuple(v.shape), stacked_axes(keys), dt.itemsize))}
    return dict(sorted(out.items()))


def write_orbax_metadata(dst, leaves: dict[str, dict]) -> None:
    """Orbax's `_METADATA` for the leaves (name -> spec): what `PyTreeCheckpointHandler` writes for a
    non-OCDBT zarr-v2 checkpoint of the same tree (a QuantizedWeight's fields are keyed like dict keys)."""
    tree = {}
    for name, spec in leaves.items():
        keys = name.split(".")
        tree[str(tuple(keys))] = {
            "key_metadata": [{"key": k, "key_type": 2} for k in keys],  # 2 = dict key
            "value_metadata": {"value_type": "jax.Array", "skip_deserialize": False, "write_shape": spec["chunks"]},
        }
    meta = {"tree_metadata": tree, "use_ocdbt": False, "use_zarr3": False,
            "store_array_data_equal_to_fill_value": True, "custom_metadata": None}
    open_dir(dst).write(ORBAX_METADATA, json.dumps(meta, indent=1).encode())


def read_manifest(ckpt_dir) -> dict:
    """The manifest of a complete conversion (a local directory or gs:// URL); IncompleteCheckpointError (with
    the reason) otherwise. A layout version 1 manifest of a bfloat16 / float32 conversion (the same tree) is
    read as version 2; of a float8 or int4 one (scales stored beside their weight) refused with a message to
    convert again."""
    d = open_dir(ckpt_dir)
    raw = d.read(MANIFEST)
    if raw is None:
        if not d.exists():
            if d.remote and not bucket_exists(d.bucket):
                raise FileNotFoundError(f"{d}: no such bucket gs://{d.bucket}")
            raise FileNotFoundError(f"{d}: no such checkpoint directory")
        if d.any(PROGRESS):
            raise IncompleteCheckpointError(
                f"{d}: incomplete conversion (interrupted or still running; no {MANIFEST}): rerun the same "
                f"`k2jax convert` command to finish it")
        raise IncompleteCheckpointError(f"{d}: not a k2jax checkpoint (no {MANIFEST}); convert a HuggingFace "
                                        f"checkpoint with `k2jax convert SRC DST`, or use k2jax.load_hf")
    try:
        manifest = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise IncompleteCheckpointError(f"{d.name(MANIFEST)}: corrupt manifest: {e}") from None
    version, dtype = manifest.get("layout_version"), manifest.get("dtype")
    if version == 1 and dtype in ("bfloat16", "float32"):
        return manifest | {"layout_version": LAYOUT_VERSION}
    if version == 1:
        raise ValueError(f"{d}: a --dtype {dtype} conversion in layout version 1 (scales stored beside their "
                         f"weights); this k2jax reads layout {LAYOUT_VERSION} (the tree of abstract_params, scales "
                         f"inside each QuantizedWeight): convert it again, `k2jax convert SRC {d} --dtype {dtype} "
                         f"--overwrite`")
    if version != LAYOUT_VERSION or dtype not in CONVERSIONS:
        raise ValueError(f"{d.name(MANIFEST)}: layout version {version!r}, dtype {dtype!r}; this k2jax reads layout "
                         f"{LAYOUT_VERSION} ({', '.join(CONVERSIONS)}): convert again with this version")
    return manifest


def stored_array(ckpt_dir, name: str) -> dict:
    """{"shape", "dtype", "chunks"} of one stored array, from its own zarr metadata."""
    d = open_dir(ckpt_dir)
    try:
        raw = d.read(f"{name}/.zarray")
        if raw is None:
            raise FileNotFoundError(f"{d.name(name + '/.zarray')}: no such file")
        z = json.loads(raw)
    except (OSError, json.JSONDecodeError) as e:
        raise IncompleteCheckpointError(f"{d}: tensor {name}: cannot read its array metadata: {e}") from None
    return {"shape": list(z["shape"]), "dtype": np.dtype(z["dtype"]).name, "chunks": list(z["chunks"])}


def read_bytes(spec: dict, index: tuple[slice, ...]) -> int:
    """Bytes read from disk for the region `index` of a stored array: every chunk it touches, whole (the same
    estimate Orbax reserves against its in-flight limit)."""
    n = np.dtype(spec["dtype"]).itemsize
    for sl, dim, chunk in zip(index, spec["shape"], spec["chunks"]):
        start, stop, _ = sl.indices(dim)
        n *= -(-stop // chunk) * chunk - start // chunk * chunk
    return n


def check_matches(ckpt_dir, manifest: dict, want: dict, what: str) -> None:
    """Raise ValueError naming the first array (in tree order) where the checkpoint and `want` (stored name ->
    ShapeDtypeStruct, see leaves_by_name) differ: missing, unexpected, or another shape; `what` names the config
    in the message."""
    stored = manifest["leaves"]
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
