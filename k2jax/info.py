"""Parameter accounting from the abstract param tree (jax.eval_shape: nothing is allocated)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from k2jax.config import K2Config
from k2jax.nn.model import abstract_params
from k2jax.ops.quant import is_quantized
from k2jax.quant_policy import FORMATS


def count_params(tree) -> int:
    """Parameters in a tree of arrays or jax.ShapeDtypeStruct (the product of each leaf's shape)."""
    return sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(tree))


def _per_layer(tree, n: int) -> int:
    return count_params(tree) // n


def held_bytes(cfg: K2Config, quant: str | None, dtype=jnp.bfloat16) -> int:
    """Bytes of one copy of the params as a load holds them: the plain ones in `dtype` (the router float32),
    the ones `quant` quantizes (k2jax.quant_policy) as their values and scales."""
    leaves = jax.tree_util.tree_leaves(abstract_params(cfg, dtype, quant), is_leaf=is_quantized)
    return sum(x.nbytes if is_quantized(x) else math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in leaves)


def parameter_table(cfg: K2Config) -> list[tuple[str, int]]:
    """(component, parameter count) rows: per component and per block, then totals."""
    p = abstract_params(cfg)
    rows: list[tuple[str, int]] = []
    nd, nm = cfg.num_dense_layers, cfg.num_moe_layers
    for group, n, ffn in (("dense_layers", nd, "dense MLP"), ("moe_layers", nm, "MoE")):
        if not n:
            continue
        g = p[group]
        kind = "dense" if group == "dense_layers" else "MoE"
        rows.append((f"MLA ({kind} block)" if nd and nm else "MLA", _per_layer(g["self_attn"], n)))
        rows.append((ffn, _per_layer(g["mlp"], n)))
        if group == "moe_layers":
            m = g["mlp"]
            rows.append(("  routed experts", _per_layer(m["experts"], n)))
            if "shared_experts" in m:
                rows.append(("  shared experts", _per_layer(m["shared_experts"], n)))
            rows.append(("  router (weight + bias)", _per_layer(m["gate"], n)))
        rows.append((f"{kind} block", _per_layer(g, n)))
        rows.append((f"{n} {kind} blocks", count_params(g)))
    rows.append(("embed_tokens", count_params(p["embed_tokens"])))
    if "lm_head" in p:
        rows.append(("lm_head", count_params(p["lm_head"])))
    rows.append(("final norm", count_params(p["norm"])))
    rows.append(("whole model", count_params(p)))
    return rows


def active_params_per_token(cfg: K2Config) -> int:
    """Parameters a token touches: everything except the routed experts it was not sent to."""
    p = abstract_params(cfg)
    total = count_params(p)
    if cfg.num_moe_layers:
        experts = count_params(p["moe_layers"]["mlp"]["experts"])
        total -= experts - experts * cfg.num_experts_per_tok // cfg.n_routed_experts
    return total


def format_info(cfg: K2Config) -> str:
    """The text `k2jax info` prints."""
    rows = parameter_table(cfg)
    width = max(len(name) for name, _ in rows)
    lines = [f"{'component':<{width}}  {'parameters':>19}"]
    lines += [f"{name:<{width}}  {n:>19,}" for name, n in rows]
    lines += ["", f"active parameters per token: {active_params_per_token(cfg):,}"]
    for quant, what in ((None, "bfloat16 (the router float32)"),
                        *((q, f"{q} (as {f.release} holds it, the rest bf16)") for q, f in FORMATS.items())):
        n = held_bytes(cfg, quant)
        lines.append(f"bytes in {what}: {n:,} ({n / 2**30:,.1f} GiB)")
    return "\n".join(lines)
