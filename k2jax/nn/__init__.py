"""Flax linen modules of the DeepSeek-V3 / Kimi K2 architecture, one file per step of the design card."""

from k2jax.nn.block import DecoderBlock
from k2jax.nn.mla import MLA
from k2jax.nn.mlp import MLP
from k2jax.nn.model import K2Model
from k2jax.nn.moe import MoE, Router
from k2jax.nn.norm import RMSNorm

__all__ = ["DecoderBlock", "K2Model", "MLA", "MLP", "MoE", "RMSNorm", "Router"]
