"""Mixture of experts with a gated shared expert (spec 6)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from strata.config import ModelConfig
from strata.model import topk
from strata.model.hyper import hc_write_read_ref
from strata.weights.schema import Weights
from strata.weights.tensor import StoredTensor

if TYPE_CHECKING:  # ops.py imports the references below
    from strata.model.ops import Ops


def route_ref(logits: torch.Tensor, k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits (L, E) -> (expert ids (L, k) int64, weights (L, k) in the logits' dtype): softmax over all
    experts in fp32, the k largest (largest first), renormalised to sum 1 when `norm_topk_prob`."""
    probs = torch.softmax(logits.float(), dim=-1)
    top_w, top_i = topk.select(probs, k)
    if norm_topk_prob:
        top_w = top_w / top_w.sum(-1, keepdim=True)
    return top_i, top_w.to(logits.dtype)


def moe_combine_ref(routed: torch.Tensor, gate_logit: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """routed (L, H) + sigmoid(gate_logit (L, 1)) * shared (L, H), in the model dtype."""
    return routed + torch.sigmoid(gate_logit) * shared


def moe_write_read_ref(x: torch.Tensor, inject_prev: torch.Tensor, routed: torch.Tensor, gate_logit: torch.Tensor,
                       shared: torch.Tensor, norm: torch.Tensor, down: StoredTensor, up: StoredTensor,
                       inject: StoredTensor | None, streams: int, eps: float, linear,
                       ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """A MoE block's combine, its write and the next read: `hc_write_read_ref` of y = `moe_combine_ref`(routed,
    gate_logit, shared). One op so that a fast backend can fold the combine into the read's launches too."""
    y = moe_combine_ref(routed, gate_logit, shared)
    return hc_write_read_ref(x, inject_prev, y, norm, down, up, inject, streams, eps, linear)


def moe_branches(a: torch.Tensor, w: Weights, layer: int, cfg: ModelConfig, ops: Ops,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The routed experts' output (L, H), the shared expert's gate logit (L, 1) and its output (L, H): the MoE
    block before its combine (`ops.moe_combine`, or folded into the write that follows, `ops.moe_write_read`).
    The router and the shared expert's gate read the same input, so they go through one `linears` call; the
    routed and the shared experts are independent `branches`."""
    p = f"L{layer}.moe."

    def routed() -> tuple[torch.Tensor, torch.Tensor]:
        logits, gate_logit = ops.linears(a, [w[p + "router"], w[p + "sh_gate_inp"]], [None, None], ops.linear)
        top_i, top_w = ops.route(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob)
        y = ops.experts(a, top_i, top_w, w[p + "gate_exps"], w[p + "up_exps"], w[p + "down_exps"], ops.linear)
        return y, gate_logit

    def shared() -> torch.Tensor:
        return ops.mlp(a, w[p + "sh_gate"], w[p + "sh_up"], w[p + "sh_down"], ops.linear)

    (routed_y, gate_logit), shared_y = ops.branches(a, [routed, shared])
    return routed_y, gate_logit, shared_y


def moe_write_read(x: torch.Tensor, inject_prev: torch.Tensor, parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                   w: Weights, prefix: str, streams: int, eps: float, ops: Ops, inject: bool = True,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The MoE block's combine (`moe_branches`' parts) and write, then the read of hyper-connection `prefix`,
    through `ops.moe_write_read`."""
    return ops.moe_write_read(x, inject_prev, *parts, w[prefix + ".norm"].dense(torch.float32, x.device),
                              w[prefix + ".down"], w[prefix + ".up"], w[prefix + ".inject"] if inject else None,
                              streams, eps, ops.linear)
