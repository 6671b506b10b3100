"""K2Config: the model's hyper-parameters, read from a HuggingFace DeepseekV3 / Kimi K2 `config.json`.

Only keys that change the math are kept. Absent keys take transformers' DeepseekV3Config defaults, so a
config that transformers accepts means the same model here. Unknown keys are ignored. A Kimi-K2.5 / K2.6
config (KimiK25ForConditionalGeneration) nests the text model's in `text_config`: that one is read.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping

# Without these the model has no shape: never defaulted.
_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
# An explicit null means something for these (q_lora_rank: null = a plain q_proj; no experts = dense model).
_NULLABLE = ("q_lora_rank", "n_routed_experts", "bos_token_id", "eos_token_id")


@dataclasses.dataclass(frozen=True)
class K2Config:
    """Hyper-parameters of a DeepSeek-V3-architecture model (Kimi K2, DeepSeek-V3, or a small test model).

    Field names follow HuggingFace's config.json; the defaults are transformers' DeepseekV3Config defaults,
    used by from_hf_config for absent keys. RoPE scaling is flattened into `rope_*` fields so the
    config stays hashable (it is a static argument of jitted functions).
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    n_shared_experts: int = 1
    n_routed_experts: int | None = 256
    num_experts_per_tok: int = 8
    n_group: int = 8
    topk_group: int = 4
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    first_k_dense_replace: int = 3
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rope_interleave: bool = True
    # RoPE scaling: rope_type "default" (none) or "yarn".
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_original_max_position_embeddings: int | None = None
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float | None = None
    rope_mscale_all_dim: float | None = None
    rope_attention_factor: float | None = None
    rope_truncate: bool = True
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | tuple[int, ...] | None = 1
    # Kept for the converter and loaders (FP8 block size); not part of the model's identity.
    quantization_config: Mapping[str, Any] | None = dataclasses.field(default=None, compare=False, hash=False)

    def __post_init__(self):
        self.validate()

    # ----------------------------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_dense_layers(self) -> int:
        """Leading blocks with a dense MLP (transformers: layer_idx < first_k_dense_replace)."""
        if not self.n_routed_experts:
            return self.num_hidden_layers
        return min(self.first_k_dense_replace, self.num_hidden_layers)

    @property
    def num_moe_layers(self) -> int:
        return self.num_hidden_layers - self.num_dense_layers

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.n_shared_experts

    @property
    def softmax_scale(self) -> float:
        """Attention logit scale: head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (as HF)."""
        scale = self.qk_head_dim**-0.5
        if self.rope_type != "default" and self.rope_mscale_all_dim:
            m = yarn_mscale(self.rope_factor, self.rope_mscale_all_dim)
            scale *= m * m
        return scale

    def validate(self) -> None:
        """Raise ValueError naming the first impossible key."""

        def bad(key, why):
            raise ValueError(f"K2Config: invalid {key!r}: {why}")

        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                bad(key, f"must be a positive integer, got {v!r}")
        if self.qk_rope_head_dim % 2:
            bad("qk_rope_head_dim", f"must be even (rotary pairs), got {self.qk_rope_head_dim}")
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int) or self.q_lora_rank <= 0):
            bad("q_lora_rank", f"must be a positive integer or null, got {self.q_lora_rank!r}")
        if self.first_k_dense_replace < 0:
            bad("first_k_dense_replace", f"must be >= 0, got {self.first_k_dense_replace}")
        if self.num_dense_layers and self.intermediate_size <= 0:
            bad("intermediate_size", f"must be positive, got {self.intermediate_size}")
        if self.n_routed_experts:
            e, k = self.n_routed_experts, self.num_experts_per_tok
            if self.moe_intermediate_size <= 0:
                bad("moe_intermediate_size", f"must be positive, got {self.moe_intermediate_size}")
            if self.n_shared_experts < 0:
                bad("n_shared_experts", f"must be >= 0, got {self.n_shared_experts}")
            if not 0 < k <= e:
                bad("num_experts_per_tok", f"top-k {k} must be in 1..n_routed_experts ({e})")
            if self.n_group <= 0 or e % self.n_group:
                bad("n_group", f"n_routed_experts ({e}) must be divisible by n_group ({self.n_group})")
            if not 0 < self.topk_group <= self.n_group:
                bad("topk_group", f"must be in 1..n_group ({self.n_group}), got {self.topk_group}")
            per_group = e // self.n_group
            if self.n_group > 1 and per_group < 2:
                bad("n_group", f"group scores use each group's top-2 experts; {per_group} expert(s) per group")
            if self.topk_group * per_group < k:
                bad("topk_group", f"the {self.topk_group} kept group(s) hold {self.topk_group * per_group} "
                    f"experts, fewer than num_experts_per_tok ({k})")
        if self.rope_type not in ("default", "yarn"):
            bad("rope_scaling", f"rope type {self.rope_type!r} is not supported (default or yarn)")
        if self.rope_type == "yarn":
            if self.rope_factor <= 0:
                bad("rope_scaling.factor", f"must be positive, got {self.rope_factor}")
            if not self.rope_original_max_position_embeddings:
                bad("rope_scaling.original_max_position_embeddings", "is required for yarn")

    # ----------------------------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, path_or_dict: str | os.PathLike | Mapping[str, Any]) -> "K2Config":
        """Read a HuggingFace `config.json` (a path to the file or its directory, or the parsed dict)."""
        if isinstance(path_or_dict, Mapping):
            raw, where = dict(path_or_dict), "config"
        else:
            where = os.fspath(path_or_dict)
            if os.path.isdir(where):
                where = os.path.join(where, "config.json")
            try:
                with open(where) as f:
                    raw = json.load(f)
            except FileNotFoundError:
                raise FileNotFoundError(f"no config.json at {where}") from None
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON: {e}") from None
            if not isinstance(raw, dict):
                raise ValueError(f"{where}: expected a JSON object")
        raw = text_config(raw)
        missing = [k for k in _REQUIRED if raw.get(k) is None]
        if missing:
            raise ValueError(f"{where}: missing required key {missing[0]!r}")
        kw = {k: raw[k] for k in _REQUIRED}
        for f in dataclasses.fields(cls):
            if f.name in _REQUIRED or f.name.startswith("rope_") or f.name == "quantization_config":
                continue  # required, or read below
            explicit_null = f.name in _NULLABLE and f.name in raw
            kw[f.name] = raw[f.name] if raw.get(f.name) is not None or explicit_null else f.default
        n_kv = raw.get("num_key_value_heads")
        if n_kv is not None and n_kv != raw["num_attention_heads"]:
            raise ValueError(f"{where}: invalid 'num_key_value_heads': MLA needs it equal to "
                             f"num_attention_heads ({raw['num_attention_heads']}), got {n_kv}")
        if raw.get("attention_bias"):
            raise ValueError(f"{where}: invalid 'attention_bias': biased projections are not supported")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{where}: invalid 'hidden_act': only 'silu' is supported, got {raw['hidden_act']!r}")
        # transformers ignores moe_layer_freq; the released remote code interleaves dense blocks when it is
        # not 1. No released model does that, so refuse it rather than lay blocks out one way or the other.
        if raw.get("moe_layer_freq", 1) != 1:
            raise ValueError(f"{where}: invalid 'moe_layer_freq': only 1 is supported, got {raw['moe_layer_freq']!r}")
        for key, only in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
            if raw.get(key, only) != only:
                raise ValueError(f"{where}: invalid {key!r}: only {only!r} is supported, got {raw[key]!r}")
        if isinstance(kw["eos_token_id"], list):
            kw["eos_token_id"] = tuple(kw["eos_token_id"])
        kw["rope_interleave"] = raw.get("rope_interleave", True) is not False
        kw.update(_rope_fields(raw, where))
        if raw.get("quantization_config") is not None:
            kw["quantization_config"] = raw["quantization_config"]
        for k, v in kw.items():
            if k in ("rms_norm_eps", "routed_scaling_factor", "rope_theta") and isinstance(v, int):
                kw[k] = float(v)
        try:
            return cls(**kw)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "K2Config":
        """Alias of from_hf_config for a path: the presets in configs/ are HF-style config.json files."""
        return cls.from_hf_config(path)

    def to_hf_config(self) -> dict[str, Any]:
        """The HF `config.json` dict of this config (what from_hf_config reads back to an equal config)."""
        out = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}
        for f in dataclasses.fields(self):
            if f.name.startswith("rope_") and f.name not in ("rope_theta", "rope_interleave"):
                continue
            v = getattr(self, f.name)
            if v is None and f.name == "quantization_config":
                continue
            out[f.name] = list(v) if isinstance(v, tuple) else v
        out["num_key_value_heads"] = self.num_attention_heads
        if self.rope_type != "default":
            rs = {"type": self.rope_type, "factor": self.rope_factor,
                  "original_max_position_embeddings": self.rope_original_max_position_embeddings,
                  "beta_fast": self.rope_beta_fast, "beta_slow": self.rope_beta_slow}
            for k in ("mscale", "mscale_all_dim", "attention_factor"):
                if getattr(self, f"rope_{k}") is not None:
                    rs[k] = getattr(self, f"rope_{k}")
            if not self.rope_truncate:
                rs["truncate"] = False
            out["rope_scaling"] = rs
        return out

    def replace(self, **changes) -> "K2Config":
        return dataclasses.replace(self, **changes)


def text_config(raw: Mapping[str, Any]) -> dict[str, Any]:
    """A config.json dict -> the text model's config: a Kimi-K2.5 / K2.6 config's `text_config` (its
    quantization_config from there, else the top level's), any other config as it is."""
    text = raw.get("text_config")
    if not isinstance(text, Mapping):
        return dict(raw)
    qc = text.get("quantization_config") or raw.get("quantization_config")
    return dict(text) | ({"quantization_config": qc} if qc else {})


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction: 0.1·m·ln(s) + 1 for s > 1, else 1."""
    return 0.1 * mscale * math.log(scale) + 1.0 if scale > 1 else 1.0


def _rope_fields(raw: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Flatten `rope_scaling` (released configs) or `rope_parameters` (transformers >= 5) into rope_* fields."""
    rs = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if not isinstance(rs, Mapping):
        raise ValueError(f"{where}: invalid 'rope_scaling': expected an object, got {rs!r}")
    theta = raw.get("rope_theta", rs.get("rope_theta", K2Config.rope_theta))
    rope_type = rs.get("rope_type", rs.get("type", "default")) or "default"
    out: dict[str, Any] = {"rope_theta": float(theta), "rope_type": rope_type}
    if rope_type == "default":
        return out
    if rope_type != "yarn":
        raise ValueError(f"{where}: invalid 'rope_scaling': rope type {rope_type!r} is not supported "
                         "(default or yarn)")
    orig = rs.get("original_max_position_embeddings")
    factor = rs.get("factor")
    if factor is None:
        if not orig:
            raise ValueError(f"{where}: missing required key 'rope_scaling.original_max_position_embeddings'")
        factor = raw.get("max_position_embeddings", K2Config.max_position_embeddings) / orig
    out.update(
        rope_factor=float(factor),
        rope_original_max_position_embeddings=orig,
        # transformers treats a missing or zero beta as its default (`or`).
        rope_beta_fast=float(rs.get("beta_fast") or 32.0),
        rope_beta_slow=float(rs.get("beta_slow") or 1.0),
        rope_mscale=rs.get("mscale"),
        rope_mscale_all_dim=rs.get("mscale_all_dim"),
        rope_attention_factor=rs.get("attention_factor"),
        rope_truncate=bool(rs.get("truncate", True)),
    )
    if orig is None:
        raise ValueError(f"{where}: missing required key 'rope_scaling.original_max_position_embeddings'")
    return out
