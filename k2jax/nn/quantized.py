"""Param trees with QuantizedWeight leaves: made from a plain tree, abstract, their axis names, and the one
conversion between formats a load makes. Which params each format holds is the table in k2jax.quant_policy:

- "fp8": every linear weight of the decoder blocks, as the Kimi-K2-Instruct release has them: the attention
  projections, the dense MLP, the shared and the routed experts. The router kernel, norms, embed_tokens and
  lm_head stay plain.
- "int4": the routed experts only (gate/up/down_proj of the MoE layers), as Kimi-K2-Thinking is released;
  everything else stays plain.

The quantized values are not differentiable (fp8 / packed integers): train the plain params and hold the
QuantizedWeight leaves frozen (k2jax.train does).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from k2jax.ops.quant import QuantizedWeight, held_shapes, is_quantized, quantize_weight
from k2jax.quant_policy import QUANT_MODES, check_quant, quantized_layout  # noqa: F401  (re-exported)


def _keys(path) -> tuple[str, ...]:
    """A jax key path -> its dict keys (and dataclass field names)."""
    return tuple(getattr(k, "key", getattr(k, "name", None)) for k in path)


def _map_quantized(fn, tree, quant, is_leaf=None):
    """tree with fn(leaf, lead_ndim, in_ndim) at every param `quant` holds quantized, the rest as they are."""
    check_quant(quant)

    def one(path, v):
        layout = quantized_layout(_keys(path), quant)
        return v if layout is None else fn(v, *layout)

    return jax.tree_util.tree_map_with_path(one, tree, is_leaf=is_leaf)


def quantize_params(params, cfg=None, quant: str | None = "fp8"):
    """A plain param tree (stacked layout) -> the same tree with the params `quant` holds quantized replaced
    by QuantizedWeight (absmax per block: FP8 128x128 blocks, INT4 groups of 32 inputs; lossy). numpy or jax
    leaves in, the same kind out. cfg is accepted for symmetry with abstract_params (the layout comes from
    the param names)."""
    return _map_quantized(lambda v, lead, ni: v if is_quantized(v) else quantize_weight(v, quant, ni, lead),
                          params, quant, is_leaf=is_quantized)


def dequantize_params(params, dtype=np.float32):
    """Every QuantizedWeight leaf dequantized to `dtype` (the reference): the plain tree the quantized one
    stands for."""
    return jax.tree_util.tree_map(lambda v: v.dequantize(dtype) if is_quantized(v) else v, params,
                                  is_leaf=is_quantized)


def abstract_quantized(shapes, quant):
    """Abstract plain params (jax.ShapeDtypeStruct) -> the quantized tree's abstract leaves."""
    return _map_quantized(lambda v, lead, ni: held_shapes(v.shape, quant, in_ndim=ni, lead_ndim=lead), shapes, quant)


def quantized_axes(axes, quant):
    """Logical axis names of the plain params (PartitionSpec leaves) -> QuantizedWeight leaves holding the
    values' names (packed INT4 values keep the weight's: the packed axis is the output axis, halved) and the
    scales' names: the lead axes', then the first input dim's name for the input blocks and the first
    output dim's for the output blocks, so the scales shard with their blocks through the rules table."""
    def one(names, lead, ni):
        names = tuple(names)
        return QuantizedWeight(P(*names), P(*names[:lead], names[lead], names[lead + ni]), quant, ni)

    return _map_quantized(one, axes, quant, is_leaf=lambda x: isinstance(x, P))


def requantize_params(params, quant: str | None, dtype, shardings=None):
    """The one conversion a load makes when the stored format is not the one asked for: each QuantizedWeight
    leaf of `params` kept if `quant` holds that param in its format, requantized if in another (an FP8
    routed expert held as INT4: lossy, a second rounding), dequantized to `dtype` if `quant` holds it plain.
    Plain leaves are returned as they are.

    On device, one layer at a time (lax.map over the stacked layer axis: float32 temporaries of one layer),
    each result placed by the matching leaf of `shardings` (the tree of abstract_params(cfg, quant=quant),
    e.g. k2jax.param_shardings(cfg, mesh, quant=quant)); None: where jit puts it."""
    flat_sh = None if shardings is None else dict(jax.tree_util.tree_leaves_with_path(
        shardings, is_leaf=lambda x: isinstance(x, (QuantizedWeight, jax.sharding.Sharding))))

    def one(path, w):
        if not is_quantized(w):
            return w
        layout = quantized_layout(_keys(path), quant)
        if layout is not None and w.fmt == quant:
            return w
        fn = functools.partial(_requantize_layers, quant) if layout else functools.partial(_dequantize_layers, dtype)
        return jax.jit(fn, out_shardings=None if flat_sh is None else flat_sh[path])(w)

    return jax.tree_util.tree_map_with_path(one, params, is_leaf=is_quantized)


def _dequantize_layers(dtype, w: QuantizedWeight):
    return jax.lax.map(lambda layer: layer.dequantize(dtype), w)


def _requantize_layers(fmt, w: QuantizedWeight):
    return jax.lax.map(lambda layer: quantize_weight(layer.dequantize(jnp.float32), fmt, layer.in_ndim,
                                                     layer.lead_ndim), w)
