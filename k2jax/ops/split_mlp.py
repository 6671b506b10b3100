"""SwiGLU over a lone row's tokens split along one mesh axis (sequence parallel), laid out in two dimensions.

Each of the axis's n devices holds t of the row's T tokens and 1/n of the hidden width F of W_gate, W_up
[D, F] and W_down [F, D]. Two layouts are plain: the weights gathered whole (each device receives about
3·D·F values) or the tokens gathered (the compiler's choice for a dense MLP: about 2·T·D, the tokens in and
the partial outputs reduced). Between them, groups of k devices share the work: a group's k·t tokens are
gathered within it, each member gathers the weights of F/k columns from the other groups, and the partial
outputs are reduce-scattered back within the group: 3·D·F/k + 2·k·t·D. The groups follow the slice's
physical rings (k2jax.sharding.rings): the minor rings make a token group, the others gather the weights,
so every collective runs along rings (k2jax.ops.collectives).

Kimi K2 on a lone 8192-token prompt over expert=64 on v5p:4x4x4 (rings 4 x 4 x 4, t = 128): the shared
experts (F = 2048) take k = 4 (1,536 + 1,024 values of D a token row against 6,144 gathering the weights
whole), the dense MLP (F = 18432) k = 16 (7,552 against 16,384 gathering the tokens).

`swiglu_split_tokens` equals k2jax.nn.mlp.MLP on the whole arrays (tests/test_collectives.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from k2jax.ops.collectives import gather_steps, groups_of, ring_steps
from k2jax.ops.matmul import einsum
from k2jax.sharding import rings


def group_rings(F: int, t: int, ring_sizes: tuple[int, ...]) -> int:
    """How many of the axis's rings (minor first) make a token group: the number j whose group size k (the
    product of the j minor rings) moves the least, 3·F/k + 2·k·t values of D a device (no token term for
    k = 1). ring_sizes: major first, as k2jax.sharding.rings gives them."""
    minor_first = list(reversed(ring_sizes))
    best, best_j, k = None, 0, 1
    for j in range(len(minor_first) + 1):
        if j:
            k *= minor_first[j - 1]
        cost = 3 * F / k + (2 * k * t if k > 1 else 0)
        if best is None or cost < best:
            best, best_j = cost, j
    return best_j


def swiglu_split_tokens(x_BTD, gate_DF, up_DF, down_FD, axis: str, dtype):
    """down(silu(x W_gate) * (x W_up)) for x [B, T, D] split over mesh axis `axis` along T, the weights
    split over it along F (gate, up [D, F], down [F, D]); -> [B, T, D] split the same way, in dtype."""
    mesh = jax.sharding.get_abstract_mesh()
    n, T, F = mesh.shape[axis], x_BTD.shape[1], gate_DF.shape[1]
    j = group_rings(F, T // n, rings(axis, n))
    tokens, weights = ring_steps(axis, n, 0, j), ring_steps(axis, n, j)

    def local(x, gate, up, down):
        gate, up = gather_steps(gate, weights, 1), gather_steps(up, weights, 1)
        down = gather_steps(down, weights, 0)
        if tokens:
            x = gather_steps(x, tokens, 1)  # the group's tokens, in its order
        h = (jax.nn.silu(einsum("BTD,DF->BTF", x, gate, dtype=dtype)) * einsum("BTD,DF->BTF", x, up, dtype=dtype))
        y = einsum("BTF,FD->BTD", h, down, dtype=dtype)  # this device's columns' share of every group token
        if tokens:
            y = jax.lax.psum_scatter(y, axis, scatter_dimension=1, tiled=True, axis_index_groups=groups_of(tokens))
        return y

    split = P(None, axis, None)
    return jax.shard_map(local, mesh=mesh, in_specs=(split, P(None, axis), P(None, axis), P(axis, None)),
                         out_specs=split, check_vma=False)(x_BTD, gate_DF, up_DF, down_FD)
