"""Decoder block: x = x + MLA(RMSNorm(x)); x = x + FFN(RMSNorm(x)), FFN dense or MoE."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from k2jax.config import K2Config
from k2jax.nn.mla import MLA
from k2jax.nn.mlp import MLP
from k2jax.nn.moe import MoE
from k2jax.nn.norm import RMSNorm
from k2jax.sharding import constrain


class DecoderBlock(nn.Module):
    """(x [B, T, D], positions [B, T], kv_valid [B, T], cache, layer) -> (x [B, T, D], the new tokens'
    latents {"ckv": [B, T, R], "k_pe": [B, T, P]}); the pair form suits nn.scan.

    cache: None, or a k2jax.ops.paged.PagedCache whose pool holds this block's `group`; the block reads its
    layer's cached tokens from it (`layer`: this block's index in its group, a traced int). experts: see MoE.
    """

    cfg: K2Config
    moe: bool
    param_dtype: jnp.dtype = jnp.float32
    moe_impl: str = "auto"
    attention: str = "auto"
    group: str = ""

    @nn.compact
    def __call__(self, x_BTD, positions_BT, kv_valid_BT, cache=None, experts=None, layer=None):
        cfg, dt = self.cfg, self.param_dtype
        x_BTD = constrain(x_BTD, ("batch", "length", "act_embed"))
        h_BTD = RMSNorm(cfg.rms_norm_eps, dt, "embed", name="input_layernorm")(x_BTD)
        context = None if cache is None else cache.context(self.group, layer, dt)
        attn_BTD, new = MLA(cfg, dt, self.attention, name="self_attn")(h_BTD, positions_BT, kv_valid_BT, context)
        x_BTD = x_BTD + attn_BTD
        h_BTD = RMSNorm(cfg.rms_norm_eps, dt, "embed", name="post_attention_layernorm")(x_BTD)
        if self.moe:
            # Over a cache (inference) padding takes no routed expert: nothing reads its rows. Without one
            # (training, scoring) every position routes, as in the reference, whose router statistics count
            # padding too.
            routed_BT = None if cache is None else kv_valid_BT
            x_BTD = x_BTD + MoE(cfg, dt, self.moe_impl, name="mlp")(h_BTD, experts, layer, routed_BT)
        else:
            x_BTD = x_BTD + MLP(cfg.intermediate_size, dt, name="mlp")(h_BTD)
        return constrain(x_BTD, ("batch", "length", "act_embed")), new
