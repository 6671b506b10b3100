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
    """(x [B, T, D], positions [B, T], mask) -> (x [B, T, D], kv); the pair form suits nn.scan.

    `mode`, `mask`, `index` and kv as in MLA: kv is None in "full" and "causal" modes, the new tokens' latents
    otherwise. `layer` is this block's index in its group: decode's `cache` holds the whole group
    ({"ckv": [L, B, S, R], "k_pe": [L, B, S, P]}) and the block reads its layer's part; `experts`: see MoE.
    """

    cfg: K2Config
    moe: bool
    param_dtype: jnp.dtype = jnp.float32
    moe_impl: str = "auto"
    mode: str = "full"

    @nn.compact
    def __call__(self, x_BTD, positions_BT, mask, cache=None, index=None, experts=None, layer=None):
        cfg, dt = self.cfg, self.param_dtype
        x_BTD = constrain(x_BTD, ("batch", "length", "act_embed"))
        h_BTD = RMSNorm(cfg.rms_norm_eps, dt, "embed", name="input_layernorm")(x_BTD)
        if cache is not None:
            cache = {k: v[layer] for k, v in cache.items()}
        attn = MLA(cfg, dt, self.mode, name="self_attn")(h_BTD, positions_BT, mask, cache, index)
        attn_BTD, kv = (attn, None) if self.mode in ("full", "causal") else attn
        x_BTD = x_BTD + attn_BTD
        h_BTD = RMSNorm(cfg.rms_norm_eps, dt, "embed", name="post_attention_layernorm")(x_BTD)
        if self.moe:
            x_BTD = x_BTD + MoE(cfg, dt, self.moe_impl, name="mlp")(h_BTD, experts, layer)
        else:
            x_BTD = x_BTD + MLP(cfg.intermediate_size, dt, name="mlp")(h_BTD)
        return constrain(x_BTD, ("batch", "length", "act_embed")), kv
