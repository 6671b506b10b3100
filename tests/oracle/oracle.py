"""Reference oracle: HuggingFace transformers' DeepseekV3ForCausalLM (PyTorch, CPU, float32).

Runs under the oracle's own interpreter (`.oracle-venv`, Python 3.11 + torch + transformers); k2jax's tests
(Python 3.12, no torch) drive it through `tests/oracle/client.py`.

    python oracle.py --serve        one JSON request per stdin line -> one JSON answer per stdout line
    python oracle.py REQUEST.json   one request; the answer is printed on stdout

Answer: {"ok": true, "out": path, "seconds": t} or {"ok": false, "error": traceback}. Only answers go to
stdout; whatever torch/transformers print lands on stderr (fd 1 is pointed at fd 2).

Request (JSON dict; every part optional except as noted):
  config       HF DeepseekV3 config dict (released-style rope_scaling/rope_theta or rope_parameters);
               required unless `load` names a directory with a config.json.
  seed         int (default 0): torch.manual_seed(seed), then every parameter is randomized (see randomize()).
  init_std     float or null (default null): std of linear/embedding weights; null = 1/sqrt(fan_in) for linears
               and 1.0 for the embedding, which keeps activations O(1) at any width.
  router_std   float or null (default null = 3/sqrt(hidden)): std of the router weight mlp.gate.weight. Router
               logits of std ~3 let the tokens, not only the bias, decide the routing.
  bias_scale   float (default 0.5): e_score_correction_bias ~ U[-bias_scale, bias_scale].
  load         path of an HF-format directory (float, released FP8 or Kimi-K2-Thinking INT4 layout; INT4 weights
               unpacked by compressed-tensors): its tensors replace the random init.
  save         {"dir", "format": "hf"|"fp8", "num_shards"}: "hf" = save_pretrained (float32); "fp8" = the
               released Kimi K2 FP8 layout. With "fp8" every output below comes from the values stored
               (dequantized FP8 weights, bf16-rounded other tensors).
  inputs       {"input_ids": B x T, "attention_mask"?: B x T, "position_ids"?: B x T} -> "logits".
  capture      bool: with inputs, also the per-layer activations listed in _Recorder.
  generate     {"prompts": [[ids], ...], "max_new_tokens": N, "stop_tokens"?: [ids]} -> "generate.{j}".
  grad         {"input_ids", "labels", "loss_mask"?, "attention_mask"?}: labels are already shifted by the
               caller (labels[b, t] is the target for logits[b, t]); loss = sum over positions with
               loss_mask = 1 (and label >= 0) of -log softmax(logits[b, t])[labels[b, t]] / their count.
               -> "loss", "grad.<released param name>".
  bench        {"input_ids", "dtype": "float32"|"bfloat16", "warmup", "repeats"} -> "bench.times".
  pack_int4    {"weight": out x in floats, "scale": out x in/32, "packed"?: int32 out x in/8}: compressed-tensors'
               own "pack-quantized" compressor (Kimi-K2-Thinking's format; symmetric int4, groups of 32) ->
               "pack_int4.weight_packed" int32, "pack_int4.weight_shape"; with "packed", its own decompression of
               that tensor with `scale` -> "pack_int4.unpacked" float32. Needs no model (no config).
  chat_template {"template": jinja text, "messages": [...], "tools"?: [...], "add_generation_prompt"?: bool
               (default true), "kwargs"?: {...} (chat_template_kwargs), "special_tokens"?: {"bos_token": ...}}:
               transformers' own tokenizer.apply_chat_template(..., tokenize=False) on that template, with a
               stand-in tokenizer whose special-token map is `special_tokens` -> "chat_template.text" (a 0-d
               unicode array). Needs no model (no config). jinja2 comes with torch (which requires it).
  out          path of the .npz to write (required).

npz keys: logits [B,T,V]; bias_changes_choice (scalar; fraction of MoE-layer tokens whose top-k set changes when
the correction bias is zeroed), layers.{i}.mlp.gate.bias_changes_choice; with capture: see _Recorder and
_rope_check; generate.{j} int64 [N]; loss, grad.*; bench.times float64 [repeats].

The two most recent models are kept (keyed by config, seed, init options and the load directory's contents),
so requests that alternate with k2jax (e.g. benchmarks) do not rebuild them; a request with `save` always rebuilds.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback


def _protect_stdout():
    """Keep a private handle on the real stdout for answers; send everything else (fd 1 too) to stderr."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return proto


_PROTO = _protect_stdout() if __name__ == "__main__" else sys.stdout
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never touch the network
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import collections  # noqa: E402
import copy  # noqa: E402
import glob  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, GenerationConfig  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_ds3  # noqa: E402

torch.set_num_threads(int(os.environ.get("ORACLE_THREADS", "2")))

FP8_MAX = 448.0  # largest finite float8_e4m3fn
QUANTIZATION_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}
# Linear weights inside the blocks: the ones the released checkpoint stores as FP8 (the router mlp.gate is not).
_QUANTIZED = re.compile(
    r"model\.layers\.\d+\.("
    r"self_attn\.(q_a_proj|q_b_proj|q_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
    r"|mlp\.(gate_proj|up_proj|down_proj)"
    r"|mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)"
    r"|mlp\.shared_experts\.(gate_proj|up_proj|down_proj)"
    r")\.weight"
)
_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
# Keys of a released config.json that are metadata, not DeepseekV3Config arguments. model_type in particular
# must go: "kimi_k2" would hide transformers' per-expert <-> fused conversion mapping for deepseek_v3.
_CONFIG_METADATA = (
    "model_type", "architectures", "auto_map", "quantization_config", "torch_dtype", "dtype",
    "transformers_version",
)


# ----------------------------------------------------------------------------------------------- model building
def hf_config(cfg: dict) -> DeepseekV3Config:
    """DeepseekV3Config from a config.json-style dict (released or transformers-5 style)."""
    # Absent, these would default to full DeepSeek-V3 sizes: hundreds of GB allocated by mistake.
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads") if k not in cfg]
    if missing:
        raise ValueError(f"config lacks {missing}")
    return DeepseekV3Config(**{k: v for k, v in cfg.items() if k not in _CONFIG_METADATA})


def build_model(cfg: dict) -> DeepseekV3ForCausalLM:
    """Float32 model in eval mode, eager attention and the plain per-expert loop (the literal reference)."""
    model = DeepseekV3ForCausalLM._from_config(
        hf_config(cfg), attn_implementation="eager", experts_implementation="eager", dtype=torch.float32
    )
    return model.eval()


@torch.no_grad()
def randomize(model, seed: int, init_std: float | None = None, bias_scale: float = 0.5,
              router_std: float | None = None) -> None:
    """Give every parameter (and the router bias) random values, so no bug can hide behind zeros or ones."""
    torch.manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):  # every RMSNorm: near 1 but not 1
            p.copy_(1.0 + 0.1 * torch.randn_like(p))
        elif name.endswith("embed_tokens.weight"):
            p.normal_(0.0, 1.0 if init_std is None else init_std)
        elif name.endswith("mlp.gate.weight"):  # input is RMS-normalized: logits std ~ router_std * sqrt(D)
            p.normal_(0.0, 3.0 / math.sqrt(p.shape[-1]) if router_std is None else router_std)
        else:  # linears, fused experts [E, out, in]: fan_in is the last dim
            p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]) if init_std is None else init_std)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.uniform_(-bias_scale, bias_scale)


# ------------------------------------------------------------------------------------ released <-> internal names
def released_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors (a state_dict, or gradients) under the released checkpoint names: fused experts split per expert."""
    out = {}
    for name, t in tensors.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            f = t.shape[1] // 2  # transformers concatenates [gate; up] (its forward: gate, up = ...chunk(2))
            for e in range(t.shape[0]):
                out[f"{name[:-len('gate_up_proj')]}{e}.gate_proj.weight"] = t[e, :f]
                out[f"{name[:-len('gate_up_proj')]}{e}.up_proj.weight"] = t[e, f:]
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(t.shape[0]):
                out[f"{name[:-len('down_proj')]}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


def internal_state_dict(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of released_names: fuse per-expert weights into transformers' 3D parameters."""
    out, experts = {}, collections.defaultdict(dict)
    for name, t in tensors.items():
        m = _EXPERT.fullmatch(name)
        if m:
            experts[m.group(1)][(int(m.group(2)), m.group(3))] = t
        else:
            out[name] = t
    for prefix, ws in experts.items():
        n = 1 + max(e for e, _ in ws)
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([ws[(e, "gate_proj")], ws[(e, "up_proj")]], 0) for e in range(n)]
        )
        out[f"{prefix}.down_proj"] = torch.stack([ws[(e, "down_proj")] for e in range(n)])
    return out


# --------------------------------------------------------------------------------------------------------- FP8
def quantize_fp8(w: torch.Tensor, block=(128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise e4m3 quantization: scale_inv[i, j] = amax(block i, j) / 448; edge blocks are partial."""
    bo, bi = block
    o, i = w.shape
    no, ni = -(-o // bo), -(-i // bi)
    padded = torch.zeros(no * bo, ni * bi, dtype=torch.float32)
    padded[:o, :i] = w
    blocks = padded.view(no, bo, ni, bi)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(no * bo, ni * bi)[:o, :i].contiguous(), scale.contiguous()


def dequantize_fp8(q: torch.Tensor, scale_inv: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    """w[i, j] = fp8[i, j] * scale_inv[i // bo, j // bi], in float32."""
    o, i = q.shape
    full = scale_inv.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:o, :i]
    return q.float() * full


# ------------------------------------------------------------------------------------- INT4 (compressed-tensors)
def _int4_scheme():
    """Kimi-K2-Thinking's weight scheme, as compressed-tensors builds it from config_groups.group_0."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32, dynamic=False)
    return QuantizationScheme(targets=["Linear"], weights=args, input_activations=None, output_activations=None)


def _compressor():
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    return PackedQuantizationCompressor


def unpack_int4(packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor) -> torch.Tensor:
    """weight_packed / weight_scale / weight_shape -> the float32 weight, by compressed-tensors' decompressor. The
    bf16 scale goes in as float32, so the products (nibble - 8) * scale stay exact instead of rounding to bf16."""
    sd = {"weight_packed": packed, "weight_scale": scale.float(), "weight_shape": shape}
    return _compressor().decompress(sd, _int4_scheme())["weight"].float()


_CHAT_TOKENIZERS: dict[str, object] = {}


def _chat_template(r) -> dict[str, np.ndarray]:
    """transformers' apply_chat_template (tokenize=False) on r["template"]. The tokenizer is a one-word stand-in:
    only its special-token map (bos_token, eos_token, ...) reaches the template."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    special = r.get("special_tokens") or {}
    key = json.dumps(special, sort_keys=True)
    if key not in _CHAT_TOKENIZERS:
        vocab = {t: i for i, t in enumerate(dict.fromkeys(["[UNK]", *special.values()]))}
        _CHAT_TOKENIZERS[key] = PreTrainedTokenizerFast(
            tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="[UNK]")), **special)
    tok = _CHAT_TOKENIZERS[key]
    text = tok.apply_chat_template(r["messages"], tools=r.get("tools"), chat_template=r["template"],
                                   add_generation_prompt=r.get("add_generation_prompt", True), tokenize=False,
                                   **(r.get("kwargs") or {}))
    return {"chat_template.text": np.array(text)}


def _pack_int4(r) -> dict[str, np.ndarray]:
    w = torch.tensor(np.asarray(r["weight"], np.float32))
    scale = torch.tensor(np.asarray(r["scale"], np.float32)).to(torch.bfloat16)
    sd = _compressor().compress({"weight": w, "weight_scale": scale}, _int4_scheme())
    out = {"pack_int4.weight_packed": sd["weight_packed"].numpy(), "pack_int4.weight_shape": sd["weight_shape"].numpy()}
    if r.get("packed") is not None:
        packed = torch.tensor(np.asarray(r["packed"], np.int32))
        out["pack_int4.unpacked"] = unpack_int4(packed, scale, torch.tensor(list(w.shape))).numpy()
    return out


def _shard_of(name: str, num_layers: int, num_shards: int) -> int:
    """File index (0-based) of a tensor: the embedding, each layer, then norm + lm_head, cut into contiguous runs."""
    m = _LAYER.match(name)
    unit = int(m.group(1)) + 1 if m else (0 if "embed_tokens" in name else num_layers + 1)
    return unit * num_shards // (num_layers + 2)


def write_fp8(model, cfg: dict, directory: str, num_shards: int = 1) -> dict[str, torch.Tensor]:
    """Write the released Kimi K2 FP8 layout; return the float32 values it stores (released names)."""
    num_layers = model.config.num_hidden_layers
    if not 1 <= num_shards <= num_layers + 2:
        raise ValueError(f"num_shards must be in 1..{num_layers + 2}")
    os.makedirs(directory, exist_ok=True)
    files = [f"model-{k + 1}-of-{num_shards}.safetensors" for k in range(num_shards)]
    shards: list[dict[str, torch.Tensor]] = [{} for _ in files]
    stored = {}
    for name, t in released_names(model.state_dict()).items():
        t = t.detach().float()
        shard = shards[_shard_of(name, num_layers, num_shards)]
        if _QUANTIZED.fullmatch(name):
            q, s = quantize_fp8(t)
            shard[name], shard[name + "_scale_inv"] = q, s
            stored[name] = dequantize_fp8(q, s)
        elif name.endswith("e_score_correction_bias"):
            shard[name] = t.contiguous()
            stored[name] = t.clone()
        else:
            shard[name] = t.to(torch.bfloat16).contiguous()
            stored[name] = shard[name].float()
    inv_freq = model.model.rotary_emb.inv_freq.detach().float()
    for i in range(num_layers):  # the released files carry these (unused) buffers
        name = f"model.layers.{i}.self_attn.rotary_emb.inv_freq"
        shards[_shard_of(name, num_layers, num_shards)][name] = inv_freq.clone()
    weight_map, total = {}, 0
    for fname, shard in zip(files, shards):
        save_file(shard, os.path.join(directory, fname), metadata={"format": "pt"})
        for name, t in shard.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    released_cfg = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", **cfg}
    released_cfg.update(quantization_config=QUANTIZATION_CONFIG, torch_dtype="bfloat16")
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(released_cfg, f, indent=2)
    return stored


def save_hf(model, directory: str, num_shards: int = 1) -> None:
    """save_pretrained in float32; checks transformers wrote the released per-expert names."""
    kwargs = {}
    if num_shards > 1:
        total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        kwargs["max_shard_size"] = -(-total // num_shards)
    model.save_pretrained(directory, **kwargs)
    names = []
    for path in _dir_files(directory):
        with safe_open(path, "pt") as f:
            names += list(f.keys())
    fused = [n for n in names if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    if fused:
        raise RuntimeError(f"save_pretrained wrote fused expert tensors, not the released names: {fused[:3]}")


def _dir_files(directory: str) -> list[str]:
    """The safetensors files of a checkpoint directory (through its index when it has one)."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(directory, n) for n in names]
    single = os.path.join(directory, "model.safetensors")
    return [single] if os.path.exists(single) else sorted(glob.glob(os.path.join(directory, "*.safetensors")))


def read_dir(directory: str) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory as float32 (FP8 dequantized by blocks; inv_freq buffers skipped)."""
    block = (128, 128)
    cfg_path = os.path.join(directory, "config.json")
    if os.path.exists(cfg_path):
        with open(cfg_path) as f:
            block = tuple((json.load(f).get("quantization_config") or {}).get("weight_block_size", block))
    raw = {}
    for path in _dir_files(directory):
        with safe_open(path, "pt") as f:
            for name in f.keys():
                if not name.endswith("rotary_emb.inv_freq"):
                    raw[name] = f.get_tensor(name)
    out = {}
    for name, t in raw.items():
        if name.endswith(("_scale_inv", "weight_scale", "weight_shape")):
            continue
        if name.endswith("weight_packed"):
            w = name[: -len("_packed")]
            out[w] = unpack_int4(t, raw[w + "_scale"], raw[w + "_shape"])
        elif t.dtype == torch.float8_e4m3fn:
            out[name] = dequantize_fp8(t, raw[name + "_scale_inv"], block)
        else:
            out[name] = t.float()
    return out


def load_dir(model, directory: str) -> None:
    """Load a checkpoint directory into the model, strictly (every tensor present, nothing extra)."""
    tensors = read_dir(directory)
    num_layers = model.config.num_hidden_layers
    extra = [n for n in tensors if (m := _LAYER.match(n)) and int(m.group(1)) >= num_layers]
    for n in extra:  # DeepSeek-V3's multi-token-prediction layer 61 is not part of the causal LM
        del tensors[n]
    if extra:
        print(f"oracle: skipped {len(extra)} tensors of layers >= {num_layers}", file=sys.stderr)
    if model.config.tie_word_embeddings and "lm_head.weight" not in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    model.load_state_dict(internal_state_dict(tensors), strict=True)


# ------------------------------------------------------------------------------------------------------ capture
class _Recorder:
    """Forward hooks that record per-layer activations (HF module names) during one forward.

    Keys: embed.out, norm.out, layers.{i}.{in, out, input_layernorm.out, self_attn.out,
    post_attention_layernorm.in, post_attention_layernorm.out, mlp.out}; MoE layers also
    layers.{i}.mlp.gate.{logits, topk_idx, topk_weight}, layers.{i}.mlp.experts.out (routed part),
    layers.{i}.mlp.shared_experts.out. Token-flattened tensors are reshaped to [B, T, ...]; topk_idx is sorted
    ascending per token and topk_weight reordered with it.
    """

    def __init__(self, model, batch: int, seq: int):
        self.shape, self.data, self.gate_in, self.handles = (batch, seq), {}, {}, []
        base = model.model
        self._out(base.embed_tokens, "embed.out")
        self._out(base.norm, "norm.out")
        for i, layer in enumerate(base.layers):
            p = f"layers.{i}"
            self.handles.append(layer.register_forward_pre_hook(self._pre(f"{p}.in"), with_kwargs=True))
            self._out(layer, f"{p}.out")
            self._out(layer.input_layernorm, f"{p}.input_layernorm.out")
            self._out(layer.self_attn, f"{p}.self_attn.out")
            self.handles.append(layer.post_attention_layernorm.register_forward_hook(
                lambda m, a, o, k=f"{p}.post_attention_layernorm.in": self._put(k, a[0])))
            self._out(layer.post_attention_layernorm, f"{p}.post_attention_layernorm.out")
            self._out(layer.mlp, f"{p}.mlp.out")
            if isinstance(layer.mlp, hf_ds3.DeepseekV3MoE):
                self.handles.append(layer.mlp.gate.register_forward_hook(self._gate(i)))
                self._out(layer.mlp.experts, f"{p}.mlp.experts.out")
                self._out(layer.mlp.shared_experts, f"{p}.mlp.shared_experts.out")

    def _put(self, key, t):
        t = t.detach().clone()
        if t.dim() == 2:  # the MoE works on [B*T, ...]
            t = t.view(*self.shape, -1)
        self.data[key] = t

    def _out(self, module, key):
        self.handles.append(module.register_forward_hook(
            lambda m, a, o: self._put(key, o[0] if isinstance(o, tuple) else o)))

    def _pre(self, key):
        return lambda m, args, kwargs: self._put(key, args[0] if args else kwargs["hidden_states"])

    def _gate(self, i):
        def hook(module, args, output):
            logits, weights, idx = output
            idx_sorted, order = idx.sort(dim=-1)
            self.gate_in[i] = args[0].detach().clone()
            self._put(f"layers.{i}.mlp.gate.logits", logits)
            self._put(f"layers.{i}.mlp.gate.topk_idx", idx_sorted)
            self._put(f"layers.{i}.mlp.gate.topk_weight", weights.gather(-1, order))
        return hook

    def close(self):
        for h in self.handles:
            h.remove()


@torch.no_grad()
def _bias_changes_choice(model, rec: _Recorder) -> dict[str, np.ndarray]:
    """Per MoE layer and overall: fraction of tokens whose top-k set differs when the correction bias is zeroed."""
    out, changed, total = {}, 0, 0
    for i, x in rec.gate_in.items():
        gate = model.model.layers[i].mlp.gate
        saved = gate.e_score_correction_bias.clone()
        gate.e_score_correction_bias.zero_()
        try:
            _, _, idx = gate(x)
        finally:
            gate.e_score_correction_bias.copy_(saved)
        with_bias = rec.data[f"layers.{i}.mlp.gate.topk_idx"].reshape(idx.shape[0], -1)
        diff = (idx.sort(-1)[0] != with_bias).any(-1)
        out[f"layers.{i}.mlp.gate.bias_changes_choice"] = np.float64(diff.float().mean())
        changed, total = changed + int(diff.sum()), total + diff.numel()
    out["bias_changes_choice"] = np.float64(changed / total if total else 0.0)
    return out


@torch.no_grad()
def _rope_check(model, batch: int, seq: int, position_ids, seed: int) -> dict[str, np.ndarray]:
    """The model's own rotary embedding applied to seeded random q/k (2 heads / 1 head) at the request positions."""
    g = torch.Generator().manual_seed(seed + 1)
    d = model.config.qk_rope_head_dim
    q_in = torch.randn(batch, 2, seq, d, generator=g)
    k_in = torch.randn(batch, 1, seq, d, generator=g)
    pos = position_ids if position_ids is not None else torch.arange(seq).expand(batch, seq)
    cos, sin = model.model.rotary_emb(q_in, pos)
    apply = hf_ds3.apply_rotary_pos_emb_interleave if model.config.rope_interleave else hf_ds3.apply_rotary_pos_emb
    q_out, k_out = apply(q_in, k_in, cos, sin)
    rot = model.model.rotary_emb
    return {
        "rope.inv_freq": rot.inv_freq.float().numpy(),
        "rope.attention_scaling": np.float64(rot.attention_scaling),
        "attn.scaling": np.float64(model.model.layers[0].self_attn.scaling),
        "rope.position_ids": pos.numpy().astype(np.int64),
        "rope.q_in": q_in.numpy(), "rope.k_in": k_in.numpy(),
        "rope.q_out": q_out.numpy(), "rope.k_out": k_out.numpy(),
    }


# ---------------------------------------------------------------------------------------------------- requests
def _ids(x):
    return None if x is None else torch.as_tensor(np.asarray(x), dtype=torch.long)


def _batched(x):
    """[T] -> [1, T]; [B, T] unchanged."""
    return None if x is None else (x[None] if x.dim() == 1 else x)


def _forward(model, req, seed) -> dict[str, np.ndarray]:
    inp = req["inputs"]
    ids = _batched(_ids(inp["input_ids"]))
    mask, pos = _batched(_ids(inp.get("attention_mask"))), _batched(_ids(inp.get("position_ids")))
    if pos is not None and pos.shape[0] != ids.shape[0]:
        pos = pos.expand(ids.shape[0], -1)
    rec = _Recorder(model, *ids.shape)
    try:
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
    finally:
        rec.close()
    out = {"logits": logits.float().numpy()}
    out.update(_bias_changes_choice(model, rec))
    if req.get("capture"):
        for k, t in rec.data.items():
            out[k] = t.numpy() if not t.is_floating_point() else t.float().numpy()
        out.update(_rope_check(model, *ids.shape, pos, seed))
    return out


def _generate(model, gen) -> dict[str, np.ndarray]:
    """Greedy generation per prompt; stops early only on the request's stop_tokens (none by default)."""
    stop = gen.get("stop_tokens") or None
    cfg = GenerationConfig(
        do_sample=False, use_cache=True, max_new_tokens=int(gen["max_new_tokens"]),
        eos_token_id=stop, pad_token_id=(stop[0] if stop else 0), bos_token_id=None,
    )
    saved = model.generation_config
    model.generation_config = cfg  # so no default eos/pad from the config can leak in
    out = {}
    try:
        for j, prompt in enumerate(gen["prompts"]):
            ids = _ids(prompt)[None]
            with torch.no_grad():
                seq = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
            out[f"generate.{j}"] = seq[0, ids.shape[1]:].numpy().astype(np.int64)
    finally:
        model.generation_config = saved
    return out


def _grad(model, g) -> dict[str, np.ndarray]:
    """Token-mean cross-entropy over masked positions (labels pre-shifted) and d loss / d every parameter."""
    ids, labels = _batched(_ids(g["input_ids"])), _batched(_ids(g["labels"]))
    mask = torch.ones(labels.shape) if g.get("loss_mask") is None else _batched(torch.as_tensor(
        np.asarray(g["loss_mask"]), dtype=torch.float32))
    mask = mask * (labels >= 0)  # negative labels (e.g. -100) never count
    model.zero_grad(set_to_none=True)
    with torch.enable_grad():
        logits = model(input_ids=ids, attention_mask=_batched(_ids(g.get("attention_mask"))), use_cache=False).logits
        logp = torch.log_softmax(logits.float(), dim=-1)
        nll = -logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0]
        loss = (nll * mask).sum() / mask.sum()
        loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        grads[name] = (p.grad if p.grad is not None else torch.zeros_like(p)).detach()
    model.zero_grad(set_to_none=True)
    out = {"loss": np.float32(loss.item())}
    for name, t in released_names(grads).items():
        out[f"grad.{name}"] = t.float().numpy()
    return out


def _bench(entry, b) -> dict[str, np.ndarray]:
    """Forward timings under inference_mode; the bf16 copy is made once per cached model."""
    dtype = b.get("dtype", "float32")
    if dtype not in entry:
        entry[dtype] = copy.deepcopy(entry["float32"]).to(getattr(torch, dtype))
    model = entry[dtype]
    ids = _batched(_ids(b["input_ids"]))
    times = []
    with torch.inference_mode():
        for _ in range(int(b.get("warmup", 1))):
            model(input_ids=ids, use_cache=False)
        for _ in range(int(b.get("repeats", 3))):
            t0 = time.perf_counter()
            model(input_ids=ids, use_cache=False)
            times.append(time.perf_counter() - t0)
    return {"bench.times": np.asarray(times, dtype=np.float64)}


_CACHE: collections.OrderedDict[str, dict] = collections.OrderedDict()
_CACHE_SIZE = 2


def _dir_stamp(directory: str):
    """Identity of a directory's contents for the cache: file names, sizes and mtimes."""
    return sorted((os.path.basename(p), os.path.getsize(p), os.path.getmtime(p))
                  for p in glob.glob(os.path.join(directory, "*")))


def _model_for(req) -> tuple[dict, dict]:
    """The (cached) model entry {"float32": model, ...} for a request; saving happens here too."""
    load = req.get("load")
    cfg = req.get("config")
    if cfg is None:
        if not load:
            raise ValueError("request needs a config or a load directory")
        with open(os.path.join(load, "config.json")) as f:
            cfg = json.load(f)
    save = req.get("save")
    fmt = (save or {}).get("format", "hf")
    key = json.dumps({
        "config": cfg, "seed": req.get("seed", 0), "init_std": req.get("init_std"),
        "bias_scale": req.get("bias_scale", 0.5), "router_std": req.get("router_std"),
        "load": load and [load, _dir_stamp(load)],
        "fp8": bool(save) and fmt == "fp8",
    }, sort_keys=True)
    if key in _CACHE and not save:
        _CACHE.move_to_end(key)
        return cfg, _CACHE[key]
    model = build_model(cfg)
    if load:
        load_dir(model, load)
    else:
        randomize(model, int(req.get("seed", 0)), req.get("init_std"), float(req.get("bias_scale", 0.5)),
                  req.get("router_std"))
    if save:
        n = int(save.get("num_shards", 1))
        if fmt == "fp8":
            stored = write_fp8(model, cfg, save["dir"], n)
            model.load_state_dict(internal_state_dict(stored), strict=True)  # run exactly what was stored
        elif fmt == "hf":
            save_hf(model, save["dir"], n)
        else:
            raise ValueError(f"unknown save format {fmt!r}")
    _CACHE[key] = {"float32": model}
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return cfg, _CACHE[key]


def handle(req: dict) -> str:
    """Run one request; write its npz; return the npz path."""
    if "out" not in req:
        raise ValueError("request needs 'out' (the .npz path to write)")
    out = {}
    if req.get("pack_int4"):
        out.update(_pack_int4(req["pack_int4"]))
    if req.get("chat_template"):
        out.update(_chat_template(req["chat_template"]))
    if set(req) <= {"pack_int4", "chat_template", "out"}:
        _write_npz(req["out"], out)
        return req["out"]
    _, entry = _model_for(req)
    model, seed = entry["float32"], int(req.get("seed", 0))
    if req.get("inputs"):
        out.update(_forward(model, req, seed))
    if req.get("generate"):
        out.update(_generate(model, req["generate"]))
    if req.get("grad"):
        out.update(_grad(model, req["grad"]))
    if req.get("bench"):
        out.update(_bench(entry, req["bench"]))
    _write_npz(req["out"], out)
    return req["out"]


def _write_npz(path: str, out: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "wb") as f:  # a file object: np.savez would otherwise append ".npz" to the name
        np.savez(f, **out)


def answer(line_or_req) -> dict:
    """Handle one request (dict or JSON text); never raises."""
    t0 = time.perf_counter()
    try:
        req = json.loads(line_or_req) if isinstance(line_or_req, str) else line_or_req
        return {"ok": True, "out": handle(req), "seconds": time.perf_counter() - t0}
    except Exception:  # report every failure to the caller instead of dying
        return {"ok": False, "error": traceback.format_exc(), "seconds": time.perf_counter() - t0}


def main(argv: list[str]) -> int:
    if argv == ["--serve"]:
        for line in sys.stdin:
            if line.strip():
                _PROTO.write(json.dumps(answer(line)) + "\n")
                _PROTO.flush()
        return 0
    if len(argv) == 1:
        with open(argv[0]) as f:
            resp = answer(f.read())
        _PROTO.write(json.dumps(resp) + "\n")
        _PROTO.flush()
        return 0 if resp["ok"] else 1
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
