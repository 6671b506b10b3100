"""Random-weight models, nothing downloaded: the demo's config and tokenizer, and random params of any config.
What `k2jax demo`, `k2jax serve --demo`, the tests and the benchmarks run when no checkpoint is at hand.

    cfg, params = random_model()                     # the demo config (K2's shape in miniature), bf16
    tok = demo_tokenizer()                           # a small tiktoken BPE in Kimi's format (package data)
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from k2jax.config import K2Config
from k2jax.nn.model import abstract_params
from k2jax.nn.quantized import quantize_params
from k2jax.placement import param_shardings
from k2jax.tokenizer import KimiTokenizer

# configs/bench.json (K2's shape in miniature), with a vocabulary of 1024 for the demo tokenizer: first layer
# dense, 7 MoE layers with a sigmoid router picking 8 of 64 experts (noaux_tc, one group) plus one shared
# expert, MLA with a low-rank query, YaRN rope. 64 experts: 8 per device on 8 devices. 390 M params.
DEMO_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "attention_bias": False,
    "bos_token_id": 0, "eos_token_id": 1, "first_k_dense_replace": 1, "hidden_act": "silu",
    "hidden_size": 1024, "intermediate_size": 2048, "moe_intermediate_size": 256, "num_hidden_layers": 8,
    "n_routed_experts": 64, "num_experts_per_tok": 8, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
    "norm_topk_prob": True, "routed_scaling_factor": 2.827, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
    "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": 384, "kv_lora_rank": 256,
    "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64, "max_position_embeddings": 131072,
    "rope_theta": 50000.0, "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "vocab_size": 1024,
    "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                     "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
}
# The demo tokenizer, shipped with the package: 512 BPE merges, 768 tokens, + the 256 reserved specials = 1024
# ids, exactly vocab_size (as Kimi's 163584 + 256 = 163840): every id the model can sample is a token. Made by
# tests/bpe.py's trainer (tests/test_tokenizer.py checks these files are its output).
DEMO_TOKENIZER_DIR = pathlib.Path(__file__).resolve().parent / "data" / "demo_tokenizer"


def demo_tokenizer() -> KimiTokenizer:
    """The small Kimi-format tokenizer the demo and `k2jax serve --demo` use (tiktoken.model + its config)."""
    return KimiTokenizer.from_dir(DEMO_TOKENIZER_DIR)


def random_params(cfg: K2Config, dtype=np.float32, seed: int = 0, scale: float = 0.15):
    """Random params of `cfg` (the stacked tree of abstract_params(cfg, dtype)) without compiling an init:
    vectors (norms, router bias) near 1, matrices ~N(0, scale²). The default scale separates logits well (no
    greedy ties)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: jnp.asarray(1 + 0.1 * rng.standard_normal(s.shape) if len(s.shape) == 1
                                              else scale * rng.standard_normal(s.shape), s.dtype),
                        abstract_params(cfg, dtype))


def random_model(cfg: K2Config | None = None, dtype=jnp.bfloat16, seed: int = 0, quant: str | None = None,
                 mesh=None) -> tuple[K2Config, dict]:
    """A random-weight model -> (cfg, params), as k2jax.load returns one: `cfg` (default: DEMO_CONFIG) with
    random_params in `dtype`, the params `quant` holds quantized ("fp8" | "int4", k2jax.quant_policy) made
    QuantizedWeight, placed on `mesh` by k2jax.param_shardings (None: the default device)."""
    cfg = K2Config.from_hf_config(DEMO_CONFIG) if cfg is None else cfg
    params = random_params(cfg, dtype, seed=seed)
    if quant is not None:
        params = quantize_params(params, cfg, quant)
    if mesh is not None:
        params = jax.device_put(params, param_shardings(cfg, mesh, quant=quant))
    return cfg, params
