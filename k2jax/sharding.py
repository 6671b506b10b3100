"""Where things live: the device mesh, THE logical-axis rules table, param shardings, the mesh context.

Mesh axes: `data` and `fsdp` split the batch; `fsdp` also splits the model dimension of the weights (gathered
before use); `expert` splits the routed experts (the expert-parallel MoE in k2jax.ops.expert_parallel moves tokens
to them); `tensor` splits attention heads, MLP hidden dims (dense, shared and each routed expert's) and the
vocabulary. All axes are `Auto`: outside the MoE's shard_map the compiler places the collectives.
"""

from __future__ import annotations

import contextlib
import math

import flax.linen as nn
import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from k2jax.config import K2Config
from k2jax.nn.model import abstract_params, param_axes
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


def logical_to_spec(names: tuple[str | None, ...]) -> P:
    """PartitionSpec of a tensor from its logical axis names, through RULES (a mesh axis is used at most once)."""
    return nn.logical_to_mesh_axes(names, RULES)


def param_specs(cfg: K2Config, quant: str | None = None):
    """PartitionSpec pytree of the params of `cfg` (same tree as k2jax.abstract_params(cfg, quant=quant));
    a quantized param's leaf is a QuantizedWeight of its values' and scales' specs."""
    return jax.tree_util.tree_map(logical_to_spec, param_axes(cfg, quant), is_leaf=lambda x: isinstance(x, P))


def param_shardings(cfg: K2Config, mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh, quant: str | None = None):
    """NamedSharding pytree of the params of `cfg` on `mesh` (no params are built: serves the 1T config).

    quant "fp8" | "int4": the tree of abstract_params(cfg, quant=quant). A QuantizedWeight's scales shard
    along the same mesh axes as its values where a shard holds whole blocks, and are replicated along a dim
    where it does not (k2jax.ops.quant.scale_partition: dims under one block, as in tiny test configs).

    Raises ValueError naming the first param whose sharded dimension the mesh does not divide.
    """
    specs = param_specs(cfg, quant)
    shapes = abstract_params(cfg, quant=quant)
    mesh_shape = dict(mesh.shape)
    if quant is not None:
        specs = jax.tree_util.tree_map(
            lambda sp, w: QuantizedWeight(sp.values, P(*scale_partition(w, sp.values, mesh_shape)), w.fmt, w.in_ndim)
            if is_quantized(w) else sp, specs, shapes, is_leaf=lambda x: isinstance(x, (P, QuantizedWeight)))
    check_divisible(specs, shapes, mesh_shape)
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def check_divisible(specs, shapes, mesh_shape: dict[str, int]) -> None:
    """Raise ValueError naming the first param whose sharded dimension the mesh axes do not divide."""
    for path, spec in jax.tree_util.tree_leaves_with_path(specs, is_leaf=lambda x: isinstance(x, P)):
        shape = _get(shapes, path).shape
        for dim, axes in zip(shape, spec):
            n = shard_count(axes, mesh_shape)
            if dim % n:
                raise ValueError(f"param {jax.tree_util.keystr(path)} {shape}: dimension {dim} is not divisible "
                                 f"by mesh axes {axes} (size {n})")


def shard_count(entry, mesh_shape: dict[str, int]) -> int:
    """How many pieces one PartitionSpec entry (None, an axis, or a tuple of axes) cuts a dimension into."""
    if entry is None:
        return 1
    return math.prod(mesh_shape.get(a, 1) for a in ((entry,) if isinstance(entry, str) else entry))


@contextlib.contextmanager
def use_mesh(mesh: jax.sharding.Mesh):
    """Run the model sharded on `mesh`: sets the mesh (activation constraints, the expert-parallel MoE) and
    the logical-axis rules. Use around jit calls: `with use_mesh(mesh): logits = step(params, tokens)`."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        yield mesh


def _get(tree, path):
    for k in path:
        tree = getattr(tree, k.name) if isinstance(k, jax.tree_util.GetAttrKey) else tree[k.key]
    return tree
