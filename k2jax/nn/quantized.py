"""Which params a quantization holds quantized, and the param tree with QuantizedWeight leaves.

- "fp8": every linear weight of the decoder blocks, as the Kimi-K2-Instruct release has them: the attention
  projections, the dense MLP, the shared and the routed experts. The router kernel, norms, embed_tokens and
  lm_head stay plain.
- "int4": the routed experts only (gate/up/down_proj of the MoE layers), as Kimi-K2-Thinking is released;
  everything else stays plain.

The quantized values are not differentiable (fp8 / packed integers): train the plain params and hold the
QuantizedWeight leaves frozen (k2jax.train does).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from k2jax.ops.quant import FORMATS, QuantizedWeight, held_shapes, is_quantized, quantize

QUANT_MODES = (None,) + tuple(FORMATS)
_BLOCK_LINEARS = ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
                  "gate_proj", "up_proj", "down_proj")
_IN_NDIM = {"o_proj": 2}  # [N, V, D]: heads and head dim are the input; the rest have one input dim
_LEAD_AXES = ("layers", "experts")


def check_quant(quant) -> None:
    if quant not in QUANT_MODES:
        raise ValueError(f"quant must be one of {QUANT_MODES}, got {quant!r}")


def quantized_layout(path: tuple[str, ...], quant) -> tuple[int, int] | None:
    """(lead_ndim, in_ndim) of the param at `path` (dict keys, stacked layout) if `quant` holds it quantized,
    else None."""
    if quant is None or path[0] not in ("dense_layers", "moe_layers") or path[-1] not in _BLOCK_LINEARS:
        return None
    routed = path[0] == "moe_layers" and "experts" in path[:-1]
    if quant == "int4" and not routed:
        return None
    return 1 + routed, _IN_NDIM.get(path[-1], 1)


def _keys(path) -> tuple[str, ...]:
    return tuple(getattr(k, "key", getattr(k, "name", None)) for k in path)


def quantize_params(params, cfg=None, quant: str | None = "fp8"):
    """A plain param tree (stacked layout) -> the same tree with the params `quant` holds quantized replaced
    by QuantizedWeight (absmax per block: FP8 128x128 blocks, INT4 groups of 32 inputs; lossy). numpy or jax
    leaves in, the same kind out. cfg is accepted for symmetry with abstract_params (the layout comes from
    the param names)."""
    check_quant(quant)

    def one(path, v):
        layout = quantized_layout(_keys(path), quant)
        if layout is None or is_quantized(v):
            return v
        lead, ni = layout
        return quantize(v, quant, in_ndim=ni, lead_ndim=lead)

    return jax.tree_util.tree_map_with_path(one, params, is_leaf=is_quantized)


def dequantize_params(params, dtype=np.float32):
    """Every QuantizedWeight leaf dequantized to `dtype` (the reference): the plain tree the quantized one
    stands for."""
    return jax.tree_util.tree_map(lambda v: v.dequantize(dtype) if is_quantized(v) else v, params,
                                  is_leaf=is_quantized)


def abstract_quantized(shapes, quant):
    """Abstract plain params (jax.ShapeDtypeStruct) -> the quantized tree's abstract leaves."""
    check_quant(quant)

    def one(path, v):
        layout = quantized_layout(_keys(path), quant)
        if layout is None:
            return v
        lead, ni = layout
        return held_shapes(v.shape, quant, in_ndim=ni, lead_ndim=lead)

    return jax.tree_util.tree_map_with_path(one, shapes)


def quantized_axes(axes, quant):
    """Logical axis names of the plain params (PartitionSpec leaves) -> QuantizedWeight leaves holding the
    values' names (packed INT4 values keep the weight's: the packed axis is the output axis, halved) and the
    scales' names: the lead axes', then the first input dim's name for the input blocks and the first
    output dim's for the output blocks, so the scales shard with their blocks through the rules table."""
    check_quant(quant)

    def one(path, names):
        layout = quantized_layout(_keys(path), quant)
        if layout is None:
            return names
        lead, ni = layout
        names = tuple(names)
        return QuantizedWeight(P(*names), P(*names[:lead], names[lead], names[lead + ni]), quant, ni)

    return jax.tree_util.tree_map_with_path(one, axes, is_leaf=lambda x: isinstance(x, P))
