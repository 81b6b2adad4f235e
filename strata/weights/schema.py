"""The canonical weight set of a qwen4_exp model: every tensor the geometry needs, with its shape.

Format readers (HF safetensors, GGUF) map their own names and conventions onto these canonical names, then
`check` validates presence and shape of all of them before any compute, naming the tensor on failure.

Conventions of the canonical set (chosen so both HF and GGUF map onto it exactly, without lossy transforms):
* Matrices are (out, in) like `nn.Linear`.
* Offset-RMSNorm weights are stored as the *scale* `1 + w` in float32 (GGUF folds the +1 in; HF adds it).
* GDN `A` is stored as `-exp(A_log)` in float32 (GGUF's `ssm_a`), used as the decay coefficient directly.
* GDN value heads may be in "grouped" (HF) or "tiled" (GGUF) order; `Weights.gdn_value_order` says which,
  and the model maps value heads to key heads accordingly. The result is identical.
* Experts are three 3-D stacks (E, I, H) gate, (E, I, H) up, (E, H, I) down.
* The indexer's fused `index_qk_proj` is split into `idx.q` (Hi*Di, H) and `idx.k` (Di, H).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from strata.config import ModelConfig
from strata.weights.tensor import StoredTensor, WeightError, iter_leaves

# Tensors that are norm scales, conv taps or other small vectors: always float types, never quantized.
SMALL_SUFFIXES = ("norm", "conv", "dt_bias", "A", "_bias")


def _hc(prefix: str, cfg: ModelConfig, inject: bool) -> dict[str, tuple[int, ...]]:
    sh = cfg.hc_dim
    out = {f"{prefix}.norm": (sh,), f"{prefix}.down": (cfg.hc_lowrank, sh), f"{prefix}.up": (sh, cfg.hc_lowrank)}
    if inject:
        out[f"{prefix}.inject"] = (cfg.hc_count, sh)
    return out


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape for every tensor the geometry needs."""
    H, V = cfg.hidden_size, cfg.vocab_size
    s: dict[str, tuple[int, ...]] = {"embed": (V, H)}
    if not cfg.tie_word_embeddings:
        s["head"] = (V, H)
    s |= _hc("final", cfg, inject=False)
    for i in range(cfg.num_hidden_layers):
        p = f"L{i}."
        s |= _hc(p + "hc_attn", cfg, True) | _hc(p + "hc_ffn", cfg, True)
        if cfg.is_linear(i):
            C, nv, dv = cfg.gdn_conv_dim, cfg.linear_num_value_heads, cfg.linear_value_head_dim
            s |= {p + "gdn.qkv": (C, H), p + "gdn.z": (nv * dv, H), p + "gdn.b": (nv, H), p + "gdn.a": (nv, H),
                  p + "gdn.conv": (C, cfg.linear_conv_kernel_dim), p + "gdn.dt_bias": (nv,), p + "gdn.A": (nv,),
                  p + "gdn.norm": (dv,), p + "gdn.out": (H, nv * dv)}
        else:
            hq, hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
            hi, di = cfg.indexer_n_heads, cfg.indexer_head_dim
            s |= {p + "attn.q": (2 * hq * hd, H), p + "attn.k": (hkv * hd, H), p + "attn.v": (hkv * hd, H),
                  p + "attn.o": (H, hq * hd), p + "attn.q_norm": (hd,), p + "attn.k_norm": (hd,),
                  p + "idx.q": (hi * di, H), p + "idx.k": (di, H), p + "idx.q_norm": (di,), p + "idx.k_norm": (di,)}
            if cfg.attention_bias:
                s |= {p + "attn.q_bias": (2 * hq * hd,), p + "attn.k_bias": (hkv * hd,),
                      p + "attn.v_bias": (hkv * hd,), p + "attn.o_bias": (H,)}
        E, I, Is = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        s |= {p + "moe.router": (E, H), p + "moe.gate_exps": (E, I, H), p + "moe.up_exps": (E, I, H),
              p + "moe.down_exps": (E, H, I), p + "moe.sh_gate": (Is, H), p + "moe.sh_up": (Is, H),
              p + "moe.sh_down": (H, Is), p + "moe.sh_gate_inp": (1, H)}
        if cfg.has_ple(i):
            g = cfg.ple[i]
            s |= {p + "ple.table": (g.rows, cfg.ple_head_dim), p + "ple.key": (cfg.hc_dim, cfg.ple_dim),
                  p + "ple.value": (H, cfg.ple_dim), p + "ple.norm_key": (cfg.hc_dim,),
                  p + "ple.norm_query": (cfg.hc_dim,), p + "ple.norm_conv": (cfg.hc_dim,),
                  p + "ple.conv": (cfg.hc_dim, cfg.ple_conv_kernel_size)}
    return s


@dataclass
class Weights:
    """The canonical weight set, validated against a geometry."""

    cfg: ModelConfig
    tensors: dict[str, StoredTensor]
    gdn_value_order: str = "grouped"  # or "tiled" (GGUF)
    source: str = ""
    unknown: list[str] = field(default_factory=list)  # source tensors that mapped to nothing

    def __getitem__(self, name: str) -> StoredTensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise WeightError(f"missing tensor {name!r} in {self.source or 'the model'}") from None

    def get(self, name: str) -> StoredTensor | None:
        return self.tensors.get(name)

    @property
    def head(self) -> StoredTensor:
        return self.tensors["embed"] if self.cfg.tie_word_embeddings else self.tensors["head"]

    def check(self, source_name: dict[str, str] | None = None) -> None:
        """Presence and shape of every tensor the geometry needs. `source_name` maps canonical names to the
        file's own names, so errors name the tensor as the user's file spells it."""
        if self.gdn_value_order not in ("grouped", "tiled"):
            raise WeightError(f"gdn_value_order must be 'grouped' or 'tiled', got {self.gdn_value_order!r}")
        src = source_name or {}
        where = f" in {self.source}" if self.source else ""
        for name, shape in expected_shapes(self.cfg).items():
            t = self.tensors.get(name)
            label = src.get(name, name)
            if t is None:
                raise WeightError(f"missing tensor {label!r}{where} (needed for {name}, expected shape "
                                  f"{list(shape)})")
            if tuple(t.shape) != tuple(shape):
                raise WeightError(f"tensor {label!r}{where} has shape {list(t.shape)}, expected {list(shape)}")
            for leaf in iter_leaves(t):
                if leaf.kind not in ("F32", "BF16", "F16") and name.rsplit(".", 1)[-1].endswith(SMALL_SUFFIXES):
                    raise WeightError(f"tensor {src.get(name, leaf.name)!r}{where} has storage type {leaf.kind}; "
                                      f"{name} must be a float type")
        extra = sorted(set(self.tensors) - set(expected_shapes(self.cfg)))
        if extra:
            raise WeightError(f"unexpected tensors for this geometry{where}: {extra[:8]}")

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())
