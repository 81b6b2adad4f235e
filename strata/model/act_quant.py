"""Q8 activations: a GEMV input rounded to int8 in runs of 32, as llama.cpp's GPU matmuls round theirs.

llama.cpp's CUDA backend quantizes every activation row it multiplies with a block-quantized weight to Q8_1 (runs of
32 values, one scale each) and takes the dot products in integers (`dp4a`: four byte products per instruction).
strata keeps activations in float by default, and so computes the product of the stored weights exactly; rounding
the activation instead lets a GPU GEMV of a 4-8 bit weight do four multiply-adds per instruction, with the
stored weights' integers as they are, where the float path spends ~5 instructions per weight
(`strata.kernels.gemv_rr`). The cost is the activation's rounding, about 1e-5 in KL on the fixture models
(docs/gguf.md, "Activation quantization").

The rounding is defined here, once, and the kernels (`strata.kernels.gemv_q8x`) compute exactly these integers
and scales (tested bit for bit): per run of 32 values, d = max |x| / 127 and q = x / d rounded half away from
zero, both divisions correctly rounded in fp32; s = d * sum(q) (rounded once) is the run's sum, which the
dot products of weights with an offset (Q4_K's minimum, Q5_1's m, Q8_0_R's +128) need. An all-zero run has
d = s = 0 and q = 0.
"""

from __future__ import annotations

import torch

RUN = 32
"""Values per scale."""

DENSE_KINDS = frozenset({"F32", "F16", "BF16"})
"""Storage types whose products keep float activations in every mode (the router, the hyper-connections)."""


def quantize_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q int8 [..., K], d fp32 [..., K / 32], s fp32 [..., K / 32]) of x [..., K] (K a multiple of 32)."""
    if x.shape[-1] % RUN:
        raise ValueError(f"Q8 activations: the last dimension ({x.shape[-1]}) is not a multiple of {RUN}")
    v = x.float().reshape(*x.shape[:-1], -1, RUN)
    d = v.abs().amax(-1) / 127.0
    pos = d > 0
    r = torch.where(pos[..., None], v / torch.where(pos, d, 1.0)[..., None], 0.0)
    q = torch.trunc(r + torch.where(r < 0, -0.5, 0.5)).clamp(-127, 127)
    s = d * q.sum(-1)
    return q.to(torch.int8).reshape(x.shape), d, s


def dequantize_q8(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """fp32 d * q: the values a Q8 GEMV multiplies."""
    return (q.float().reshape(*q.shape[:-1], -1, RUN) * d[..., None]).reshape(q.shape)


def round_q8(x: torch.Tensor) -> torch.Tensor:
    """x rounded to Q8 activations, as fp32 (`dequantize_q8(quantize_q8(x))`)."""
    q, d, _ = quantize_q8(x)
    return dequantize_q8(q, d)


def q8_input(x: torch.Tensor, kind: str, q8: bool = True) -> torch.Tensor:
    """The input a product with weights of storage type `kind` takes: with `q8`, x rounded (`round_q8`, then to
    x's dtype) when the weights are block-quantized; else x itself."""
    return round_q8(x).to(x.dtype) if q8 and kind not in DENSE_KINDS else x
