"""Mixture of experts with a gated shared expert (spec 6)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from strata.config import ModelConfig
from strata.model import topk
from strata.model.ops import Ops
from strata.weights.schema import Weights


def route(a: torch.Tensor, w: Weights, layer: int, cfg: ModelConfig, ops: Ops,
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts (fp32), top-k, renormalise; weights cast to the model dtype.
    Returns (expert ids (L, k), weights (L, k))."""
    logits = ops.linear(a, w[f"L{layer}.moe.router"])
    probs = torch.softmax(logits.float(), dim=-1)
    top_w, top_i = topk.select(probs, cfg.num_experts_per_tok)
    if cfg.norm_topk_prob:
        top_w = top_w / top_w.sum(-1, keepdim=True)
    return top_i, top_w.to(a.dtype)


def expert_mlp(x: torch.Tensor, gate: object, up: object, down: object, ops: Ops) -> torch.Tensor:
    """SiLU-gated MLP: down(silu(gate x) * up x)."""
    return ops.linear(F.silu(ops.linear(x, gate)) * ops.linear(x, up), down)


def moe_layer(a: torch.Tensor, w: Weights, layer: int, cfg: ModelConfig, ops: Ops) -> torch.Tensor:
    """Routed experts + sigmoid-gated shared expert, (L, H) -> (L, H)."""
    p = f"L{layer}.moe."
    top_i, top_w = route(a, w, layer, cfg, ops)
    routed = ops.experts(a, top_i, top_w, w[p + "gate_exps"], w[p + "up_exps"], w[p + "down_exps"], ops.linear)
    shared = expert_mlp(a, w[p + "sh_gate"], w[p + "sh_up"], w[p + "sh_down"], ops)
    return routed + torch.sigmoid(ops.linear(a, w[p + "sh_gate_inp"])) * shared
