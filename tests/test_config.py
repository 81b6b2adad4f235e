"""Config: derived quantities against the spec's reference values, and every validation rule."""

from __future__ import annotations

import pytest

from strata.config import ConfigError, ModelConfig
from tests.reference import BASE, CONFIGS


def make(**overrides) -> ModelConfig:
    return ModelConfig.from_hf_dict(dict(BASE, model_type="qwen4_exp_text") | overrides)


def test_tiny_derived_values_match_spec_table():
    cfg = make()
    assert cfg.layer_types == ("linear_attention",) * 3 + ("indexed_attention",)
    assert cfg.rotary_dim == 8 and cfg.block_topk == 2 and cfg.selection_width == 11
    g0, g1 = cfg.ple[0], cfg.ple[2]
    assert g0.primes == (1009, 1013, 1019, 1021) and g0.offsets == (0, 1009, 2022, 3041) and g0.rows == 4096
    assert g0.multipliers == (4295158889762567, 35454616657218897, 19285316470915801)
    assert g1.primes == (1031, 1033, 1039, 1049) and g1.offsets == (0, 1031, 2064, 3103) and g1.rows == 4224
    assert g1.multipliers == (17237745666421515, 2619768721782095, 33105235034843057)


def test_default_geometry_ple_constants_match_spec():
    cfg = ModelConfig.from_hf_dict({"model_type": "qwen4_exp_text", "ple_layer_ids": [2], "eos_token_id": 1,
                                    "indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 256,
                                    "indexer_budget": 2048, "indexer_compress_ratio": 4})
    g = cfg.ple[1]
    assert g.primes[:3] == (20000003, 20000023, 20000033) and g.rows == 320_001_536
    assert g.multipliers == (23703573157769, 20109073645365, 8052911324071)


def test_qwen4_exp_layout_with_text_config():
    raw = {"model_type": "qwen4_exp", "text_config": dict(BASE, model_type="qwen4_exp_text"),
           "vision_config": {"depth": 2}}
    assert ModelConfig.from_hf_dict(raw) == make()


@pytest.mark.parametrize("alias", ["qwen_sparse_attention", "deepseek_sparse_attention"])
def test_older_qsa_spellings_are_read_as_indexed(alias):
    cfg = make(layer_types=["linear_attention"] * 3 + [alias])
    assert cfg.layer_types[3] == "indexed_attention"


def test_full_attention_is_read_as_indexed_and_interval_default():
    assert make(layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
                ple_layer_ids=[1]).layer_types[1] == "indexed_attention"
    assert make(full_attention_interval=2, ple_layer_ids=[1, 3]).layer_types == (
        "linear_attention", "indexed_attention") * 2


@pytest.mark.parametrize("overrides, field", [
    (dict(layer_types=["linear_attention", "mamba", "linear_attention", "full_attention"]), "layer_types"),
    (dict(output_gate_type="gelu"), "output_gate_type"),
    (dict(hc_count=1), "hc_count"),
    (dict(num_experts=0, num_experts_per_tok=0), "num_experts"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok"),
    (dict(num_experts_per_tok=0), "num_experts_per_tok"),
    (dict(moe_intermediate_size=0), "moe_intermediate_size"),
    (dict(shared_expert_intermediate_size=0), "shared_expert_intermediate_size"),
    (dict(indexer_head_dim=None), "indexer_head_dim"),
    (dict(indexer_budget=-8), "indexer_budget"),
    (dict(indexer_kv_heads=2), "indexer_kv_heads"),
    (dict(indexer_budget=10), "indexer_budget"),
    (dict(indexer_head_dim=4), "indexer_head_dim"),
    (dict(heads_per_ngram=0), "heads_per_ngram"),
    (dict(ple_embed_dim=30), "ple_embed_dim"),
    (dict(ple_layer_ids=[0]), "ple_layer_ids"),
    (dict(ple_layer_ids=[5]), "ple_layer_ids"),
    (dict(ple_layer_ids=[4]), "ple_layer_ids"),  # layer 4 is a QSA layer
    (dict(eos_token_id=None), "eos_token_id"),
    (dict(eos_token_id=[]), "eos_token_id"),
    (dict(eos_token_id=999), "eos_token_id"),
    (dict(num_hidden_layers=5, layer_types=["linear_attention"] * 4), "layer_types"),
    (dict(hidden_size="64"), "hidden_size"),
])
def test_every_validation_rule_names_its_field(overrides, field):
    with pytest.raises(ConfigError, match=field):
        make(**overrides)


def test_indexed_layers_need_indexer_fields():
    fields = dict(indexer_n_heads=None, indexer_kv_heads=None, indexer_head_dim=None, indexer_budget=None,
                  indexer_compress_ratio=None)
    with pytest.raises(ConfigError, match="indexer"):
        make(**fields)
    make(**fields, layer_types=["linear_attention"] * 4)  # no QSA layer: fine


def test_wrong_model_type_and_bad_json(tmp_path):
    with pytest.raises(ConfigError, match="model_type"):
        ModelConfig.from_hf_dict({"model_type": "llama"})
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_file(tmp_path)
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_file(tmp_path / "nowhere")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_agrees_with_transformers_config(name):
    from transformers import Qwen4ExpTextConfig

    ref = Qwen4ExpTextConfig(**CONFIGS[name])
    ours = ModelConfig.from_hf_dict(ref.to_dict())
    assert list(ours.layer_types) == ref.layer_types
    assert list(ours.ple_layer_ids) == ref.ple_layer_ids and ours.ple_dim == ref.ple_embed_dim
