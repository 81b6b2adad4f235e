"""Mixture of experts with a gated shared expert (spec 6)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from strata.config import ModelConfig
from strata.model import topk
from strata.weights.schema import Weights

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


def moe_layer(a: torch.Tensor, w: Weights, layer: int, cfg: ModelConfig, ops: Ops) -> torch.Tensor:
    """Routed experts + sigmoid-gated shared expert, (L, H) -> (L, H). The router and the shared expert's gate
    read the same input, so they go through one `linears` call; the routed and the shared experts are
    independent `branches`."""
    p = f"L{layer}.moe."

    def routed() -> tuple[torch.Tensor, torch.Tensor]:
        logits, gate_logit = ops.linears(a, [w[p + "router"], w[p + "sh_gate_inp"]], [None, None], ops.linear)
        top_i, top_w = ops.route(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob)
        y = ops.experts(a, top_i, top_w, w[p + "gate_exps"], w[p + "up_exps"], w[p + "down_exps"], ops.linear)
        return y, gate_logit

    def shared() -> torch.Tensor:
        return ops.mlp(a, w[p + "sh_gate"], w[p + "sh_up"], w[p + "sh_down"], ops.linear)

    (routed_y, gate_logit), shared_y = ops.branches(a, [routed, shared])
    return ops.moe_combine(routed_y, gate_logit, shared_y)
