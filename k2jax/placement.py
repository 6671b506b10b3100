"""Where the model's params live on a mesh: their PartitionSpecs and shardings from the rules table
(k2jax.sharding), and the params that fall back because the mesh does not divide one of their dims.

A quantized param (k2jax.ops.quant.QuantizedWeight) is placed as its values, with its scales split along the
same mesh axes where a shard holds whole blocks (k2jax.ops.quant.scale_partition).
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from k2jax.config import K2Config
from k2jax.nn.model import abstract_params, param_axes
from k2jax.ops.quant import QuantizedWeight, is_quantized, scale_partition
from k2jax.sharding import cutting_axes, format_bytes, logical_to_spec, shard_count


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
    if mesh_shape is None:
        return jax.tree_util.tree_map(lambda n: logical_to_spec(tuple(n)), param_axes(cfg, quant), is_leaf=_is_spec)
    return placed_specs(param_axes(cfg, quant), abstract_params(cfg, quant=quant), mesh_shape)


def fallbacks(cfg: K2Config, mesh_shape: dict[str, int], dtype=None, quant: str | None = None) -> list[Fallback]:
    """The params of `cfg` that fall back on a mesh of `mesh_shape` (their bytes in `dtype`, default each
    param's own: float32; a quantized param's: its held values')."""
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
    mesh_shape = dict(mesh.shape)
    axes, shapes = param_axes(cfg, quant), abstract_params(cfg, quant=quant)
    for f in _fallbacks(axes, shapes, mesh_shape) if warn else ():
        warnings.warn(f"k2jax.placement: {f.describe()}", stacklevel=2)
    specs = placed_specs(axes, shapes, mesh_shape)
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs, is_leaf=_is_spec)


def placed_specs(axes, shapes, mesh_shape):
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


def _is_spec(x):
    return isinstance(x, P)


def _is_axes_leaf(x):
    return isinstance(x, (P, QuantizedWeight))


def _padded(spec, n):
    return tuple(spec) + (None,) * (n - len(spec))


def _effective(spec, ndim, mesh_shape):
    """The spec with size-1 axes dropped: two specs that cut every dim alike compare equal."""
    return tuple(cutting_axes(e, mesh_shape) for e in _padded(spec, ndim))


def _axes_str(entry, mesh_shape) -> str:
    axes = (entry,) if isinstance(entry, str) else entry or ()
    return ",".join(f"{a}={mesh_shape.get(a, 1)}" for a in axes)
