"""Parameter accounting from the abstract param tree (jax.eval_shape: nothing is allocated)."""

from __future__ import annotations

import math

import jax

from k2jax.config import K2Config
from k2jax.nn.model import abstract_params


def _count(tree) -> int:
    return sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(tree))


def _per_layer(tree, n: int) -> int:
    return _count(tree) // n


def _fp8_bytes(tree, block: int = 128) -> int:
    """Bytes in the released FP8 layout: linear weights inside the blocks are e4m3 (1 byte) with one float32
    scale per 128x128 block; norms, router weight (bf16 here) and bias (float32) stay unquantized."""
    total = 0
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        keys = [getattr(k, "key", str(k)) for k in path]
        if keys[-1] == "weight" or keys[0] in ("embed_tokens", "lm_head") or keys[-2:] == ["gate", "kernel"]:
            total += math.prod(x.shape) * 2
        elif keys[-1] == "e_score_correction_bias":
            total += math.prod(x.shape) * 4
        else:
            # Stacked [layers, (experts,)] leading axes; the matrix is [in, out...] in einsum layout.
            lead = 1 if "experts" not in keys else 2
            shape = x.shape
            mats = math.prod(shape[:lead])
            rows, cols = shape[lead], math.prod(shape[lead + 1:])
            total += mats * (rows * cols + 4 * math.ceil(rows / block) * math.ceil(cols / block))
    return total


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
        rows.append((f"{n} {kind} blocks", _count(g)))
    rows.append(("embed_tokens", _count(p["embed_tokens"])))
    if "lm_head" in p:
        rows.append(("lm_head", _count(p["lm_head"])))
    rows.append(("final norm", _count(p["norm"])))
    rows.append(("whole model", _count(p)))
    return rows


def active_params_per_token(cfg: K2Config) -> int:
    """Parameters a token touches: everything except the routed experts it was not sent to."""
    p = abstract_params(cfg)
    total = _count(p)
    if cfg.num_moe_layers:
        experts = _count(p["moe_layers"]["mlp"]["experts"])
        total -= experts - experts * cfg.num_experts_per_tok // cfg.n_routed_experts
    return total


def format_info(cfg: K2Config) -> str:
    """The text `k2jax info` prints."""
    rows = parameter_table(cfg)
    width = max(len(name) for name, _ in rows)
    lines = [f"{'component':<{width}}  {'parameters':>19}"]
    lines += [f"{name:<{width}}  {n:>19,}" for name, n in rows]
    p = abstract_params(cfg)
    total = rows[-1][1]
    lines += [
        "",
        f"active parameters per token: {active_params_per_token(cfg):,}",
        f"bytes in bfloat16: {2 * total:,} ({2 * total / 2**30:,.1f} GiB)",
        f"bytes in fp8 (e4m3 block weights + 128x128 float32 scales, rest bf16): "
        f"{_fp8_bytes(p):,} ({_fp8_bytes(p) / 2**30:,.1f} GiB)",
    ]
    return "\n".join(lines)
