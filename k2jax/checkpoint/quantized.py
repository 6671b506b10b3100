"""Which params a quantized load holds as `QuantizedWeight`, in which layout: from the name table.

quant "fp8":  every linear weight of the decoder blocks the FP8 release stores as F8_E4M3 (names.RULES' fp8
              column: attention projections, dense MLP, shared and routed experts; not the router, norms,
              embeddings or lm_head), as e4m3 values + float32 128x128 block scales.
quant "int4": the routed experts (names.INT4_RULES), as packed 4-bit values + bf16 scales per group of 32
              inputs; everything else plain.

The weights sit in k2jax's einsum layout [*stack, *in, *out] (stack: the layer and expert axes); `in_ndim`
is how many slot dims are HF's input dim (o_proj [N, H, D]: 2; every other weight: 1).
"""

from __future__ import annotations

import functools
import math

from k2jax.checkpoint import names as N
from k2jax.config import K2Config

QUANTS = ("fp8", "int4")


def check_quant(quant) -> str | None:
    if quant is not None and quant not in QUANTS:
        raise ValueError(f"quant must be None, 'fp8' or 'int4', got {quant!r}")
    return quant


@functools.lru_cache(maxsize=32)
def quantized_leaves(cfg: K2Config, quant: str | None) -> dict[tuple[str, ...], tuple[int, int]]:
    """Leaf path -> (stack axes, in_ndim) of each param held quantized under `quant` (empty for None)."""
    if check_quant(quant) is None:
        return {}
    shapes = N.leaf_shapes(cfg)
    out = {}
    for template, path, transform, fp8 in N.RULES:
        if not (fp8 if quant == "fp8" else template in N.INT4_RULES) or "{i}" not in template:
            continue
        for group in ("dense_layers", "moe_layers"):
            leaf = (group, *path.split("/"))
            if leaf in shapes:
                stack = 2 if "{e}" in template else 1
                slot = shapes[leaf][stack:]
                in_ndim = len(slot) - 1 if transform is N.T.TRANSPOSE_SPLIT_IN else 1
                out[leaf] = (stack, in_ndim)
    return out


def quantized_shapes(shape: tuple[int, ...], fmt: str, stack: int, in_ndim: int):
    """(values shape, values dtype, scales shape, scales dtype) of a QuantizedWeight of logical `shape`."""
    import jax.numpy as jnp

    slot = shape[stack:]
    In, Out = math.prod(slot[:in_ndim]), math.prod(slot[in_ndim:])
    if fmt == "fp8":
        return shape, jnp.float8_e4m3fn, (*shape[:stack], -(-In // 128), -(-Out // 128)), jnp.float32
    if Out % 2 or In % 32:
        raise ValueError(f"int4 needs an even output dim and an input dim divisible by 32, got In={In}, Out={Out}")
    return (*shape[:-1], shape[-1] // 2), jnp.uint8, (*shape[:stack], In // 32, Out), jnp.bfloat16


def abstract_quantized(cfg: K2Config, dtype, quant: str | None):
    """abstract_params(cfg, dtype) with the `quant` leaves as QuantizedWeight of jax.ShapeDtypeStruct."""
    import jax

    from k2jax.nn.model import abstract_params
    from k2jax.ops.quant import QuantizedWeight

    tree = abstract_params(cfg, dtype)
    q = quantized_leaves(cfg, quant)

    def leaf(path, v):
        key = tuple(k.key for k in path)
        if key not in q:
            return v
        stack, in_ndim = q[key]
        vs, vd, ss, sd = quantized_shapes(tuple(v.shape), quant, stack, in_ndim)
        return QuantizedWeight(jax.ShapeDtypeStruct(vs, vd), jax.ShapeDtypeStruct(ss, sd), quant, in_ndim)

    return jax.tree_util.tree_map_with_path(leaf, tree)
