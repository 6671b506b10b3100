"""Multi-head latent attention (MLA), the steps of the design card in order.

Letters: B batch, T query positions, S key positions, D model, N heads, Q q_lora_rank, R kv_lora_rank,
C = R + P (kv_a output), K nope head dim, P rope head dim, H = K + P (q/k head dim), V value head dim.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from k2jax.config import K2Config
from k2jax.nn.common import param
from k2jax.ops.attention import attend_with_prefix
from k2jax.ops.matmul import einsum
from k2jax.ops.quant import materialize
from k2jax.nn.norm import RMSNorm
from k2jax.nn.rope import apply_rope


class MLA(nn.Module):
    """x [B, T, D], positions [B, T], kv_valid [B, T] (True = a real token; causal implied), context ->
    (out [B, T, D], the T tokens' latents {"ckv": [B, T, R], "k_pe": [B, T, P]} for the cache).

    context: None (the tokens attend to themselves only), this layer's cached tokens (ckv [B, S, R],
    k_pe [B, S, P], valid [B, S]), a prefix every new token may see where valid, or a cache's view of this
    layer that attends itself (k2jax.ops.paged.PagedContext, k2jax.ops.ragged.RaggedContext). The attention
    form follows from the shapes (k2jax.ops.attention.attend); `attention` "plain" takes the plain expanded
    form instead (the reference).
    """

    cfg: K2Config
    param_dtype: jnp.dtype = jnp.float32
    attention: str = "auto"  # one of k2jax.ops.attention.ATTENTION_IMPLS

    @nn.compact
    def __call__(self, x_BTD, positions_BT, kv_valid_BT, context=None):
        cfg, dt = self.cfg, self.param_dtype
        D, N = cfg.hidden_size, cfg.num_attention_heads
        K, P, V, R = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank

        # Queries: low-rank (W_DQ, norm, W_UQ) or one projection when q_lora_rank is null.
        if cfg.q_lora_rank is not None:
            Q = cfg.q_lora_rank
            cq_BTQ = einsum("BTD,DQ->BTQ", x_BTD, param(self, "q_a_proj", (D, Q), ("embed", "q_lora"), dt), dtype=dt)
            cq_BTQ = RMSNorm(1e-6, dt, "q_lora", name="q_a_layernorm")(cq_BTQ)
            w_q_QNH = param(self, "q_b_proj", (Q, N, K + P), ("q_lora", "heads", "head_dim"), dt)
            q_BTNH = einsum("BTQ,QNH->BTNH", cq_BTQ, w_q_QNH, dtype=dt)
        else:
            w_q_DNH = param(self, "q_proj", (D, N, K + P), ("embed", "heads", "head_dim"), dt)
            q_BTNH = einsum("BTD,DNH->BTNH", x_BTD, w_q_DNH, dtype=dt)
        q_nope_BTNK, q_pe_BTNP = q_BTNH[..., :K], q_BTNH[..., K:]

        # Keys and values: one shared latent ckv (normalised) and one shared rotary key k_pe per token.
        w_kv_a_DC = param(self, "kv_a_proj_with_mqa", (D, R + P), ("embed", "kv_lora"), dt)
        kv_a_BTC = einsum("BTD,DC->BTC", x_BTD, w_kv_a_DC, dtype=dt)
        ckv_BTR = RMSNorm(1e-6, dt, "kv_lora", name="kv_a_layernorm")(kv_a_BTC[..., :R])
        k_pe_BTP = kv_a_BTC[..., R:]

        q_pe_BTNP = apply_rope(q_pe_BTNP, positions_BT, cfg)
        k_pe_BTP = apply_rope(k_pe_BTP[:, :, None, :], positions_BT, cfg)[:, :, 0, :]
        new = {"ckv": ckv_BTR, "k_pe": k_pe_BTP}

        # A quantized kv_b_proj is dequantized once per layer and step here (R x N x (K+V), small): the
        # attention kernels use it two ways (expanding the keys, or absorbed into the query and output).
        w_kv_b_RNX = materialize(param(self, "kv_b_proj", (R, N, K + V), ("kv_lora", "heads", "head_dim"), dt), dt)
        w_o_NVD = param(self, "o_proj", (N, V, D), ("heads", "head_dim", "embed"), dt)
        if hasattr(context, "attend"):  # a paged or ragged cache's layer: it reads its pool itself
            out_BTNV = context.attend(q_nope_BTNK, q_pe_BTNP, ckv_BTR, k_pe_BTP, w_kv_b_RNX, kv_valid_BT,
                                      cfg.softmax_scale, self.attention)
        else:  # the cached prefix as arrays (if any), then the new tokens themselves
            out_BTNV = attend_with_prefix(q_nope_BTNK, q_pe_BTNP, ckv_BTR, k_pe_BTP, w_kv_b_RNX, kv_valid_BT,
                                          cfg.softmax_scale, dt, self.attention, context)
        return einsum("BTNV,NVD->BTD", out_BTNV, w_o_NVD, dtype=dt), new
