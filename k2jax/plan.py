"""Memory planning without hardware: bytes per device of the sharded params (and KV cache) on a mesh.

Everything comes from the abstract param tree and the rules table in k2jax.sharding; nothing is allocated,
so it serves the full 1T config on a laptop. Each dim is split only over mesh axes that divide it (a dim
they do not divide falls back, see k2jax.sharding.dividing_axes), so every device holds the same bytes of
each tensor: total / (number of distinct shards). The plan lists the params that fall back and what that
costs each device beyond an even split over the axes their rules name.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from k2jax.config import K2Config
from k2jax.nn.model import abstract_params
from k2jax.ops.quant import QuantizedWeight, is_quantized
from k2jax.placement import Fallback, param_specs
from k2jax.sharding import format_bytes, parse_mesh_spec, shard_count

GiB, GB = 2**30, 10**9
# Memory per chip / GPU (vendor figures; GiB for TPUs, decimal GB for NVIDIA).
PARTS = (("TPU v5e", 16 * GiB), ("TPU v6e", 32 * GiB), ("H100", 80 * GB), ("TPU v5p", 95 * GiB),
         ("H200", 141 * GB))
DTYPES = ("bfloat16", "float8", "int4", "float32")
# What each dtype holds quantized (k2jax.nn.quantized): FP8 as released, e4m3 + a float32 scale per
# 128x128 block (1 + 4/128² bytes per weight); INT4 routed experts, 4 bits + a bf16 scale per 32 inputs
# (0.5 + 2/32 bytes per weight), the rest bf16.
QUANT = {"float8": "fp8", "int4": "int4"}


@dataclasses.dataclass
class Plan:
    """rows: (component, bytes on each device, bytes of one full copy); devices: how many; fallbacks: the
    params whose dims the mesh does not divide (bytes in the plan's dtype)."""

    mesh: dict[str, int]
    dtype: str
    rows: list[tuple[str, float, float]]
    devices: int
    fallbacks: list[Fallback] = dataclasses.field(default_factory=list)

    @property
    def per_device(self) -> float:
        return sum(r[1] for r in self.rows)

    @property
    def total(self) -> float:
        return sum(r[2] for r in self.rows)

    @property
    def replication(self) -> float:
        """Bytes held over all devices / bytes of one copy (1.0 = nothing stored twice)."""
        return self.per_device * self.devices / self.total


def _component(keys: list[str]) -> str:
    if keys[0] in ("embed_tokens", "lm_head"):
        return "embed + lm_head"
    if "experts" in keys:
        return "routed experts"
    if "shared_experts" in keys:
        return "shared experts"
    if "gate" in keys:
        return "router"
    if "self_attn" in keys:
        return "attention"
    if "mlp" in keys:
        return "dense MLP"
    return "norms"


def _held_bytes(leaf, spec, mesh_shape) -> tuple[float, float]:
    """(bytes on each device, bytes of one copy) of one param as a load holds it: a plain array, or a
    QuantizedWeight's values and scales, each split as its spec says (k2jax.sharding.param_specs)."""
    parts = ((leaf.values, spec.values), (leaf.scales, spec.scales)) if is_quantized(leaf) else ((leaf, spec),)
    dev = full = 0.0
    for a, sp in parts:
        nbytes = math.prod(a.shape) * jnp.dtype(a.dtype).itemsize
        dev += nbytes / math.prod(shard_count(e, mesh_shape) for e in sp)
        full += nbytes
    return dev, full


def plan(cfg: K2Config, mesh: str | dict[str, int], dtype: str = "bfloat16", batch: int = 0,
         max_len: int = 0) -> Plan:
    """Per-device bytes of `cfg` sharded by k2jax.sharding's rules on `mesh` ("expert=64,tensor=4").

    dtype: "bfloat16", "float32", "float8" (linear weights of the blocks in the released FP8 layout, the rest
    bf16; the router stays float32 as the model keeps it) or "int4" (routed experts in INT4 groups of 32 as
    Kimi-K2-Thinking, the rest bf16): the bytes a `k2jax.load(..., quant=...)` holds, values and scales. batch, max_len: add the latent KV cache, two tensors
    per layer (ckv [B, S, kv_lora_rank], k_pe [B, S, qk_rope_head_dim]) in bf16 (float32 for float32),
    batch sharded on (data, fsdp).
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    shape = parse_mesh_spec(mesh)
    quant = QUANT.get(dtype)
    act_dtype = jnp.float32 if dtype == "float32" else jnp.bfloat16
    shapes = abstract_params(cfg, act_dtype, quant=quant)
    wanted, specs = param_specs(cfg, quant=quant), param_specs(cfg, shape, quant)
    per_dev: dict[str, float] = {}
    full: dict[str, float] = {}
    fell_back = []
    is_spec = lambda x: isinstance(x, (P, QuantizedWeight))  # noqa: E731
    for (path, spec), want, leaf in zip(jax.tree_util.tree_leaves_with_path(specs, is_leaf=is_spec),
                                        jax.tree_util.tree_leaves(wanted, is_leaf=is_spec),
                                        jax.tree_util.tree_leaves(shapes, is_leaf=is_quantized)):
        keys = [k.key for k in path]
        dev, nbytes = _held_bytes(leaf, spec, shape)
        name = _component(keys)
        per_dev[name] = per_dev.get(name, 0) + dev
        full[name] = full.get(name, 0) + nbytes
        # A fallback is judged on what is split: the (held) values; quantized scales follow them.
        v, sp, w = (leaf.values, spec.values, want.values) if is_quantized(leaf) else (leaf, spec, want)
        f = Fallback(".".join(keys), tuple(v.shape), w, sp, math.prod(v.shape) * jnp.dtype(v.dtype).itemsize, shape)
        if f.extra_bytes_per_device > 0:
            fell_back.append(f)
    rows = [(name, per_dev[name], full[name]) for name in per_dev]
    if batch or max_len:
        if batch <= 0 or max_len <= 0:
            raise ValueError(f"KV cache: --batch ({batch}) and --max-len ({max_len}) must both be positive")
        # As k2jax.generate holds it: the batch padded with filler rows to a multiple of data*fsdp.
        batch_shards = shape["data"] * shape["fsdp"]
        rows_held = -(-batch // batch_shards) * batch_shards
        kv = (cfg.num_hidden_layers * max_len * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
              * jnp.dtype(act_dtype).itemsize)
        padded = f", padded to {rows_held}" if rows_held != batch else ""
        rows.append((f"KV cache {batch}x{max_len}{padded}", kv * rows_held / batch_shards, kv * batch))
    return Plan(shape, dtype, rows, math.prod(shape.values()), fell_back)


def format_plan(p: Plan, reserve: float = 0.1) -> str:
    """The text `k2jax plan` prints: per-device bytes per component and which parts hold it, keeping
    `reserve` (a fraction of each part's memory) free for activations and compiler temporaries."""
    mesh = ",".join(f"{a}={n}" for a, n in p.mesh.items())
    width = max(len(r[0]) for r in p.rows)
    lines = [f"mesh {mesh} ({p.devices} devices), weights in {p.dtype}",
             f"{'component':<{width}}  {'per device':>11}  {'one full copy':>13}"]
    lines += [f"{name:<{width}}  {format_bytes(d):>11}  {format_bytes(f):>13}" for name, d, f in p.rows]
    lines += [f"{'total':<{width}}  {format_bytes(p.per_device):>11}  {format_bytes(p.total):>13}", ""]
    if p.fallbacks:
        extra = sum(f.extra_bytes_per_device for f in p.fallbacks)
        lines += [f"{len(p.fallbacks)} params fall back (the mesh does not divide a dim their rule shards):"]
        lines += [f"  {f.describe().removeprefix('param ')}" for f in p.fallbacks]
        lines += [f"fallback cost: +{format_bytes(extra)} per device vs an even split "
                  f"({100 * extra / p.per_device:.3g}% of the per-device total)", ""]
    lines += [f"every device holds the same bytes; largest device: {format_bytes(p.per_device)}",
              f"bytes over all devices: {format_bytes(p.per_device * p.devices)} "
              f"= {p.replication:.3f} x one copy",
              "",
              f"fits (keeping {reserve:.0%} of each part free):"]
    for part, cap in PARTS:
        usable = cap * (1 - reserve)
        verdict = "yes" if p.per_device <= usable else "no "
        lines.append(f"  {part:<8} {format_bytes(cap):>9}  {verdict}  ({p.per_device / usable:.0%} of usable)")
    return "\n".join(lines)
