"""Per-sequence decode state: every cache one sequence carries between calls.

One `SequenceState` per sequence, nothing global, so sequences run side by side and a state can be cloned
(conversation reuse, speculative rollback). Sizes here grow with the sequence; a captured GPU step uses
capacity-sized buffers instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from strata.config import ModelConfig


@dataclass
class GDNState:
    """Per-sequence state of one GDN layer."""

    conv: torch.Tensor  # (C, K-1) last conv inputs, model dtype
    recurrent: torch.Tensor  # (nv, dk, dv) float32

    @classmethod
    def empty(cls, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> GDNState:
        return cls(
            torch.zeros(cfg.gdn_conv_dim, cfg.linear_conv_kernel_dim - 1, dtype=dtype, device=device),
            torch.zeros(cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                        dtype=torch.float32, device=device),
        )

    def clone(self) -> GDNState:
        return GDNState(self.conv.clone(), self.recurrent.clone())


@dataclass
class QSAState:
    """Per-sequence cache of one QSA layer. Rows are token positions 0..T-1."""

    k: torch.Tensor  # (T, Hkv, hd) after k_norm and RoPE, model dtype
    v: torch.Tensor  # (T, Hkv, hd)
    idx_raw: torch.Tensor  # (T, Di) raw indexer keys
    idx_blocks: torch.Tensor  # (T // c, Di) pooled, normed, rotated block keys

    @classmethod
    def empty(cls, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> QSAState:
        hkv, hd, di = cfg.num_key_value_heads, cfg.head_dim, cfg.indexer_head_dim
        z = lambda *s: torch.zeros(*s, dtype=dtype, device=device)  # noqa: E731
        return cls(z(0, hkv, hd), z(0, hkv, hd), z(0, di), z(0, di))

    def clone(self) -> QSAState:
        return QSAState(self.k.clone(), self.v.clone(), self.idx_raw.clone(), self.idx_blocks.clone())


@dataclass
class PLEState:
    """Per-sequence state of one PLE layer."""

    context: torch.Tensor  # (n-1,) int64: the previous ids, EOS-filled at the start
    conv: torch.Tensor  # (S*H, (Kp-1)*n) previous normalised gated values, model dtype

    @classmethod
    def empty(cls, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> PLEState:
        return cls(torch.full((cfg.ngram_size - 1,), cfg.ple_eos, dtype=torch.int64),
                   torch.zeros(cfg.hc_dim, cfg.ple_conv_state_len, dtype=dtype, device=device))

    def clone(self) -> PLEState:
        return PLEState(self.context.clone(), self.conv.clone())


@dataclass
class SequenceState:
    """Everything one sequence carries between calls: per-layer caches and the token count."""

    layers: list[GDNState | QSAState]
    ple: dict[int, PLEState]
    length: int = 0
    tokens: list[int] = field(default_factory=list)

    @classmethod
    def empty(cls, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> SequenceState:
        layers = [GDNState.empty(cfg, dtype, device) if cfg.is_linear(i) else QSAState.empty(cfg, dtype, device)
                  for i in range(cfg.num_hidden_layers)]
        ple = {i: PLEState.empty(cfg, dtype, device) for i in cfg.ple}
        return cls(layers, ple)

    def clone(self) -> SequenceState:
        return SequenceState([s.clone() for s in self.layers], {i: s.clone() for i, s in self.ple.items()},
                             self.length, list(self.tokens))
