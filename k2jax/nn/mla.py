"""Multi-head latent attention (MLA), the steps of the design card in order.

Letters: B batch, T query positions, S key positions, D model, N heads, Q q_lora_rank, R kv_lora_rank,
C = R + P (kv_a output), K nope head dim, P rope head dim, H = K + P (q/k head dim), V value head dim.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from k2jax.config import K2Config
from k2jax.nn.common import param
from k2jax.ops.attention import attend_absorbed, attend_blocked, attend_expanded
from k2jax.ops.matmul import einsum
from k2jax.ops.quant import materialize
from k2jax.nn.norm import RMSNorm
from k2jax.nn.rope import apply_rope

MODES = ("full", "causal", "prefill", "decode", "decode_expanded")


class MLA(nn.Module):
    """x [B, T, D], positions [B, T] -> [B, T, D]; what else goes in and out depends on `mode`:

    - "full": mask [B, T, T] (True = may attend); expanded attention (the plain reference) -> out.
    - "causal": mask = kv_valid [B, T] (causal implied); blocked expanded attention, which skips the tiles
      above the diagonal (k2jax.ops.attention) -> out. What K2Model's forward runs.
    - "prefill": mask = kv_valid [B, T] (causal implied); blocked expanded attention (k2jax.ops.attention)
      -> (out, {"ckv": [B, T, R], "k_pe": [B, T, P]}), the latents to cache.
    - "decode": cache {"ckv": [B, S, R], "k_pe": [B, S, P]} (this layer's), the T tokens' latents placed at
      slots index..index+T-1 of it, then absorbed attention over it under mask [B, T, S] -> (out, the T
      tokens' latents {"ckv": [B, T, R], "k_pe": [B, T, P]}: the caller writes them into its cache).
      "decode_expanded": the same with expanded attention (the reference; bench/decode.py times both).
    """

    cfg: K2Config
    param_dtype: jnp.dtype = jnp.float32
    mode: str = "full"  # one of MODES

    @nn.compact
    def __call__(self, x_BTD, positions_BT, mask, cache=None, index=None):
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

        # Keys and values: one shared latent ckv (normalised) and one shared rotary key k_pe.
        w_kv_a_DC = param(self, "kv_a_proj_with_mqa", (D, R + P), ("embed", "kv_lora"), dt)
        kv_a_BSC = einsum("BSD,DC->BSC", x_BTD, w_kv_a_DC, dtype=dt)
        ckv_BSR = RMSNorm(1e-6, dt, "kv_lora", name="kv_a_layernorm")(kv_a_BSC[..., :R])
        k_pe_BSP = kv_a_BSC[..., R:]

        q_pe_BTNP = apply_rope(q_pe_BTNP, positions_BT, cfg)
        k_pe_BSP = apply_rope(k_pe_BSP[:, :, None, :], positions_BT, cfg)[:, :, 0, :]

        # A quantized kv_b_proj is dequantized once per layer and step here (R x N x (K+V), small): the
        # attention kernels use it two ways (expanding the cache, or absorbed into the query and output).
        w_kv_b_RNX = materialize(param(self, "kv_b_proj", (R, N, K + V), ("kv_lora", "heads", "head_dim"), dt), dt)
        w_o_NVD = param(self, "o_proj", (N, V, D), ("heads", "head_dim", "embed"), dt)
        attn = (q_nope_BTNK, q_pe_BTNP, ckv_BSR, k_pe_BSP, w_kv_b_RNX, mask, cfg.softmax_scale)
        if self.mode == "full":
            return einsum("BTNV,NVD->BTD", attend_expanded(*attn), w_o_NVD, dtype=dt)
        if self.mode == "causal":
            return einsum("BTNV,NVD->BTD", attend_blocked(*attn), w_o_NVD, dtype=dt)
        if self.mode == "prefill":
            out_BTNV, kv = attend_blocked(*attn), {"ckv": ckv_BSR, "k_pe": k_pe_BSP}
        elif self.mode in ("decode", "decode_expanded"):
            kv = {"ckv": ckv_BSR.astype(cache["ckv"].dtype), "k_pe": k_pe_BSP.astype(cache["k_pe"].dtype)}
            seen = {k: jax.lax.dynamic_update_slice_in_dim(cache[k], kv[k], index, axis=1) for k in kv}
            attend = attend_absorbed if self.mode == "decode" else attend_expanded
            out_BTNV = attend(q_nope_BTNK, q_pe_BTNP, seen["ckv"], seen["k_pe"], w_kv_b_RNX, mask, cfg.softmax_scale)
        else:
            raise ValueError(f"MLA mode must be one of {MODES}, got {self.mode!r}")
        return einsum("BTNV,NVD->BTD", out_BTNV, w_o_NVD, dtype=dt), kv

