"""THE quantization policy, in one table: which params each format holds quantized, the block of inputs x
outputs that shares one scale, the dtypes held, and how the scales are placed on a mesh.

Everything that knows about quantization reads it: the held tree (k2jax.nn.quantized, abstract_params), the
on-device format (k2jax.ops.quant.QuantizedWeight, its scales' placement), the HF release tables and the
converter (k2jax.checkpoint), `k2jax info` and the sharding plan.

A quantized param is a linear weight in k2jax's einsum layout [*lead, *in, *out] (lead: the stacked layer axis,
then the expert axis of the routed experts; in: the contraction dims; out: the rest), held as
QuantizedWeight(values, scales) over the flattened [In, Out] matrix:

    w[..., i, o] = values[..., i, o] * scales[..., i // block_in, o // block_out]

    values [*lead, *in, *out]                    (int4: two 4-bit values per uint8 along the last axis)
    scales [*lead, ceil(In / block_in), ceil(Out / block_out)]

Scale placement (k2jax.ops.quant.scale_partition applies it): the scales shard with their blocks. Their lead
dims take the values' mesh axes; the input-block dim takes the mesh axes of the values' first input dim and
the output-block dim those of the first output dim, where each shard then holds whole blocks; along a dim
where it would not, the scales are replicated (every device holds all of the few scales and reads those of
its shard).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    """One row of the table."""

    name: str
    release: str  # the checkpoint that is released so
    routed_experts_only: bool  # False: every linear weight of the decoder blocks
    block: tuple[int, int]  # (inputs, outputs) sharing one scale
    values: str  # dtype of the held values
    scales: str  # dtype of the held scales
    qmax: float  # the largest value magnitude: scale = absmax of the block / qmax


FORMATS: dict[str, QuantFormat] = {
    # Kimi-K2-Instruct: e4m3 weights with a float32 `weight_scale_inv` per 128x128 block.
    "fp8": QuantFormat("fp8", "Kimi-K2-Instruct", False, (128, 128),
                       "float8_e4m3fn", "float32", 448.0),
    # Kimi-K2-Thinking / K2.5: compressed-tensors "pack-quantized" symmetric INT4, one bf16 scale per output
    # column and group of 32 inputs (bf16 as released: float32 scales would add 2 bits per weight).
    "int4": QuantFormat("int4", "Kimi-K2-Thinking / K2.5", True, (32, 1),
                        "uint8", "bfloat16", 7.0),
}
QUANT_MODES = (None, *FORMATS)

# The linear weights of a decoder block (attention, dense MLP, shared and routed experts), by param name, with
# how many of their dims after the lead axes are input dims: o_proj [N, V, D] contracts heads and head dim.
# The router kernel, norms, embed_tokens and lm_head are never quantized.
BLOCK_LINEARS: dict[str, int] = {"q_a_proj": 1, "q_b_proj": 1, "q_proj": 1, "kv_a_proj_with_mqa": 1,
                                 "kv_b_proj": 1, "o_proj": 2, "gate_proj": 1, "up_proj": 1, "down_proj": 1}
LAYER_STACKS = ("dense_layers", "moe_layers")


def check_quant(quant) -> None:
    """ValueError naming `quant` unless it is one of QUANT_MODES."""
    if quant not in QUANT_MODES:
        raise ValueError(f"quant must be one of {QUANT_MODES}, got {quant!r}")


def is_routed_expert(path: tuple[str, ...]) -> bool:
    """Whether the param at `path` (dict keys, stacked layout) is a routed expert stack [L, E, ...]."""
    return path[0] == "moe_layers" and "experts" in path[:-1]


def stacked_axes(path: tuple[str, ...]) -> int:
    """Leading stacked axes of the param at `path`: 0 (global), 1 (layers) or 2 (layers, experts)."""
    return 0 if path[0] not in LAYER_STACKS else 1 + is_routed_expert(path)


def quantized_layout(path: tuple[str, ...], quant) -> tuple[int, int] | None:
    """(lead_ndim, in_ndim) of the param at `path` (dict keys, stacked layout) if `quant` holds it quantized,
    else None."""
    if quant is None or path[0] not in LAYER_STACKS or path[-1] not in BLOCK_LINEARS:
        return None
    if FORMATS[quant].routed_experts_only and not is_routed_expert(path):
        return None
    return stacked_axes(path), BLOCK_LINEARS[path[-1]]
