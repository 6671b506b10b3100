import json

import pytest

from k2jax.config import K2Config
from tests.conftest import CONFIGS


def kimi_raw():
    return json.loads((CONFIGS / "kimi_k2.json").read_text())


@pytest.mark.parametrize("name", ["kimi_k2", "deepseek_v3", "tiny", "bench"])
def test_presets_load_and_round_trip(name):
    cfg = K2Config.from_hf_config(CONFIGS / f"{name}.json")
    assert K2Config.from_hf_config(cfg.to_hf_config()) == cfg
    assert hash(cfg) == hash(K2Config.from_hf_config(CONFIGS / f"{name}.json"))



def test_kimi_fields():
    cfg = K2Config.from_hf_config(CONFIGS / "kimi_k2.json")
    assert (cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_group) == (7168, 384, 8, 1)
    assert (cfg.num_dense_layers, cfg.num_moe_layers) == (1, 60)
    assert cfg.rope_type == "yarn" and cfg.rope_factor == 32.0 and cfg.rope_original_max_position_embeddings == 4096
    assert cfg.quantization_config["weight_block_size"] == [128, 128]
    assert cfg.softmax_scale == pytest.approx(192**-0.5 * (0.1 * __import__("math").log(32) + 1) ** 2)
    assert cfg.softmax_scale == pytest.approx(0.130861, abs=1e-6)


def test_absent_keys_take_transformers_defaults():
    cfg = K2Config.from_hf_config(dict(vocab_size=10, hidden_size=16, num_hidden_layers=2, num_attention_heads=2))
    assert (cfg.n_routed_experts, cfg.n_group, cfg.topk_group, cfg.first_k_dense_replace) == (256, 8, 4, 3)
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.routed_scaling_factor, cfg.rope_theta) == (1536, 512, 2.5, 10000.0)
    assert cfg.rope_type == "default"


def test_null_q_lora_means_plain_q_proj():
    raw = kimi_raw() | {"q_lora_rank": None}
    assert K2Config.from_hf_config(raw).q_lora_rank is None


def test_rope_parameters_form_equals_rope_scaling_form():
    raw = kimi_raw()
    v5 = {k: v for k, v in raw.items() if k not in ("rope_scaling", "rope_theta")}
    v5["rope_parameters"] = dict(raw["rope_scaling"], rope_type="yarn", rope_theta=raw["rope_theta"])
    assert K2Config.from_hf_config(v5) == K2Config.from_hf_config(raw)


def test_unknown_keys_ignored():
    assert K2Config.from_hf_config(kimi_raw() | {"some_future_key": 1}) == K2Config.from_hf_config(kimi_raw())


@pytest.mark.parametrize("change, key", [
    ({"hidden_size": None}, "hidden_size"),
    ({"vocab_size": None}, "vocab_size"),
    ({"num_experts_per_tok": 400}, "num_experts_per_tok"),
    ({"n_group": 5}, "n_group"),
    ({"n_group": 8, "topk_group": 9}, "topk_group"),
    ({"n_group": 8, "topk_group": 0}, "topk_group"),
    ({"qk_rope_head_dim": 63}, "qk_rope_head_dim"),
    ({"num_key_value_heads": 8}, "num_key_value_heads"),
    ({"rope_scaling": {"type": "longrope", "factor": 2.0}}, "rope_scaling"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"moe_layer_freq": 2}, "moe_layer_freq"),
    ({"hidden_size": -3}, "hidden_size"),
])
def test_bad_configs_name_the_key(change, key):
    raw = kimi_raw()
    for k, v in change.items():
        if v is None:
            raw.pop(k)
        else:
            raw[k] = v
    with pytest.raises(ValueError, match=repr(key)):
        K2Config.from_hf_config(raw)


def test_missing_file_and_bad_json(tmp_path):
    with pytest.raises(FileNotFoundError):
        K2Config.from_hf_config(tmp_path / "nope.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        K2Config.from_hf_config(tmp_path)
