"""RMSNorm variants (spec 2). Statistics always in float32."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """Offset RMSNorm: x * rsqrt(mean(x^2) + eps) * scale, where scale = 1 + w (fp32), multiplied in fp32
    before the cast back to x's dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * scale.float()).to(x.dtype)


def grouped_rms_norm(x: torch.Tensor, scale: torch.Tensor, group: int, eps: float) -> torch.Tensor:
    """Offset RMSNorm per contiguous group of `group` features (one per hyper-connection stream)."""
    xf = x.float().unflatten(-1, (-1, group))
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)
    return (y * scale.float()).to(x.dtype)


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, act: str) -> torch.Tensor:
    """GDN output norm: normalise, cast, multiply by the plain weight in model dtype, then gate in fp32."""
    dtype = o.dtype
    of = o.float()
    n = (of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    p = weight.to(dtype) * n
    gate = F.silu(z.float()) if act == "silu" else torch.sigmoid(z.float())
    return (p.float() * gate).to(dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)
