"""The transformers reference (the oracle) on tiny random configs, for parity tests.

Every weight is re-randomised: a fresh init leaves (1+w) norms at 0, the PLE conv at 0, the GDN norm at 1 and
dt_bias at 1, so whole paths would contribute nothing and a bug there would pass unnoticed.
"""

from __future__ import annotations

from pathlib import Path

import torch

BASE = dict(
    vocab_size=256, hidden_size=64, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                     "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    hc_count=2, hc_lowrank=16,
    ple_layer_ids=[1, 3], ple_embed_dim=32, ngram_size=3, heads_per_ngram=2,
    ngram_vocab_size_base=1000, make_ngram_vocab_size_divisible_by=128, ple_conv_kernel_size=4, seed=1234,
    indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4,
    max_position_embeddings=512, eos_token_id=1, pad_token_id=0, bos_token_id=None, split_ngram_parts=2,
)

# Three configs that differ in layer placement, hc_count, PLE placement/absence, experts/top-k, gate, rotary.
CONFIGS = {
    # spec's TINY: QSA at layer 3, hc 2, PLE at layers 1 and 3 (1-indexed), PLE table in 2 shards
    "tiny": dict(BASE),
    # 8 layers (QSA at 3 and 7), hc 4, PLE at layer 2 only, sigmoid GDN gate, 6 experts top-3, c=3,
    # 4 indexer heads (with 2, exact-zero ReLU ties at the k-th block are common)
    "hc4": dict(BASE, num_hidden_layers=8, hc_count=4, ple_layer_ids=[2], indexer_budget=12,
                indexer_compress_ratio=3, indexer_n_heads=4, output_gate_type="sigmoid", num_experts=6,
                num_experts_per_tok=3, split_ngram_parts=1),
    # explicit layer types with QSA first-ish, no PLE, full rotary, 5 experts top-1 unnormalised, biases
    "nople": dict(BASE, num_hidden_layers=5,
                  layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention",
                               "full_attention"],
                  ple_layer_ids=[], hc_count=3, num_experts=5, num_experts_per_tok=1, norm_topk_prob=False,
                  indexer_budget=6, indexer_compress_ratio=2, indexer_n_heads=4,
                  rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 1.0},
                  attention_bias=True, tie_word_embeddings=True),
}


def selection_width(cfg: dict) -> int:
    return cfg["indexer_budget"] + cfg["indexer_compress_ratio"] - 1


def build(name_or_cfg: str | dict, seed: int = 0, **overrides):
    """A float32 eager transformers model with every weight re-randomised."""
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    cfg = dict(CONFIGS[name_or_cfg]) if isinstance(name_or_cfg, str) else dict(name_or_cfg)
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = Qwen4ExpForCausalLM._from_config(Qwen4ExpTextConfig(**cfg), attn_implementation="eager",
                                             experts_implementation="eager").eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.dtype.is_floating_point:
                continue
            if name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=gen) * 2 - 1)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model


def save(model, folder: Path) -> Path:
    model.save_pretrained(folder)
    return folder


def decode_logits(engine, ids: list[int], prompt: int) -> torch.Tensor:
    """Logits of a prefill of ids[:prompt] followed by token-by-token decode of the rest, through `engine`."""
    state = engine.new_state()
    return torch.stack([engine.prefill(ids[:prompt], state)] + [engine.decode(t, state) for t in ids[prompt:]])


def static_logits(engine, ids: list[int], prompt: int, capacity: int) -> torch.Tensor:
    """The same through the fixed-capacity step the GPU captures as a graph (run eagerly)."""
    from strata.runtime.graph import DecodeStep

    step = DecodeStep(engine.model, capacity=capacity, capture=False)
    rows = [step.prefill(torch.tensor(ids[:prompt]))] + [step.step(t) for t in ids[prompt:]]
    return torch.stack(rows).float()


def assert_decodes_match(ref, fast, ids: list[int], prompt: int, capacity: int | None = None,
                         tol: float = 1e-5) -> None:
    """`fast` (an engine with kernels installed) decodes `ids` like `ref`, through the engine and, with a
    capacity, through the static step. Static is compared with static: with 2 indexer heads, exact-zero ReLU
    ties at the k-th block may break differently over capacity-sized candidate lists than over growing ones."""
    def rel(got: torch.Tensor, want: torch.Tensor) -> float:
        return float((got - want).abs().max() / want.abs().max())

    assert rel(decode_logits(fast, ids, prompt), decode_logits(ref, ids, prompt)) < tol
    if capacity is not None:
        assert rel(static_logits(fast, ids, prompt, capacity), static_logits(ref, ids, prompt, capacity)) < tol


def with_device_tables(model):
    """`model` (a strata Model) with each PLE table's stored rows as one tensor on its device, as
    `--ple-table device` leaves them on a GPU: a decode step of it can hash and gather its rows itself."""
    from strata.model.model import Model
    from strata.runtime.host_memory import one_tensor
    from strata.weights.schema import Weights

    w = model.w
    tensors = {n: one_tensor(t, model.device) if n.endswith("ple.table") else t for n, t in w.tensors.items()}
    return Model(Weights(w.cfg, tensors, w.gdn_value_order, w.source, w.unknown), model.dtype, model.device,
                 model.ops)


def count_calls(monkeypatch, targets: dict) -> dict:
    """Count the calls of module functions: targets maps a key to (module, function name); returns the live
    counts by key (each function is patched to count, then call through)."""
    calls = dict.fromkeys(targets, 0)
    for key, (mod, fn) in targets.items():
        orig = getattr(mod, fn)

        def counted(*a, _o=orig, _k=key, **kw):
            calls[_k] += 1
            return _o(*a, **kw)

        monkeypatch.setattr(mod, fn, counted)
    return calls
