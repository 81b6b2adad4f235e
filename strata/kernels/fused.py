"""The fused-kernel op table: `fused_ops(base)` installs the Triton twins of the decode-critical ops.

Each installed entry keeps the reference's signature and decides per call: the kernel when the inputs live on a
CUDA device (or when `force` is set, which is how the CPU tests run the kernels under TRITON_INTERPRET=1) and
the shape case is one the kernel handles (one token for GDN and the hyper-connection read, a few queries for
attention, a few tokens for the MoE routing and combine), else the entry it replaces in `base`. So prefill,
quantized weights and CPU runs keep the reference math, and a captured decode step gets the kernels without the
model knowing.

The indexer selection entry (`select_tokens`) is replaced when it holds the reference function.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from strata.config import ModelConfig
from strata.kernels import attention, gdn, hyper, moe
from strata.kernels import hc_write as hc_write_kernel
from strata.kernels import norm_rope as norm_rope_kernel
from strata.kernels import ple as ple_kernel
from strata.model.gdn import GDNParams
from strata.model.ops import Ops
from strata.model.qsa import select_tokens as select_tokens_ref
from strata.runtime.state import GDNState, QSAState
from strata.weights.tensor import StoredTensor


def _on_device(t: torch.Tensor, force: bool) -> bool:
    return force or t.is_cuda


def make_gdn_core(fallback: Callable, force: bool = False) -> Callable:
    """gdn_core entry: the fused one-token step, else `fallback`."""

    def gdn_core(x: torch.Tensor, z: torch.Tensor, b: torch.Tensor, alpha: torch.Tensor, prm: GDNParams,
                 state: GDNState, cfg: ModelConfig) -> torch.Tensor:
        if _on_device(x, force) and gdn.supported(x, state, cfg):
            return gdn.gdn_step(x, z, b, alpha, prm, state, cfg)
        return fallback(x, z, b, alpha, prm, state, cfg)

    return gdn_core


def make_attend(fallback: Callable, force: bool = False) -> Callable:
    """attend entry: the index-reading flash-decoding kernel for a few queries, else `fallback`."""

    def attend(q: torch.Tensor, state: QSAState, idx: torch.Tensor, ok: torch.Tensor, cfg: ModelConfig,
               ) -> torch.Tensor:
        if _on_device(q, force) and attention.attend_supported(q, state):
            return attention.attend(q, state, idx, ok, cfg)
        return fallback(q, state, idx, ok, cfg)

    return attend


def make_hc_read(fallback: Callable, force: bool = False) -> Callable:
    """hc_read entry: the two-launch fused read for one token with dense weights, else `fallback`."""

    def hc_read(x: torch.Tensor, norm: torch.Tensor, down: StoredTensor, up: StoredTensor,
                inject: StoredTensor | None, streams: int, eps: float, linear: Callable,
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if _on_device(x, force) and hyper.supported(x, down, up, inject):
            return hyper.hc_read(x, norm, down, up, inject, streams, eps)
        return fallback(x, norm, down, up, inject, streams, eps, linear)

    return hc_read


def make_route(fallback: Callable, force: bool = False) -> Callable:
    """route entry: the one-launch softmax/top-k/renormalise for a few tokens, else `fallback`."""

    def route(logits: torch.Tensor, k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if _on_device(logits, force) and moe.route_supported(logits, k):
            return moe.route(logits, k, norm_topk_prob)
        return fallback(logits, k, norm_topk_prob)

    return route


def make_moe_combine(fallback: Callable, force: bool = False) -> Callable:
    """moe_combine entry: routed + sigmoid(gate) * shared in one launch for a few tokens, else `fallback`."""

    def moe_combine(routed: torch.Tensor, gate_logit: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
        if _on_device(routed, force) and moe.combine_supported(routed, gate_logit, shared):
            return moe.moe_combine(routed, gate_logit, shared)
        return fallback(routed, gate_logit, shared)

    return moe_combine


def make_select_tokens(fallback: Callable, force: bool = False) -> Callable:
    """Indexer selection: kernel block scores for a few queries, else `fallback`."""

    def select_tokens(q_idx: torch.Tensor, blocks: torch.Tensor, positions: torch.Tensor, cfg: ModelConfig,
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        if _on_device(q_idx, force) and q_idx.shape[0] <= attention.MAX_L:
            return attention.select_tokens(q_idx, blocks, positions, cfg)
        return fallback(q_idx, blocks, positions, cfg)

    return select_tokens


def make_norm_rope(fallback: Callable, force: bool = False) -> Callable:
    """norm_rope entry: per-head RMSNorm + RoPE in one launch, else `fallback`."""

    def norm_rope(x: torch.Tensor, scale: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
                  ) -> torch.Tensor:
        if _on_device(x, force) and norm_rope_kernel.supported(x, scale, cos):
            return norm_rope_kernel.norm_rope(x, scale, cos, sin, eps)
        return fallback(x, scale, cos, sin, eps)

    return norm_rope


def make_hc_write(fallback: Callable, force: bool = False) -> Callable:
    """hc_write entry: x + inject (x) y in one launch, else `fallback`."""

    def hc_write(x: torch.Tensor, inject: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if _on_device(x, force) and hc_write_kernel.supported(x, inject, y):
            return hc_write_kernel.hc_write(x, inject, y)
        return fallback(x, inject, y)

    return hc_write


def make_ple_mix(fallback: Callable, force: bool = False) -> Callable:
    """ple_mix entry: the two-launch one-token PLE gate / norm / conv / window shift, else `fallback`."""

    def ple_mix(x: torch.Tensor, key: torch.Tensor, value: torch.Tensor, norm_key: torch.Tensor,
                norm_query: torch.Tensor, norm_conv: torch.Tensor, conv_w: torch.Tensor, window: torch.Tensor,
                cfg: ModelConfig) -> torch.Tensor:
        if _on_device(x, force) and ple_kernel.supported(x, key, value, conv_w, window, cfg):
            return ple_kernel.ple_mix(x, key, value, norm_key, norm_query, norm_conv, conv_w, window, cfg)
        return fallback(x, key, value, norm_key, norm_query, norm_conv, conv_w, window, cfg)

    return ple_mix


def fused_ops(base: Ops, force: bool = False) -> Ops:
    """`base` with the fused entries installed (each falling back to what `base` had). `force` runs the
    kernels on any device (CPU tensors need TRITON_INTERPRET=1); without it they run only on CUDA tensors."""
    entries = {
        "gdn_core": make_gdn_core(base.gdn_core, force),
        "attend": make_attend(base.attend, force),
        "hc_read": make_hc_read(base.hc_read, force),
        "norm_rope": make_norm_rope(base.norm_rope, force),
        "route": make_route(base.route, force),
        "moe_combine": make_moe_combine(base.moe_combine, force),
        "hc_write": make_hc_write(base.hc_write, force),
        "ple_mix": make_ple_mix(base.ple_mix, force),
    }
    for f in dataclasses.fields(base):
        if getattr(base, f.name) is select_tokens_ref:
            entries[f.name] = make_select_tokens(select_tokens_ref, force)
    return dataclasses.replace(base, **entries)
