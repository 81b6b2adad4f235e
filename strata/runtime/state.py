"""Per-sequence decode state: every cache one sequence carries between calls.

One `SequenceState` per sequence, nothing global, so sequences run side by side and a state can be cloned
(conversation reuse, speculative rollback). Sizes here grow with the sequence; a captured GPU step uses
capacity-sized buffers instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from strata.config import ModelConfig
from strata.errors import StrataError


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
    """Per-sequence cache of one QSA layer, in capacity-sized buffers; row t holds token position t.

    A growable state doubles its buffers as the sequence grows (the reference path); a fixed one is allocated
    once at its capacity so a captured decode step can write into it at a position held in device memory."""

    k: torch.Tensor  # (cap, Hkv, hd) after k_norm and RoPE, model dtype
    v: torch.Tensor  # (cap, Hkv, hd)
    idx_raw: torch.Tensor  # (cap, Di) raw indexer keys (un-normalised, un-rotated)
    idx_blocks: torch.Tensor  # (cap // c, Di) pooled keys of complete blocks, normed and rotated
    ratio: int
    fixed: bool = False

    @classmethod
    def empty(cls, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str, capacity: int | None = None,
              ) -> QSAState:
        c = cfg.indexer_compress_ratio
        cap = capacity if capacity is not None else 4 * cfg.selection_width
        cap = -(-cap // c) * c
        hkv, hd, di = cfg.num_key_value_heads, cfg.head_dim, cfg.indexer_head_dim
        z = lambda *s: torch.zeros(*s, dtype=dtype, device=device)  # noqa: E731
        return cls(z(cap, hkv, hd), z(cap, hkv, hd), z(cap, di), z(cap // c, di), c, capacity is not None)

    @property
    def capacity(self) -> int:
        return self.k.shape[0]

    def reserve(self, n_keys: int) -> None:
        """Make room for `n_keys` positions (grow a growable state; refuse past a fixed capacity)."""
        if n_keys <= self.capacity:
            return
        if self.fixed:
            raise StrataError(f"the sequence needs {n_keys} positions but its state was allocated for "
                              f"{self.capacity} (raise the context capacity)")
        cap = max(n_keys, 2 * self.capacity)
        cap = -(-cap // self.ratio) * self.ratio

        def grow(t: torch.Tensor, rows: int) -> torch.Tensor:
            out = t.new_zeros(rows, *t.shape[1:])
            out[: t.shape[0]] = t
            return out

        self.k, self.v, self.idx_raw = grow(self.k, cap), grow(self.v, cap), grow(self.idx_raw, cap)
        self.idx_blocks = grow(self.idx_blocks, cap // self.ratio)

    def clone(self) -> QSAState:
        return QSAState(self.k.clone(), self.v.clone(), self.idx_raw.clone(), self.idx_blocks.clone(), self.ratio,
                        self.fixed)


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
    decode_step: object | None = field(default=None, repr=False, compare=False)  # runtime.graph.DecodeStep

    @classmethod
    def empty(cls, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str, capacity: int | None = None,
              ) -> SequenceState:
        """A fresh state; `capacity` fixes the QSA buffers at that many positions (else they grow)."""
        layers = [GDNState.empty(cfg, dtype, device) if cfg.is_linear(i)
                  else QSAState.empty(cfg, dtype, device, capacity) for i in range(cfg.num_hidden_layers)]
        ple = {i: PLEState.empty(cfg, dtype, device) for i in cfg.ple}
        return cls(layers, ple)

    def clone(self) -> SequenceState:
        """A deep copy (caches included); a captured decode step bound to this state is not copied."""
        return SequenceState([s.clone() for s in self.layers], {i: s.clone() for i, s in self.ple.items()},
                             self.length, list(self.tokens))

    def fixed_capacity(self, capacity: int) -> bool:
        """Whether every QSA cache was allocated once at `capacity` positions (what a captured step needs)."""
        qsa = [s for s in self.layers if isinstance(s, QSAState)]
        return all(s.fixed and s.capacity >= capacity for s in qsa)
