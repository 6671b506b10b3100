"""HuggingFace tensor names (DeepSeek-V3 / Kimi K2 release) -> k2jax param paths: the mapping as a table.

`RULES` is checked line by line against the release's safetensors index. Each HF name template has `{i}`
(decoder layer) and `{e}` (routed expert) placeholders. A layer's params sit in one of two stacks:
HF layer i < num_dense_layers is `dense_layers[i]`, otherwise `moe_layers[i - num_dense_layers]`; experts
add a second index into the stacked [E, ...] array. The per-layer ("slot") shape of every param comes from
`abstract_params(cfg)`, so the expected HF shape of a tensor is `transform.source_shape(slot shape)`.

Which of these tensors a release stores quantized is the policy table (k2jax.quant_policy): FP8 (Kimi-K2-Instruct)
every linear weight of the decoder blocks, INT4 (Kimi-K2-Thinking, K2.5) the routed experts.

Kimi-K2.5 / K2.6 releases hold the same text model under a `language_model.` prefix (`TEXT_PREFIX`), beside
a vision tower and projector (`VISION_PREFIXES`) that k2jax skips: give the prefix to the functions below.

Pure functions, no file I/O: the in-memory loader and the streaming converter share them.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Callable, NamedTuple

import jax
import numpy as np

from k2jax.config import K2Config
from k2jax.nn.model import abstract_params
from k2jax.quant_policy import quantized_layout

SCALE_SUFFIX = "_scale_inv"
# Kimi-K2.5 / K2.6 (KimiK25ForConditionalGeneration): the text model's tensors, and the vision side skipped.
TEXT_PREFIX = "language_model."
VISION_PREFIXES = ("vision_tower.", "mm_projector.", "multi_modal_projector.")


# ------------------------------------------------------------------------------------------------------
# Transforms: HF layout (linear weights [out, in]) -> k2jax einsum layout (input dim first).
@dataclasses.dataclass(frozen=True)
class Transform:
    """A named, invertible re-layout. forward(x_src, slot_shape) -> slot; inverse(slot) -> src."""

    name: str
    forward: Callable[[np.ndarray, tuple[int, ...]], np.ndarray]
    inverse: Callable[[np.ndarray], np.ndarray]
    source_shape: Callable[[tuple[int, ...]], tuple[int, ...]]

    def __repr__(self):
        return f"Relayout.{self.name}"


def _identity(x, shape):
    return x.reshape(shape)


def _transpose(x, shape):
    return x.T.reshape(shape)


class Relayout:
    """The four transforms the table uses."""

    # norms, embeddings, the router bias: same layout.
    IDENTITY = Transform("IDENTITY", _identity, lambda y: y, tuple)
    # [out, in] -> [in, out]
    TRANSPOSE = Transform("TRANSPOSE", _transpose, lambda y: y.T, lambda s: tuple(s[::-1]))
    # heads on the output side: [N*H, in] -> [in, N, H]  (q_proj, q_b_proj, kv_b_proj)
    TRANSPOSE_SPLIT_OUT = Transform(
        "TRANSPOSE_SPLIT_OUT", _transpose,
        lambda y: y.reshape(y.shape[0], -1).T,
        lambda s: (int(np.prod(s[1:])), s[0]))
    # heads on the input side: [out, N*H] -> [N, H, out]  (o_proj)
    TRANSPOSE_SPLIT_IN = Transform(
        "TRANSPOSE_SPLIT_IN", _transpose,
        lambda y: y.reshape(-1, y.shape[-1]).T,
        lambda s: (s[-1], int(np.prod(s[:-1]))))


# ------------------------------------------------------------------------------------------------------
# The table. Columns: HF name template | k2jax path (inside the layer's stack for {i}) | transform.
RULES: tuple[tuple[str, str, Transform], ...] = (
    ("model.embed_tokens.weight",                             "embed_tokens",                      Relayout.IDENTITY),
    ("model.norm.weight",                                     "norm/weight",                       Relayout.IDENTITY),
    ("lm_head.weight",                                        "lm_head",                           Relayout.TRANSPOSE),
    ("model.layers.{i}.input_layernorm.weight",               "input_layernorm/weight",            Relayout.IDENTITY),
    ("model.layers.{i}.post_attention_layernorm.weight",      "post_attention_layernorm/weight",   Relayout.IDENTITY),
    ("model.layers.{i}.self_attn.q_a_proj.weight",            "self_attn/q_a_proj",                Relayout.TRANSPOSE),
    ("model.layers.{i}.self_attn.q_a_layernorm.weight",       "self_attn/q_a_layernorm/weight",    Relayout.IDENTITY),
    ("model.layers.{i}.self_attn.q_b_proj.weight",            "self_attn/q_b_proj",                Relayout.TRANSPOSE_SPLIT_OUT),
    ("model.layers.{i}.self_attn.q_proj.weight",              "self_attn/q_proj",                  Relayout.TRANSPOSE_SPLIT_OUT),
    ("model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight",  "self_attn/kv_a_proj_with_mqa",      Relayout.TRANSPOSE),
    ("model.layers.{i}.self_attn.kv_a_layernorm.weight",      "self_attn/kv_a_layernorm/weight",   Relayout.IDENTITY),
    ("model.layers.{i}.self_attn.kv_b_proj.weight",           "self_attn/kv_b_proj",               Relayout.TRANSPOSE_SPLIT_OUT),
    ("model.layers.{i}.self_attn.o_proj.weight",              "self_attn/o_proj",                  Relayout.TRANSPOSE_SPLIT_IN),
    # dense layers (i < first_k_dense_replace)
    ("model.layers.{i}.mlp.gate_proj.weight",                 "mlp/gate_proj",                     Relayout.TRANSPOSE),
    ("model.layers.{i}.mlp.up_proj.weight",                   "mlp/up_proj",                       Relayout.TRANSPOSE),
    ("model.layers.{i}.mlp.down_proj.weight",                 "mlp/down_proj",                     Relayout.TRANSPOSE),
    # MoE layers: router (kept float32 in k2jax), routed experts (stacked on E), shared experts
    ("model.layers.{i}.mlp.gate.weight",                      "mlp/gate/kernel",                   Relayout.TRANSPOSE),
    ("model.layers.{i}.mlp.gate.e_score_correction_bias",     "mlp/gate/e_score_correction_bias",  Relayout.IDENTITY),
    ("model.layers.{i}.mlp.experts.{e}.gate_proj.weight",     "mlp/experts/gate_proj",             Relayout.TRANSPOSE),
    ("model.layers.{i}.mlp.experts.{e}.up_proj.weight",       "mlp/experts/up_proj",               Relayout.TRANSPOSE),
    ("model.layers.{i}.mlp.experts.{e}.down_proj.weight",     "mlp/experts/down_proj",             Relayout.TRANSPOSE),
    ("model.layers.{i}.mlp.shared_experts.gate_proj.weight",  "mlp/shared_experts/gate_proj",      Relayout.TRANSPOSE),
    ("model.layers.{i}.mlp.shared_experts.up_proj.weight",    "mlp/shared_experts/up_proj",        Relayout.TRANSPOSE),
    ("model.layers.{i}.mlp.shared_experts.down_proj.weight",  "mlp/shared_experts/down_proj",      Relayout.TRANSPOSE),
)

# Kimi-K2-Thinking (compressed-tensors "pack-quantized", see k2jax.checkpoint.int4) stores an INT4 weight as
# three tensors `<weight>_packed` int32 [out, in/8], `<weight>_scale` bf16 [out, in/32], `<weight>_shape`
# int64 [2] instead of `<weight>`; which weights may be so is the policy table's "int4" row.
INT4_SUFFIXES = ("_packed", "_scale", "_shape")

# Tensors that are read past on purpose (they carry no parameters of the model).
SKIP: tuple[tuple[str, str], ...] = (
    ("model.layers.{i}.self_attn.rotary_emb.inv_freq", "RoPE buffer, recomputed from the config"),
)
# Also skipped, by condition rather than by name (see `resolve`):
#   model.layers.{i}.*  with i >= num_hidden_layers: multi-token-prediction layers (DeepSeek-V3 ships one;
#                       transformers ignores them too), whatever their tensor names.
#   lm_head.weight      when tie_word_embeddings: the model uses embed_tokens (transformers re-ties it too).


# ------------------------------------------------------------------------------------------------------
class UnknownTensorError(ValueError):
    """A tensor name the table does not map (or maps to a param this config does not have)."""


class Rule(NamedTuple):
    template: str
    path: tuple[str, ...]
    transform: Transform


class Target(NamedTuple):
    """Where one HF tensor goes.

    name: the tensor's name in the checkpoint (with its prefix, if any); group: "dense_layers" | "moe_layers" |
    None (top-level param); layer: index within the group's stack; expert: routed-expert index or None; path:
    param path inside the group (or from the root).
    """

    name: str
    group: str | None
    layer: int | None
    expert: int | None
    path: tuple[str, ...]
    transform: Transform
    hf_layer: int | None

    @property
    def leaf(self) -> tuple[str, ...]:
        """Full path of the (stacked) param leaf in the tree."""
        return (self.group, *self.path) if self.group else self.path

    @property
    def index(self) -> tuple[int, ...]:
        """Index of this tensor's slot inside the leaf: (layer,), (layer, expert) or ()."""
        return tuple(k for k in (self.layer, self.expert) if k is not None)

    @property
    def fp8(self) -> bool:
        """Stored F8_E4M3 with a `weight_scale_inv` in an FP8 release (the policy table's "fp8" row)."""
        return quantized_layout(self.leaf, "fp8") is not None

    @property
    def int4(self) -> bool:
        """May be stored INT4 pack-quantized (the policy table's "int4" row: the routed experts)."""
        return quantized_layout(self.leaf, "int4") is not None


_NUM = re.compile(r"(?<=\.)\d+(?=\.|$)")


def _key(name: str) -> tuple[str, list[str]]:
    """'model.layers.3.mlp.experts.7.up_proj.weight' -> ('model.layers.{i}.mlp.experts.{e}.up_proj.weight',
    ['3', '7']): an O(1) lookup instead of trying every rule's regex (the release has 139k tensors)."""
    nums = _NUM.findall(name)
    it = iter(("{i}", "{e}"))
    return _NUM.sub(lambda m: next(it, "{?}"), name), nums


_RULES = {t: Rule(t, tuple(p.split("/")), tr) for t, p, tr in RULES}
_SKIP = {t for t, _ in SKIP}


def is_scale(name: str) -> bool:
    return name.endswith(SCALE_SUFFIX)


def is_vision(name: str) -> bool:
    """A K2.5 vision-tower or projector tensor (skipped: k2jax runs the text model)."""
    return name.startswith(VISION_PREFIXES)


def scale_name(weight: str) -> str:
    """'...weight' -> '...weight_scale_inv' (the FP8 companion)."""
    return weight + SCALE_SUFFIX


def int4_part(name: str) -> str | None:
    """'...weight_packed' -> '_packed' (likewise _scale, _shape); None for any other name."""
    return next((s for s in INT4_SUFFIXES if name.endswith("weight" + s)), None)


def int4_names(weight: str) -> dict[str, str]:
    """'...weight' -> {"packed": '...weight_packed', "scale": '...weight_scale', "shape": '...weight_shape'}."""
    return {s[1:]: weight + s for s in INT4_SUFFIXES}


def weight_of_int4(name: str) -> str:
    """'...weight_packed' (or _scale, _shape) -> '...weight'."""
    return name[: -len(int4_part(name))]


def weight_of_scale(name: str) -> str:
    """'...weight_scale_inv' -> '...weight'."""
    return name[: -len(SCALE_SUFFIX)]


def layer_group(cfg: K2Config, hf_layer: int) -> tuple[str, int]:
    """HF layer index -> (stack name, index within the stack)."""
    if hf_layer < cfg.num_dense_layers:
        return "dense_layers", hf_layer
    return "moe_layers", hf_layer - cfg.num_dense_layers


@functools.lru_cache(maxsize=16)
def leaf_shapes(cfg: K2Config) -> dict[tuple[str, ...], tuple[int, ...]]:
    """Shapes of every param leaf (stacked), from the model itself: path tuple -> shape."""
    return {tuple(k.key for k in p): tuple(v.shape) for p, v in jax.tree_util.tree_leaves_with_path(abstract_params(cfg))}


def slot_shape(target: Target, cfg: K2Config) -> tuple[int, ...]:
    """Shape of one HF tensor's slot in k2jax layout (the leaf without its stack and expert axes)."""
    return leaf_shapes(cfg)[target.leaf][len(target.index):]


def source_shape(name: str, cfg: K2Config, prefix: str = "") -> tuple[int, ...]:
    """The shape the HF tensor `name` must have for `cfg` (raises UnknownTensorError; skipped names too)."""
    target = resolve(name, cfg, prefix)
    if target is None:
        raise UnknownTensorError(f"{name!r} is skipped by the loader: it has no expected shape")
    return target.transform.source_shape(slot_shape(target, cfg))


def resolve(name: str, cfg: K2Config, prefix: str = "") -> Target | None:
    """HF tensor name -> Target, None for a tensor skipped on purpose; raises UnknownTensorError otherwise.

    prefix: where the text model's tensors are ("" for K2 releases, TEXT_PREFIX for K2.5 / K2.6); the
    vision tensors of the latter are not resolved here (see is_vision). `*_scale_inv` names are companions
    of their weight, not targets: resolve the weight instead.
    """
    if is_scale(name):
        raise UnknownTensorError(f"{name!r} is an FP8 scale: resolve its weight {weight_of_scale(name)!r}")
    if not name.startswith(prefix):
        raise UnknownTensorError(f"unknown tensor {name!r}: config.json nests the text model's config "
                                 f"(text_config), whose tensors are under {prefix!r}")
    template, nums = _key(name[len(prefix):])
    if any(str(int(n)) != n for n in nums):
        raise UnknownTensorError(f"unknown tensor {name!r}: non-canonical index (leading zero)")
    hf_layer = int(nums[0]) if template.startswith("model.layers.{i}.") else None
    if hf_layer is not None and hf_layer >= cfg.num_hidden_layers:
        return None  # multi-token-prediction layer
    if template in _SKIP or (template == "lm_head.weight" and cfg.tie_word_embeddings):
        return None
    rule = _RULES.get(template)
    if rule is None:
        raise UnknownTensorError(f"unknown tensor {name!r}: no rule in k2jax.checkpoint.names.RULES")
    group, layer = layer_group(cfg, hf_layer) if hf_layer is not None else (None, None)
    expert = int(nums[1]) if "{e}" in template else None
    target = Target(name, group, layer, expert, rule.path, rule.transform, hf_layer)
    shape = leaf_shapes(cfg).get(target.leaf)
    if shape is None:
        raise UnknownTensorError(f"unexpected tensor {name!r}: this config has no param "
                                 f"{'/'.join(target.leaf)} ({_why_absent(target, cfg)})")
    if expert is not None and expert >= shape[1]:
        raise UnknownTensorError(f"unexpected tensor {name!r}: expert {expert} >= n_routed_experts ({shape[1]})")
    return target


def _why_absent(t: Target, cfg: K2Config) -> str:
    if t.group == "dense_layers" and t.path[0] == "mlp":
        return f"layer {t.hf_layer} is dense: first_k_dense_replace={cfg.first_k_dense_replace}"
    if t.group == "moe_layers" and t.path[0] == "mlp":
        return f"layer {t.hf_layer} is an MoE layer: first_k_dense_replace={cfg.first_k_dense_replace}"
    if {"q_a_proj", "q_b_proj", "q_a_layernorm"} & set(t.path):
        return "q_lora_rank is null"
    if t.path[-1] == "q_proj":
        return f"q_lora_rank is {cfg.q_lora_rank}"
    if t.path == ("lm_head",):
        return "tie_word_embeddings is true"
    return "see abstract_params"


# ------------------------------------------------------------------------------------------------------
# Enumeration: which HF tensors a config expects (weights only; FP8 scales follow their weight's dtype).
def layer_names(cfg: K2Config, hf_layer: int, prefix: str = "") -> list[str]:
    """HF weight names that feed decoder layer `hf_layer` (one block of the converter)."""
    group, _ = layer_group(cfg, hf_layer)
    shapes = leaf_shapes(cfg)
    out = []
    for rule in _RULES.values():
        if not rule.template.startswith("model.layers.{i}.") or (group, *rule.path) not in shapes:
            continue
        name = prefix + rule.template.replace("{i}", str(hf_layer))
        if "{e}" in name:
            out += [name.replace("{e}", str(e)) for e in range(shapes[(group, *rule.path)][1])]
        else:
            out.append(name)
    return out


def global_names(cfg: K2Config, prefix: str = "") -> list[str]:
    """HF weight names outside the decoder layers (embedding, final norm, lm_head unless tied)."""
    shapes = leaf_shapes(cfg)
    return [prefix + r.template for r in _RULES.values() if "{i}" not in r.template and r.path in shapes]


def expected_names(cfg: K2Config, prefix: str = "") -> list[str]:
    """Every HF weight name the config needs, in release order (globals, then layer by layer)."""
    names = global_names(cfg, prefix)
    for i in range(cfg.num_hidden_layers):
        names += layer_names(cfg, i, prefix)
    return names
