"""Mixture of experts: sigmoid router with grouped top-k (noaux_tc), routed SwiGLU experts, shared experts.

Letters: T tokens (batch and positions flattened), D model, E routed experts, K top-k, F expert hidden,
G expert groups.

The routed experts run through one of k2jax.ops.moe's dispatch kernels, with the same parameters:
"dense" (`moe_dense`, every expert on every token: the reference), "tiled" (`grouped_moe`, XLA:CPU's
batched-plus-tiles path, reading the layer's experts out of the stacked params; see MoE), "ragged"
(`jax.lax.ragged_dot`) or "gmm" (ragged, with quantized experts read in place by k2jax.ops.gmm's Pallas
kernel: a TPU's default); under a mesh the expert-parallel exchange of k2jax.ops.expert_parallel runs them on
the devices holding them.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from k2jax.config import K2Config
from k2jax.nn.common import param
from k2jax.nn.mlp import MLP
from k2jax.ops.expert_parallel import moe_expert_parallel
from k2jax.ops.moe import moe_dense, moe_grouped

MOE_IMPLS = ("auto", "dense", "tiled", "ragged", "gmm")


class Router(nn.Module):
    """Sigmoid scores, bias-corrected grouped top-k choice, weights from the unbiased scores.

    x [T, D] -> (topk_idx [T, K] int32, topk_weight [T, K] float32). All in float32.

    When the "intermediates" collection is mutable, sows the training statistics of `router_stats`; x then
    holds `batch` sequences of equal length, one after the other.
    """

    cfg: K2Config

    @nn.compact
    def __call__(self, x_TD, batch: int = 1):
        cfg = self.cfg
        E = cfg.n_routed_experts
        # Kept in float32 whatever the model's dtype, as transformers does (the release's bf16 values
        # convert exactly); the bias only shifts which experts win.
        w_DE = param(self, "kernel", (x_TD.shape[-1], E), ("embed", "router_experts"), jnp.float32)
        bias_E = param(self, "e_score_correction_bias", (E,), ("router_experts",), jnp.float32,
                       nn.initializers.zeros)
        logits_TE = jnp.einsum("TD,DE->TE", x_TD.astype(jnp.float32), w_DE.astype(jnp.float32),
                               precision=jax.lax.Precision.HIGHEST)
        idx_TK, weight_TK = route(logits_TE, bias_E, cfg)
        if self.is_mutable_collection("intermediates"):
            for name, value in router_stats(logits_TE, idx_TK, cfg, batch).items():
                self.sow("intermediates", name, value)
        return idx_TK, weight_TK


def router_stats(logits_TE, idx_TK, cfg: K2Config, batch: int = 1) -> dict:
    """Training statistics of one router call (T = batch sequences of equal length, flattened):
    load [E] float32 (tokens routed to each expert); bias_changed (fraction of tokens whose top-k set differs
    from the choice with a zero correction bias); seq_balance, DeepSeek-V3's sequence-wise balance term
    Σ_e f_e P_e (f_e = E/(K·T_seq) × tokens of the sequence choosing e, P_e = the sequence's mean of the
    scores normalized over all experts), averaged over the sequences; α is the caller's."""
    T, E = logits_TE.shape
    K = cfg.num_experts_per_tok
    chosen_TE = jnp.zeros((T, E), jnp.float32).at[jnp.arange(T)[:, None], idx_TK].set(1.0)
    unbiased_TK, _ = route(logits_TE, jnp.zeros((E,), jnp.float32), cfg)
    changed_T = jnp.any(jnp.sort(unbiased_TK, -1) != jnp.sort(idx_TK, -1), -1)
    scores_TE = jax.nn.sigmoid(logits_TE)
    prob_BSE = (scores_TE / scores_TE.sum(-1, keepdims=True)).reshape(batch, -1, E)
    f_BE = chosen_TE.reshape(batch, -1, E).mean(1) * (E / K)
    return {"load": chosen_TE.sum(0), "bias_changed": changed_T.mean(),
            "seq_balance": (f_BE * prob_BSE.mean(1)).sum(-1).mean()}


def route(logits_TE, bias_E, cfg: K2Config):
    """noaux_tc routing from float32 router logits [T, E]; see Router."""
    T, E = logits_TE.shape
    G, K = cfg.n_group, cfg.num_experts_per_tok
    scores_TE = jax.nn.sigmoid(logits_TE)
    choice_TE = scores_TE + bias_E
    if G > 1:
        # A group's score is the sum of its two best biased scores; experts outside the best topk_group
        # groups are excluded with -inf (transformers; the released remote code writes 0.0).
        choice_TGe = choice_TE.reshape(T, G, E // G)
        group_TG = jax.lax.top_k(choice_TGe, 2)[0].sum(-1)
        keep_idx = jax.lax.top_k(group_TG, cfg.topk_group)[1]
        keep_TG = jnp.zeros((T, G), bool).at[jnp.arange(T)[:, None], keep_idx].set(True)
        choice_TE = jnp.where(keep_TG[:, :, None], choice_TGe, -jnp.inf).reshape(T, E)
    _, idx_TK = jax.lax.top_k(choice_TE, K)
    weight_TK = jnp.take_along_axis(scores_TE, idx_TK, axis=-1)  # unbiased scores weigh the outputs
    if cfg.norm_topk_prob:
        weight_TK = weight_TK / (weight_TK.sum(-1, keepdims=True) + 1e-20)
    return idx_TK.astype(jnp.int32), weight_TK * cfg.routed_scaling_factor


class Experts(nn.Module):
    """The routed experts' stacked weights: gate/up [E, D, F], down [E, F, D]."""

    num_experts: int
    hidden_size: int
    intermediate_size: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self):
        E, D, F, dt = self.num_experts, self.hidden_size, self.intermediate_size, self.param_dtype
        return (param(self, "gate_proj", (E, D, F), ("experts", "embed", "expert_mlp"), dt),
                param(self, "up_proj", (E, D, F), ("experts", "embed", "expert_mlp"), dt),
                param(self, "down_proj", (E, F, D), ("experts", "expert_mlp", "embed"), dt))


class MoE(nn.Module):
    """x [B, T, D] -> [B, T, D]: Σ_k w_k · Expert_k(x) + SharedExperts(x)."""

    cfg: K2Config
    param_dtype: jnp.dtype = jnp.float32
    impl: str = "auto"  # one of MOE_IMPLS
    tile: int | None = None  # CPU grouped path: rows per overflow tile (None: by shape; see grouped_moe)
    capacity: int | None = None  # CPU grouped path: rows per expert in the batched matmul (None: by shape)

    @nn.compact
    def __call__(self, x_BTD, stacks=None, layer=None, valid_BT=None):
        """valid_BT: [B, T] bool, or None (every token real). Padding tokens (False) take no routed expert
        (their rows get the shared experts only; nobody reads them): padding shares one input, so it would
        all choose the same K experts and pile onto them (a ragged step's partly filled chunk region: a
        272-token chunk in a 512-token region sends ~240 rows to each of 8 experts, past their capacity).
        The expert-parallel exchange still routes every token. The decoder block passes its mask only in
        steps over a cache.

        stacks, layer: the routed experts of every MoE layer as the params hold them, stacked on the layer axis
        ({"gate_proj": [L, E, D, F], "up_proj": [L, E, D, F], "down_proj": [L, E, F, D]}, plain or QuantizedWeight;
        or a runtime's per-layer arrays of them, k2jax.nn.model.expert_views: {"gate_proj": (L arrays [E, D, F] or
        k2jax.ops.moe.OutputMajor copies), ...}), which K2Model passes whole to its scan over the layers, and this
        layer's index, a traced int. The XLA:CPU path ("tiled", one device) then computes this layer's experts
        straight out of them (k2jax.ops.moe.moe_grouped): the scan's per-layer slice of the params, which XLA:CPU
        copies whole before a matmul reads it, is read only to differentiate. So does the expert-parallel "gmm" path
        (a TPU's): its kernel reads the layer's tiles out of the stacks, where XLA:TPU would copy the slice whole
        before the kernel reads it. Without them (init), and on the other paths, the experts are this module's own
        params."""
        cfg = self.cfg
        B, T, D = x_BTD.shape
        x_TD = x_BTD.reshape(B * T, D)
        idx_TK, weight_TK = Router(cfg, name="gate")(x_TD, B)
        sharded = jax.sharding.get_abstract_mesh().size > 1
        if valid_BT is not None and not sharded:  # expert E: held nowhere, adds nothing (see k2jax.ops.moe)
            valid_T1 = valid_BT.reshape(B * T, 1)
            idx_TK = jnp.where(valid_T1, idx_TK, cfg.n_routed_experts)
            weight_TK = jnp.where(valid_T1, weight_TK, 0.0)
        impl = self.impl
        if impl == "auto":
            impl = {"cpu": "tiled", "tpu": "gmm"}.get(jax.default_backend(), "ragged")
        if impl not in MOE_IMPLS:
            raise ValueError(f"MoE impl must be one of {MOE_IMPLS}, got {impl!r}")
        w = Experts(cfg.n_routed_experts, D, cfg.moe_intermediate_size, self.param_dtype, name="experts")()
        if impl == "dense":
            y_TD = moe_dense(x_TD, idx_TK, weight_TK, *w)
        elif sharded:
            # the stacks themselves (not a runtime's per-layer views): the gmm path reads the layer in place
            whole = stacks is not None and not isinstance(stacks["gate_proj"], (tuple, list))
            y_TD = moe_expert_parallel(x_TD, idx_TK, weight_TK, *w, impl=impl, tile=self.tile or 64,
                                       stacks=(stacks["gate_proj"], stacks["up_proj"], stacks["down_proj"])
                                       if whole else None, layer=layer)
        else:
            if stacks is not None:
                stacks = (stacks["gate_proj"], stacks["up_proj"], stacks["down_proj"])
            y_TD = moe_grouped(x_TD, idx_TK, weight_TK, *w, impl=impl, tile=self.tile, capacity=self.capacity,
                               stacks=stacks, layer=layer)
        y_BTD = y_TD.reshape(B, T, D)
        if cfg.n_shared_experts:
            y_BTD = y_BTD + MLP(cfg.shared_intermediate_size, self.param_dtype, name="shared_experts")(x_BTD)
        return y_BTD
