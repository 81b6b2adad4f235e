"""A synthetic model at the real Qwen3.8-Flash-Next geometry, for benchmarks without the real weights.

Random weights are generated directly in their storage format (the GGUF block layouts, with sane fp16 scales)
on the target device: the same shapes, types, bytes and kernels as the real model, so the timing is the real
timing; only the text it would write is meaningless. `REAL_GEOMETRY` follows
`shared/design/performance-model.md`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from strata.config import ModelConfig
from strata.weights.schema import SMALL_SUFFIXES, Weights, expected_shapes
from strata.weights.tensor import DenseTensor, StoredTensor

REAL_GEOMETRY = dict(
    vocab_size=248320, hidden_size=2560, num_hidden_layers=48, num_attention_heads=24, num_key_value_heads=2,
    head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_num_key_heads=16, linear_num_value_heads=48, num_experts=512, num_experts_per_tok=10,
    moe_intermediate_size=640, shared_expert_intermediate_size=640, hc_count=4, hc_lowrank=320,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    ple_layer_ids=[2], ple_embed_dim=2560, heads_per_ngram=8, ngram_size=3, ngram_vocab_size_base=20_000_000,
    indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=128, indexer_budget=2048, indexer_compress_ratio=4,
    eos_token_id=248044, model_type="qwen4_exp_text",
)


@dataclass(frozen=True)
class TypeMix:
    """Storage type per weight role (ggml type names)."""

    experts: str = "Q4_K"
    expert_down: str = "Q5_1"
    attention: str = "Q8_0"  # GDN and QSA projections
    shared: str = "Q8_0"
    hyper: str = "BF16"
    head: str = "Q6_K"
    embed: str = "Q6_K"
    ple_table: str = "IQ4_NL"
    ple_proj: str = "Q8_0"

    def describe(self) -> str:
        return (f"experts {self.experts}, expert down {self.expert_down}, attention/GDN {self.attention}, "
                f"shared expert {self.shared}, HC {self.hyper}, head {self.head}, embed {self.embed}, "
                f"PLE table {self.ple_table}, PLE proj {self.ple_proj}, router/norms F32 (a GPU stores the router group "
                "in a 16-bit model's dtype: placement.in_model_dtype)")

    def type_of(self, name: str) -> str:
        part = name.split(".", 1)[1] if name.startswith("L") else name
        if part.rsplit(".", 1)[-1].endswith(SMALL_SUFFIXES):
            return "F32"
        if part in ("moe.gate_exps", "moe.up_exps"):
            return self.experts
        if part == "moe.down_exps":
            return self.expert_down
        if part.startswith("moe.sh") and part != "moe.sh_gate_inp":
            return self.shared
        if part.startswith(("gdn.", "attn.", "idx.")):
            return self.attention
        if part.startswith(("hc_", "final")):
            return self.hyper
        if part == "head":
            return self.head
        if part == "embed":
            return self.embed
        if part == "ple.table":
            return self.ple_table
        if part in ("ple.key", "ple.value"):
            return self.ple_proj
        return "F32"


# Byte offsets of the fp16 scale fields inside one block, per type: overwritten with small positive values
# so the random blocks decode to sane weights (random bytes there would give NaN/inf or 1e4-sized weights).
_SCALE_FIELDS = {
    "Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "IQ4_NL": (0,), "IQ4_XS": (0,),
    "Q4_K": (0, 2), "Q5_K": (0, 2), "Q2_K": (80, 82), "Q3_K": (108,), "Q6_K": (208,), "Q2_0": (0,),
}


def random_blocks(type_name: str, rows: int, cols: int, device: torch.device, gen: torch.Generator,
                  ) -> torch.Tensor:
    """(rows, row_bytes) uint8 of random blocks of `type_name` with sane scales."""
    from strata.weights.quants import GGML_TYPES

    t = next(t for t in GGML_TYPES.values() if t.name == type_name)
    nb = cols // t.block_size
    data = torch.randint(0, 256, (rows, nb, t.type_size), dtype=torch.uint8, device=device, generator=gen)
    scale = torch.full((rows, nb, 1), 0.002, dtype=torch.float16, device=device).view(torch.uint8)
    for off in _SCALE_FIELDS[type_name]:
        data[:, :, off:off + 2] = scale
    return data.reshape(rows, nb * t.type_size)


def _tensor(name: str, shape: tuple[int, ...], type_name: str, device: torch.device, gen: torch.Generator,
            ) -> StoredTensor:
    if type_name in ("F32", "BF16", "F16"):
        dtype = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}[type_name]
        t = torch.randn(shape, device=device, generator=gen, dtype=torch.float32).mul_(0.02).to(dtype)
        if name.endswith(("norm", "norm_key", "norm_query", "norm_conv")):
            t = t.add_(1.0)
        if name.endswith("gdn.A"):
            t = -t.abs().add_(0.5)
        return DenseTensor(name, t)
    from strata.weights.quant_tensor import QuantTensor
    from strata.weights.quants import GGML_TYPES

    type_id = next(t.id for t in GGML_TYPES.values() if t.name == type_name)
    rows = 1
    for s in shape[:-1]:
        rows *= s
    data = random_blocks(type_name, rows, shape[-1], device, gen)
    return QuantTensor(name, data.reshape(*shape[:-1], data.shape[-1]), type_id, shape)


def _host_zeros(rows: int, cols: int) -> torch.Tensor:
    """(rows, cols) uint8 zeros in host memory without writing them: numpy's zeros come from calloc, which maps
    fresh (zero) pages for large sizes, and reading them commits no memory. `torch.empty` may instead hand back
    recycled memory, whose bytes would decode to NaN scales now and then."""
    return torch.from_numpy(np.zeros((rows, cols), dtype=np.uint8))


def synthetic_weights(cfg: ModelConfig, mix: TypeMix, device: str | torch.device, seed: int = 0,
                      ple_table_device: str | torch.device = "cpu") -> Weights:
    """Every tensor of the geometry, generated in its storage type. The PLE table (tens of GB) is zeros on
    `ple_table_device` (its rows decode to 0: finite, whatever a token hashes to), and in host memory zeros that
    are not written: pages of an anonymous mapping (`_host_zeros`), so only the rows a token hashes to are ever
    touched."""
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors: dict[str, StoredTensor] = {}
    for name, shape in expected_shapes(cfg).items():
        type_name = mix.type_of(name)
        if name.endswith("ple.table"):
            tensors[name] = zero_table(name, shape, type_name, ple_table_device)
            continue
        tensors[name] = _tensor(name, shape, type_name, device, gen)
    return Weights(cfg, tensors, gdn_value_order="tiled", source="synthetic")


def zero_table(name: str, shape: tuple[int, int], type_name: str, device: str | torch.device) -> StoredTensor:
    """A quantized table of zeros (rows decode to 0) on `device`; in host memory in untouched pages
    (`_host_zeros`), so only the rows that are read are ever committed."""
    from strata.weights.quant_tensor import QuantTensor
    from strata.weights.quants import GGML_TYPES

    t = next(t for t in GGML_TYPES.values() if t.name == type_name)
    row_bytes = shape[1] // t.block_size * t.type_size
    data = (_host_zeros(shape[0], row_bytes) if torch.device(device).type == "cpu"
            else torch.zeros(shape[0], row_bytes, dtype=torch.uint8, device=device))
    return QuantTensor(name, data, t.id, shape)


def real_config(**overrides) -> ModelConfig:
    return ModelConfig.from_hf_dict(REAL_GEOMETRY | overrides)
