"""K2Model: embed -> dense blocks -> MoE blocks (each group under nn.scan) -> final norm -> lm_head."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from k2jax.config import K2Config
from k2jax.nn.block import DecoderBlock
from k2jax.nn.common import param
from k2jax.nn.norm import RMSNorm


class K2Model(nn.Module):
    """tokens [B, T] int32 -> logits [B, T, V] float32.

    positions [B, T] default to 0..T-1; attention_mask [B, S] (1 = real token) is combined with the causal
    mask. Computation runs in `param_dtype`; norms, softmax and the router in float32.
    """

    cfg: K2Config
    param_dtype: jnp.dtype = jnp.float32
    moe_impl: str = "auto"

    @nn.compact
    def __call__(self, tokens_BT, positions_BT=None, attention_mask_BS=None):
        cfg, dt = self.cfg, self.param_dtype
        B, T = tokens_BT.shape
        if positions_BT is None:
            positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        mask_BTS = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
        if attention_mask_BS is not None:
            mask_BTS = mask_BTS & attention_mask_BS.astype(bool)[:, None, :]

        embed_VD = param(self, "embed_tokens", (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dt,
                         nn.initializers.normal(1.0))
        x_BTD = embed_VD[tokens_BT]
        for name, n, moe in (("dense_layers", cfg.num_dense_layers, False),
                             ("moe_layers", cfg.num_moe_layers, True)):
            if n:
                x_BTD, _ = scanned_blocks(n)(cfg, moe, dt, self.moe_impl, name=name)(x_BTD, positions_BT, mask_BTS)
        x_BTD = RMSNorm(cfg.rms_norm_eps, dt, "embed", name="norm")(x_BTD)
        if cfg.tie_word_embeddings:
            head_DV = embed_VD.T
        else:
            head_DV = param(self, "lm_head", (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), dt)
        return jnp.einsum("BTD,DV->BTV", x_BTD, head_DV, preferred_element_type=jnp.float32)


def scanned_blocks(length: int):
    """DecoderBlock repeated `length` times under nn.scan: params stacked on a leading, unsharded 'layers'
    axis, so compile time does not grow with depth."""
    return nn.scan(DecoderBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                   in_axes=(nn.broadcast, nn.broadcast), length=length,
                   metadata_params={nn.PARTITION_NAME: "layers"})


def init_params(cfg: K2Config, rng=None, param_dtype=jnp.float32, moe_impl="auto"):
    """Random params (unboxed nested dict) for `cfg`."""
    rng = jax.random.PRNGKey(0) if rng is None else rng
    model = K2Model(cfg, param_dtype, moe_impl)
    return nn.unbox(jax.jit(model.init)(rng, jnp.zeros((1, 1), jnp.int32))["params"])


def abstract_params(cfg: K2Config, param_dtype=jnp.float32):
    """The param tree as jax.ShapeDtypeStruct leaves, with no memory allocated (serves the full 1T config)."""
    boxed = jax.eval_shape(K2Model(cfg, param_dtype).init, jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32))
    return nn.unbox(boxed["params"])


def param_axes(cfg: K2Config):
    """Logical axis names of every param (same tree as abstract_params), from the modules' annotations."""
    boxed = jax.eval_shape(K2Model(cfg).init, jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32))
    return nn.get_partition_spec(boxed["params"])
