"""Fused hyper-connection write: the twin of `strata.model.hyper.hc_write_ref` in one launch.

out[l, s*H + h] = x[l, s*H + h] + round(inject[l, s] * y[l, h]): the product is rounded to the model dtype
before the sum, as in the reference (which materialises the (L, S, H) product in the model dtype), so in
fp32 the kernel is exact and in bf16 it differs only where the interpreter's truncating cast does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from strata.kernels import pdl

TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _hc_write_kernel(x_ptr, inj_ptr, y_ptr, out_ptr, N, S, H, BLOCK: tl.constexpr, DT: tl.constexpr, GDC: tl.constexpr = False):
    pdl.started(GDC)
    pdl.wait(GDC)
    off = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = off < N
    row = off // (S * H)  # token
    col = off % (S * H)
    s = col // H
    h = col % H
    xv = tl.load(x_ptr + off, mask=m, other=0.0).to(tl.float32)
    iv = tl.load(inj_ptr + row * S + s, mask=m, other=0.0).to(tl.float32)
    yv = tl.load(y_ptr + row * H + h, mask=m, other=0.0).to(tl.float32)
    p = (iv * yv).to(DT).to(tl.float32)
    tl.store(out_ptr + off, (xv + p).to(DT), mask=m)


def supported(x: torch.Tensor, inject: torch.Tensor, y: torch.Tensor) -> bool:
    """One dtype the kernel knows for all three, 2-d shapes that agree."""
    return (x.dtype in TL_DTYPES and inject.dtype == x.dtype and y.dtype == x.dtype
            and x.dim() == 2 and inject.dim() == 2 and y.dim() == 2
            and x.shape[0] == inject.shape[0] == y.shape[0] and x.shape[1] == inject.shape[1] * y.shape[1])


def hc_write(x: torch.Tensor, inject: torch.Tensor, y: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """x (L, S*H) + (inject (L, S) x y (L, H)) flattened stream-major, in one launch."""
    x, inject, y = x.contiguous(), inject.contiguous(), y.contiguous()
    L, S, H = x.shape[0], inject.shape[1], y.shape[1]
    out = torch.empty_like(x)
    n = L * S * H
    blk = min(block, triton.next_power_of_2(max(n, 1)))
    _hc_write_kernel[(triton.cdiv(n, blk),)](x, inject, y, out, n, S, H, BLOCK=blk, DT=TL_DTYPES[x.dtype],
                                             **pdl.launch(x.device))
    return out
