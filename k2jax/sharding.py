"""Where things live: the device mesh, THE logical-axis rules table, param shardings, the mesh context.

Mesh axes: `data` and `fsdp` split the batch; `fsdp` also splits the model dimension of the weights (gathered
before use); `expert` splits the routed experts (the expert-parallel MoE in k2jax.ops.expert_parallel moves tokens
to them); `tensor` splits attention heads, MLP hidden dims (dense, shared and each routed expert's) and the
vocabulary. All axes are `Auto`: outside the MoE's shard_map the compiler places the collectives.

Any config on any mesh: a dim that its rule's mesh axes do not divide falls back, per dim, to the subset of
those axes with the largest product that divides it (batch 6 on data=4,fsdp=3 -> fsdp), else to replicated
(vocab 97 on tensor=2). `logical_to_spec` is the one place this is decided; param shardings, `k2jax.load`'s
reads, the plan, the KV cache, the train step, the activation constraints and the expert-parallel MoE all
take their specs from it. A param that falls back is named once in a warning (`param_shardings`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import warnings

import flax.linen as nn
import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from k2jax.config import K2Config
from k2jax.ops.quant import QuantizedWeight, is_quantized, scale_partition

MESH_AXES = ("data", "fsdp", "expert", "tensor")

# Logical axis name (as annotated in k2jax.nn) -> mesh axis (or axes, or None = replicated).
RULES = (
    # activations
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("act_embed", None),
    # weights
    ("layers", None),  # the scanned layer axis: every device runs every layer
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("norm", None),
    ("q_lora", None),
    ("kv_lora", None),
    ("heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
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


@dataclasses.dataclass(frozen=True)
class Fallback:
    """A param whose rule-given sharding the mesh does not divide: `wanted` (the rules' spec) and `got`
    (the spec it is placed by); `extra_bytes_per_device`: what each device holds beyond an even split."""

    name: str
    shape: tuple[int, ...]
    wanted: P
    got: P
    nbytes: int
    mesh_shape: dict = dataclasses.field(compare=False)

    @property
    def extra_bytes_per_device(self) -> float:
        return self.nbytes / self._shards(self.got) - self.nbytes / self._shards(self.wanted)

    def _shards(self, spec):
        return math.prod(shard_count(e, self.mesh_shape) for e in spec)

    def describe(self) -> str:
        n = len(self.shape)
        dims = [f"dim {d} not divisible by {_axes_str(w, self.mesh_shape)} -> "
                f"{_axes_str(g, self.mesh_shape) or 'replicated'}"
                for d, w, g in zip(self.shape, _padded(self.wanted, n), _padded(self.got, n)) if w != g]
        return (f"param {self.name} {list(self.shape)}: {'; '.join(dims)}; "
                f"+{format_bytes(self.extra_bytes_per_device)} per device vs an even split")


def param_specs(cfg: K2Config, mesh_shape: dict[str, int] | None = None, quant: str | None = None):
    """PartitionSpec pytree of the params of `cfg` (same tree as k2jax.abstract_params(cfg, quant=quant)):
    with `mesh_shape` ({"expert": 4, "tensor": 2, ...}) the specs each param is placed by (see
    `dividing_axes`), without it the rules' intent. A quantized param's leaf is a QuantizedWeight of its
    values' and scales' specs."""
    from k2jax.nn.model import abstract_params, param_axes

    if mesh_shape is None:
        return jax.tree_util.tree_map(lambda n: logical_to_spec(tuple(n)), param_axes(cfg, quant), is_leaf=_is_spec)
    return _placed_specs(param_axes(cfg, quant), abstract_params(cfg, quant=quant), mesh_shape)


def fallbacks(cfg: K2Config, mesh_shape: dict[str, int], dtype=None, quant: str | None = None) -> list[Fallback]:
    """The params of `cfg` that fall back on a mesh of `mesh_shape` (their bytes in `dtype`, default each
    param's own: float32; a quantized param's: its held values')."""
    from k2jax.nn.model import abstract_params, param_axes

    shapes = abstract_params(cfg, *(() if dtype is None else (dtype,)), quant=quant)
    return _fallbacks(param_axes(cfg, quant), shapes, dict(mesh_shape))


def param_shardings(cfg: K2Config, mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh, quant: str | None = None,
                    warn: bool = True):
    """NamedSharding pytree of the params of `cfg` on `mesh` (no params are built: serves the 1T config).

    Every config fits every mesh: a dim the mesh does not divide falls back (see `dividing_axes`), with one
    warning per such param naming it and its cost (in float32; `k2jax plan` gives it in any dtype).

    quant "fp8" | "int4": the tree of abstract_params(cfg, quant=quant). A QuantizedWeight's values fall back
    as a plain param does; its scales shard along the same mesh axes as the values where a shard holds whole
    blocks, and are replicated along a dim where it does not (k2jax.ops.quant.scale_partition).

    warn=False: no warnings (for a caller that also asks for another layout of the same params, and warns
    for the one it holds).
    """
    from k2jax.nn.model import abstract_params, param_axes

    mesh_shape = dict(mesh.shape)
    axes, shapes = param_axes(cfg, quant), abstract_params(cfg, quant=quant)
    for f in _fallbacks(axes, shapes, mesh_shape) if warn else ():
        warnings.warn(f"k2jax.sharding: {f.describe()}", stacklevel=2)
    specs = _placed_specs(axes, shapes, mesh_shape)
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs, is_leaf=_is_spec)


def _placed_specs(axes, shapes, mesh_shape):
    def one(names, a):
        if not is_quantized(a):
            return logical_to_spec(tuple(names), a.shape, mesh_shape)
        # The held values (INT4: packed, the output dim halved) fall back as a param; the scales follow them.
        values = logical_to_spec(tuple(names.values), a.values.shape, mesh_shape)
        return QuantizedWeight(values, P(*scale_partition(a, values, mesh_shape)), a.fmt, a.in_ndim)

    return jax.tree_util.tree_map(one, axes, shapes, is_leaf=_is_axes_leaf)


def _fallbacks(axes, shapes, mesh_shape) -> list[Fallback]:
    out = []
    for (path, names), a in zip(jax.tree_util.tree_leaves_with_path(axes, is_leaf=_is_axes_leaf),
                                jax.tree_util.tree_leaves(shapes, is_leaf=is_quantized)):
        if is_quantized(a):  # judged by its held values; the scales' placement follows from theirs
            names, a = names.values, a.values
        wanted, got = logical_to_spec(tuple(names)), logical_to_spec(tuple(names), a.shape, mesh_shape)
        if _effective(wanted, a.ndim, mesh_shape) != _effective(got, a.ndim, mesh_shape):
            name = ".".join(str(k.key) for k in path)
            out.append(Fallback(name, tuple(a.shape), wanted, got, a.size * a.dtype.itemsize, mesh_shape))
    return out


def shard_count(entry, mesh_shape: dict[str, int]) -> int:
    """How many pieces one PartitionSpec entry (None, an axis, or a tuple of axes) cuts a dimension into."""
    if entry is None:
        return 1
    return math.prod(mesh_shape.get(a, 1) for a in ((entry,) if isinstance(entry, str) else entry))


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
    """Run the model sharded on `mesh`: sets the mesh (activation constraints, the expert-parallel MoE) and
    the logical-axis rules. Use around jit calls: `with use_mesh(mesh): logits = step(params, tokens)`."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        yield mesh


def _is_spec(x):
    return isinstance(x, P)


def _is_axes_leaf(x):
    return isinstance(x, (P, QuantizedWeight))


def _padded(spec, n):
    return tuple(spec) + (None,) * (n - len(spec))


def _effective(spec, ndim, mesh_shape):
    """The spec with size-1 axes dropped: two specs that cut every dim alike compare equal."""
    return tuple(tuple(a for a in ((e,) if isinstance(e, str) else e or ()) if mesh_shape.get(a, 1) > 1)
                 for e in _padded(spec, ndim))


def _axes_str(entry, mesh_shape) -> str:
    axes = (entry,) if isinstance(entry, str) else entry or ()
    return ",".join(f"{a}={mesh_shape.get(a, 1)}" for a in axes)
