"""Where things live: the device mesh, THE logical-axis rules table, and the one fallback rule.

Mesh axes: `data`, `fsdp` and `expert` split the batch (tokens, activations and the latent KV cache:
data-parallel attention, so no chip holds another chip's rows of the cache); `fsdp` also splits the model
dimension of the weights (gathered before use); `expert` also splits the routed experts (the expert-parallel
MoE in k2jax.ops.expert_parallel moves each chip's tokens to the chips holding their experts) and the
vocabulary; `tensor` splits attention heads, MLP hidden dims (dense, shared and each routed expert's) and the
vocabulary. All axes are `Auto`: outside the MoE's shard_map the compiler places the collectives.

Any config on any mesh: a dim that its rule's mesh axes do not divide falls back, per dim, to the subset of
those axes with the largest product that divides it (batch 6 on data=4,fsdp=3 -> fsdp), else to replicated
(vocab 97 on tensor=2; a batch of 1 on 64 chips). `logical_to_spec` is the one place this is decided; the
params' placement (k2jax.placement), `k2jax.load`'s reads, the plan, the KV cache, the train step, the
activation constraints and the expert-parallel MoE all take their specs from it.

This module knows nothing of the model (k2jax.placement places its params): k2jax.nn and k2jax.ops import it.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import math

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AxisType, PartitionSpec as P

from k2jax.ops.spec import cutting_axes, shard_count  # noqa: F401  (re-exported: spec entries' axes and pieces)

MESH_AXES = ("data", "fsdp", "expert", "tensor")

# Logical axis name (as annotated in k2jax.nn) -> mesh axis (or axes, or None = replicated).
RULES = (
    # activations: the batch over every axis attention does not use for heads (data-parallel attention)
    ("batch", ("data", "fsdp", "expert")),
    ("length", ("data", "fsdp", "expert")),  # a lone row's tokens: split where the batch cannot be (sequence parallel)
    ("act_embed", None),
    # weights
    ("layers", None),  # the scanned layer axis: every device runs every layer
    ("vocab", ("tensor", "expert")),  # embed_tokens and lm_head: the largest params no MoE axis splits
    ("embed", "fsdp"),
    ("norm", None),
    ("q_lora", None),
    ("kv_lora", None),
    ("heads", "tensor"),
    ("head_dim", None),
    ("mlp", ("tensor", "expert")),
    ("experts", "expert"),
    ("expert_mlp", "tensor"),
    ("router_experts", None),  # the router scores every expert for every token: [D, E] stays whole
)


def parse_mesh_spec(spec: str | dict[str, int]) -> dict[str, int]:
    """{"data": 2, "fsdp": 1, "expert": 4, "tensor": 1} from "data=2,expert=4" (absent axes have size 1)."""
    if isinstance(spec, str):
        sizes = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            name, eq, value = part.partition("=")
            if not eq or not value.strip().isdigit():
                raise ValueError(f"mesh spec {spec!r}: expected AXIS=SIZE, got {part!r}")
            sizes[name.strip()] = int(value)
    else:
        sizes = dict(spec)
    for name, size in sizes.items():
        if name not in MESH_AXES:
            raise ValueError(f"mesh spec {spec!r}: unknown axis {name!r} (axes: {', '.join(MESH_AXES)})")
        if size < 1:
            raise ValueError(f"mesh spec {spec!r}: axis {name!r} must be >= 1, got {size}")
    return {a: sizes.get(a, 1) for a in MESH_AXES}


def make_mesh(spec: str | dict[str, int], devices=None) -> jax.sharding.Mesh:
    """A mesh over MESH_AXES from "data=2,expert=4" (or {"data": 2, "expert": 4}); absent axes have size 1.

    The product of the sizes must equal the number of devices (all of jax.devices() by default).
    """
    shape = tuple(parse_mesh_spec(spec).values())
    devices = jax.devices() if devices is None else list(devices)
    if math.prod(shape) != len(devices):
        raise ValueError(f"mesh spec {spec!r}: axis sizes multiply to {math.prod(shape)}, "
                         f"but there are {len(devices)} devices")
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


def _rule_axes(name: str | None, rules) -> tuple[str, ...]:
    """The mesh axes a logical name maps to (its first rule), as a tuple; () = replicated or unknown."""
    for logical, axes in rules:
        if logical == name:
            return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    return ()


def dividing_axes(axes: tuple[str, ...], dim: int, mesh_shape: dict[str, int]) -> tuple[str, ...]:
    """THE fallback rule: `axes` if their sizes' product divides `dim`; otherwise the subset of them (in their
    order) with the largest product that divides it, preferring more axes on a tie (size-1 axes stay); ()
    when none does. Axes absent from the mesh count as size 1."""
    def size(sub):
        return math.prod(mesh_shape.get(a, 1) for a in sub)

    if dim % size(axes) == 0:
        return axes
    subsets = [s for r in range(len(axes), -1, -1) for s in itertools.combinations(axes, r) if dim % size(s) == 0]
    return max(subsets, key=lambda s: (size(s), len(s)))


def logical_to_spec(names: tuple[str | None, ...], shape: tuple[int, ...] | None = None,
                    mesh_shape: dict[str, int] | None = None, rules=RULES) -> P:
    """PartitionSpec of a tensor from its logical axis names, through `rules` (a mesh axis is used at most
    once: a later dim does not get an axis an earlier one took). With `shape` and `mesh_shape` each dim keeps
    only the axes that divide it (see `dividing_axes`); without them, the rules' intent."""
    used: set[str] = set()
    entries = []
    for i, name in enumerate(names):
        axes = tuple(a for a in _rule_axes(name, rules) if a not in used)
        if shape is not None and mesh_shape is not None:
            axes = dividing_axes(axes, shape[i], mesh_shape)
        used.update(axes)
        entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return P(*entries)


def constrain(x, names: tuple[str | None, ...]):
    """An activation constrained to its logical axes' sharding on the current mesh (jax.set_mesh, as
    use_mesh sets), with the same per-dim fallback as the params (e.g. a batch of 3 on data=2: replicated).
    A no-op without a mesh or without logical-axis rules (init traces with none)."""
    rules = nn.get_logical_axis_rules()
    mesh = jax.sharding.get_abstract_mesh()
    if not rules or not mesh.shape:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(names, x.shape, dict(mesh.shape), rules))


def local_size(name: str, dim: int) -> int:
    """How much of a dim of logical axis `name` (e.g. "batch") each device holds on the current mesh under
    the logical-axis rules, as `constrain` would place it; dim itself without a mesh or rules."""
    rules = nn.get_logical_axis_rules()
    mesh = jax.sharding.get_abstract_mesh()
    if not rules or not mesh.shape:
        return dim
    return dim // shard_count(logical_to_spec((name,), (dim,), dict(mesh.shape), rules)[0], dict(mesh.shape))


def split_specs(names: tuple[str | None, ...], shape: tuple[int, ...]):
    """The PartitionSpec `constrain` gives a tensor of these logical names and shape on the current mesh under
    the logical-axis rules (for a shard_map's in_specs); None without a mesh or rules."""
    rules = nn.get_logical_axis_rules()
    mesh = jax.sharding.get_abstract_mesh()
    if not rules or not mesh.shape:
        return None
    return logical_to_spec(names, shape, dict(mesh.shape), rules)


def format_bytes(n: float) -> str:
    """Bytes to 3 significant figures in the unit that fits: 512 B, 1.50 KiB, 67.1 MiB, 14.2 GiB, 1.02 TiB."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{_sig3(n / scale)} {unit}"
    return f"{n:.0f} B"


def _sig3(x: float) -> str:
    digits = max(0, 2 - int(math.floor(math.log10(abs(x))))) if x else 2
    s = f"{x:.{digits}f}"
    if float(s) and abs(float(s)) >= 10 ** (3 - digits):  # rounding went up a decade (999.6 -> 1000)
        s = f"{x:.{max(0, digits - 1)}f}"
    return s


@contextlib.contextmanager
def use_mesh(mesh: jax.sharding.Mesh):
    """Run the model sharded on `mesh`: sets the mesh (activation constraints, the expert-parallel MoE), the
    logical-axis rules, and the physical rings of its axes (see `rings`). Use around jit calls:
    `with use_mesh(mesh): logits = step(params, tokens)`."""
    token = _RINGS.set(axis_rings(mesh))
    try:
        with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
            yield mesh
    finally:
        _RINGS.reset(token)


# The mesh axes' physical rings, as use_mesh found them: traced code sees only the abstract mesh.
_RINGS: contextvars.ContextVar[dict[str, tuple[int, ...]]] = contextvars.ContextVar("k2jax_rings", default={})


def axis_rings(mesh: jax.sharding.Mesh) -> dict[str, tuple[int, ...]]:
    """{mesh axis: ring sizes, major first} for each axis of `mesh` that runs along more than one physical
    axis of the slice: the axis's index is i0·(r1·r2) + i1·r2 + i2, and the devices of each ring (one index
    varying, the others fixed) differ in one physical coordinate. expert=64 on v5p:4x4x4 -> (4, 4, 4).

    From the devices' `coords` (TPU); an axis whose devices have none (CPU, GPU), that lies along one
    physical axis, or whose order is not such a product is left out (one ring: the whole axis)."""
    out = {}
    for i, name in enumerate(mesh.axis_names):
        n = mesh.devices.shape[i]
        lines = np.moveaxis(mesh.devices, i, -1).reshape(-1, n)  # every line of devices along this axis
        coords = [[getattr(d, "coords", None) for d in line] for line in lines]
        if n < 4 or any(c is None for line in coords for c in line):
            continue
        c = np.asarray(coords)  # [lines, n, physical dims]
        sizes, stride = [], 1
        while stride < n:
            moved = np.flatnonzero(c[0, stride] != c[0, 0])
            if len(moved) != 1:
                break
            size = 1
            while stride * size < n and np.array_equal(np.flatnonzero(c[0, stride * size] != c[0, 0]), moved):
                size += 1
            if (n // stride) % size:
                break
            sizes.append(size)
            stride *= size
        if stride != n or len(sizes) < 2 or not _rings_hold(c, sizes):
            continue
        out[name] = tuple(reversed(sizes))
    return out


def _rings_hold(c: np.ndarray, minor_first: list[int]) -> bool:
    """Whether, on every line of `c` [lines, n, dims], each ring of these sizes (minor first) varies in one
    physical coordinate."""
    n, stride = c.shape[1], 1
    for size in minor_first:
        for base in range(n):
            if (base // stride) % size:
                continue
            ring = c[:, base + stride * np.arange(size)]  # [lines, size, dims]
            if ((ring != ring[:, :1]).any(axis=1).sum(axis=-1) > 1).any():
                return False
        stride *= size
    return True


def rings(axis: str, size: int) -> tuple[int, ...]:
    """The physical ring sizes (major first) of mesh axis `axis` of `size` devices, under use_mesh; (size,)
    when it has none (one ring)."""
    found = _RINGS.get().get(axis)
    return found if found and math.prod(found) == size else (size,)


def per_shard(fn, args, dims, out_dims, axes: tuple[str, ...], head_dims=None, out_head_dims=None,
              head_axes: tuple[str, ...] = ()):
    """fn(shard, *args) -> tuple of arrays, run once per data-parallel shard under shard_map when the current
    mesh splits `axes` (> 1 shard): each arg split along its axis in `dims` (None = whole), the outputs
    joined along `out_dims`, `shard` = the shard's index (row-major over `axes`, as NamedSharding splits a
    dim). Without such a mesh: fn(0, *args) on the whole arrays. head_dims and out_head_dims (a dim or None
    per arg and per output) are also split over `head_axes` (the attention heads' tensor-parallel axes),
    so that each chip of a shard runs its own heads.

    For state that lives per shard (the KV cache's pages, per-slot sampling state): each shard's rows use
    only its own part, so nothing is gathered across chips."""
    mesh = jax.sharding.get_abstract_mesh()
    axes = cutting_axes(axes, dict(mesh.shape))
    if not axes:
        return fn(0, *args)
    head_axes = cutting_axes(head_axes, dict(mesh.shape))

    def spec(d, h=None):
        h = h if head_axes else None
        if d is None and h is None:
            return P()
        entries = [None] * (1 + max(x for x in (d, h) if x is not None))
        if d is not None:
            entries[d] = axes
        if h is not None:
            entries[h] = head_axes
        return P(*entries)

    head_dims = head_dims or (None,) * len(dims)
    out_head_dims = out_head_dims or (None,) * len(out_dims)

    def sharded(*xs):
        return fn(shard_index(axes), *xs)

    return jax.shard_map(sharded, mesh=mesh, in_specs=tuple(spec(d, h) for d, h in zip(dims, head_dims)),
                         out_specs=tuple(spec(d, h) for d, h in zip(out_dims, out_head_dims)), check_vma=False)(*args)


def shard_index(axes, mesh=None):
    """This device's index over mesh axes `axes` (an axis or a tuple) under shard_map on `mesh` (default: the
    current one), row-major, as NamedSharding splits a dim over them."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    idx = 0
    for a in ((axes,) if isinstance(axes, str) else axes):
        idx = idx * mesh.shape[a] + jax.lax.axis_index(a)
    return idx


def split_axes(axes: tuple[str, ...], rows: int) -> tuple[str, ...]:
    """`axes` (a per-shard state's axes) if the current mesh splits them and they divide `rows` (the rows of
    a step then lie in shard order); () otherwise: the step's rows are not split like the state."""
    mesh = jax.sharding.get_abstract_mesh()
    axes = cutting_axes(axes, dict(mesh.shape))
    n = math.prod(mesh.shape[a] for a in axes) if axes else 1
    return axes if n > 1 and rows % n == 0 else ()
