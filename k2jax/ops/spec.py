"""PartitionSpec arithmetic shared by the kernels and k2jax.sharding (no model knowledge here)."""

from __future__ import annotations

import math


def shard_count(entry, mesh_shape: dict[str, int]) -> int:
    """How many pieces one PartitionSpec entry (None, an axis, or a tuple of axes) cuts a dimension into on a
    mesh of `mesh_shape` ({"expert": 4, ...}; absent axes count as size 1)."""
    if entry is None:
        return 1
    return math.prod(mesh_shape.get(a, 1) for a in ((entry,) if isinstance(entry, str) else entry))


def cutting_axes(entry, mesh_shape: dict[str, int]) -> tuple[str, ...]:
    """The axes of one PartitionSpec entry (None, an axis, or a tuple of axes) that cut its dimension: those of
    more than one device on a mesh of `mesh_shape`, in order."""
    return tuple(a for a in ((entry,) if isinstance(entry, str) else entry or ()) if mesh_shape.get(a, 1) > 1)
