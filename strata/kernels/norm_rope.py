"""Fused RMSNorm + RoPE for one call's heads (the twin of `strata.model.qsa.norm_rope_ref`), and the RoPE tables
of a call's positions in one launch (`rope_at`, the twin of `Rope.at`).

Every QSA layer normalises and rotates its indexer query heads, query heads, key heads and (when a block
completes) pooled block keys; the reference spends ~14 small kernels on each. Here it is one launch with one
program per (token, head) row: load the d values, fp32 mean square, multiply by rsqrt and the fp32 scale, cast
to the model dtype (where the reference's rms_norm rounds), then rotate the first r dims NeoX style (pairs i
and i + r/2) with the products and their sum in fp32 of the rounded operands, rounded once per output. In fp32
that is the reference's math; in bf16 the reference rounds each product and the sum, so results differ from
it by at most about one bf16 ulp.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from strata.config import ModelConfig
from strata.kernels import pdl
from strata.model.qsa import Rope, inv_freq

TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _round(v, DT: tl.constexpr):
    """fp32 -> DT, round to nearest even, returned as fp32. bf16 rounds by hand (finite values): Triton's
    interpreter truncates fp32 -> bf16 casts, and the GPU's cast gives the same bits as this."""
    if DT == tl.bfloat16:
        b = v.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        return b.to(tl.float32, bitcast=True)
    else:
        return v.to(DT).to(tl.float32)


@triton.jit
def _norm_rope_row(x_ptr, scale_ptr, cos_ptr, sin_ptr, out_ptr, row, HEADS, sxl, sxh, scl, ssl, eps,
                   D: tl.constexpr, R: tl.constexpr, BD: tl.constexpr, DT: tl.constexpr):
    """Row `row` (token row // HEADS, head row % HEADS) of x normalised and rotated into out (contiguous)."""
    l = row // HEADS
    h = row % HEADS
    d = tl.arange(0, BD)
    dm = d < D
    base = x_ptr + l * sxl + h * sxh
    x = tl.load(base + d, mask=dm, other=0.0).to(tl.float32)
    rs = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    pd = partner(d, R)
    xp = tl.load(base + pd, mask=d < R, other=0.0).to(tl.float32)
    out = normed_rotated(x, xp, rs, scale_ptr, cos_ptr + l * scl, sin_ptr + l * ssl, d, dm, R, DT)
    tl.store(out_ptr + row * D + d, out.to(DT), mask=dm)


@triton.jit
def _norm_rope_kernel(x_ptr, scale_ptr, cos_ptr, sin_ptr, out_ptr, HEADS, sxl, sxh, scl, ssl, eps,
                      D: tl.constexpr, R: tl.constexpr, BD: tl.constexpr, DT: tl.constexpr, GDC: tl.constexpr = False):
    pdl.enter(GDC)
    _norm_rope_row(x_ptr, scale_ptr, cos_ptr, sin_ptr, out_ptr, tl.program_id(0), HEADS, sxl, sxh, scl, ssl, eps,
                   D, R, BD, DT)


@triton.jit
def _norm_rope_pair_kernel(x1_ptr, s1_ptr, o1_ptr, H1, sx1l, sx1h, x2_ptr, s2_ptr, o2_ptr, H2, sx2l, sx2h, ROWS1,
                           cos_ptr, sin_ptr, scl, ssl, eps, D1: tl.constexpr, BD1: tl.constexpr, D2: tl.constexpr,
                           BD2: tl.constexpr, R: tl.constexpr, DT: tl.constexpr, GDC: tl.constexpr = False):
    """`_norm_rope_kernel` over two tensors at the same positions: programs below ROWS1 take the first."""
    pdl.enter(GDC)
    row = tl.program_id(0)
    if row < ROWS1:
        _norm_rope_row(x1_ptr, s1_ptr, cos_ptr, sin_ptr, o1_ptr, row, H1, sx1l, sx1h, scl, ssl, eps, D1, R, BD1, DT)
    else:
        _norm_rope_row(x2_ptr, s2_ptr, cos_ptr, sin_ptr, o2_ptr, row - ROWS1, H2, sx2l, sx2h, scl, ssl, eps, D2, R,
                       BD2, DT)


@triton.jit
def partner(d, R: tl.constexpr):
    """The NeoX rotate-half partner of each of the first R dims (i <-> i + R/2)."""
    HALF: tl.constexpr = R // 2
    return tl.where(d < HALF, d + HALF, d - HALF)


@triton.jit
def normed_rotated(x, xp, rs, scale_ptr, cos_row, sin_row, d, dm, R: tl.constexpr, DT: tl.constexpr):
    """RMSNorm then RoPE of one row, rounded as in the module docstring: x the fp32 values at dims d, xp those at
    `partner(d)` (for d < R), rs the row's inverse RMS (broadcast against x), fp32 scale (1 + w) at scale_ptr,
    cos/sin of the row's position at cos_row/sin_row. Returns fp32 values already rounded to DT."""
    HALF: tl.constexpr = R // 2
    rm = d < R
    pd = partner(d, R)
    w = tl.load(scale_ptr + d, mask=dm, other=0.0).to(tl.float32)
    y = _round(x * rs * w, DT)
    wp = tl.load(scale_ptr + pd, mask=rm, other=0.0).to(tl.float32)
    yp = _round(xp * rs * wp, DT)  # the partner, normalised the same way (same fp32 ops, same value)
    yp = tl.where(d < HALF, -yp, yp)
    c = tl.load(cos_row + d, mask=rm, other=1.0).to(tl.float32)
    s = tl.load(sin_row + d, mask=rm, other=0.0).to(tl.float32)
    return _round(tl.where(rm, y * c + yp * s, y), DT)


def supported(x: torch.Tensor, scale: torch.Tensor, cos: torch.Tensor) -> bool:
    """Shapes and layouts the kernel handles: (L, heads, d) with unit last stride, even r <= d."""
    r = cos.shape[-1]
    return (x.dim() == 3 and x.dtype in TL_DTYPES and x.stride(-1) == 1 and r % 2 == 0 and r <= x.shape[-1]
            and scale.dtype == torch.float32 and scale.is_contiguous() and cos.stride(-1) == 1)


def norm_rope(x: torch.Tensor, scale: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
              ) -> torch.Tensor:
    """apply_rope(rms_norm(x, scale, eps), cos, sin) in one launch. x (L, heads, d); cos/sin (L, r)."""
    L, heads, d = x.shape
    r = cos.shape[-1]
    out = torch.empty((L, heads, d), dtype=x.dtype, device=x.device)
    if L * heads == 0:
        return out
    if sin.stride(-1) != 1:
        sin = sin.contiguous()
    _norm_rope_kernel[(L * heads,)](x, scale, cos, sin, out, heads, x.stride(0), x.stride(1), cos.stride(0),
                                    sin.stride(0), eps, D=d, R=r, BD=triton.next_power_of_2(d),
                                    DT=TL_DTYPES[x.dtype], **pdl.launch(x.device))
    return out


def pair_supported(xs: Sequence[torch.Tensor], scales: Sequence[torch.Tensor], cos: torch.Tensor, *_) -> bool:
    """Two tensors `norm_rope` takes, of one dtype and one token count (the rows of the same positions)."""
    return (len(xs) == len(scales) == 2 and all(supported(x, s, cos) for x, s in zip(xs, scales))
            and xs[0].dtype == xs[1].dtype and xs[0].shape[0] == xs[1].shape[0])


def norm_ropes(xs: Sequence[torch.Tensor], scales: Sequence[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
               eps: float, norm_rope_op=None) -> list[torch.Tensor]:
    """`norm_rope` of two tensors at the same positions (a QSA layer's indexer and attention queries) in one
    launch: the twin of `strata.model.qsa.norm_ropes_ref` (`pair_supported` inputs; `norm_rope_op` unused). Each
    row is computed as `norm_rope` computes it, so the outputs are the same bits."""
    (x1, x2), (s1, s2) = xs, scales
    outs = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in xs]
    rows1, rows2 = x1.shape[0] * x1.shape[1], x2.shape[0] * x2.shape[1]
    if rows1 + rows2 == 0:
        return outs
    if sin.stride(-1) != 1:
        sin = sin.contiguous()
    _norm_rope_pair_kernel[(rows1 + rows2,)](
        x1, s1, outs[0], x1.shape[1], x1.stride(0), x1.stride(1), x2, s2, outs[1], x2.shape[1], x2.stride(0),
        x2.stride(1), rows1, cos, sin, cos.stride(0), sin.stride(0), eps, D1=x1.shape[2],
        BD1=triton.next_power_of_2(x1.shape[2]), D2=x2.shape[2], BD2=triton.next_power_of_2(x2.shape[2]),
        R=cos.shape[-1], DT=TL_DTYPES[x1.dtype], **pdl.launch(x1.device))
    return outs


@triton.jit
def _rope_kernel(pos_ptr, inv_ptr, out_ptr, L, C, R: tl.constexpr, RH: tl.constexpr, DT: tl.constexpr,
                 GDC: tl.constexpr = False):
    """Program (row, t): cos and sin of position row (t = 0) or of its block's first position (t = 1) into tables
    2t and 2t + 1 of out (4, L, R): fp32 angles pos * inv_freq, precise cos/sin, rounded once to DT."""
    pdl.started(GDC)
    pdl.wait(GDC)
    row = tl.program_id(0)
    t = tl.program_id(1)
    p = tl.load(pos_ptr + row)
    p = tl.where(t == 1, p // C * C, p)
    j = tl.arange(0, RH)
    jm = j < R // 2
    f = p.to(tl.float32) * tl.load(inv_ptr + j, mask=jm, other=0.0)
    c = _round(tl.cos(f), DT).to(DT)  # libdevice's cosf on CUDA, as torch's
    s = _round(tl.sin(f), DT).to(DT)
    cp = out_ptr + ((2 * t) * L + row) * R
    sp = cp + L * R
    tl.store(cp + j, c, mask=jm)
    tl.store(cp + R // 2 + j, c, mask=jm)
    tl.store(sp + j, s, mask=jm)
    tl.store(sp + R // 2 + j, s, mask=jm)


_INV_FREQ: dict[tuple[str, int, float], torch.Tensor] = {}


def _inv_freq(device: torch.device, cfg: ModelConfig) -> torch.Tensor:
    """`qsa.inv_freq`, made once per device and kept, so a captured step reads a fixed tensor instead of
    recomputing it (four small kernels)."""
    key = (str(device), cfg.rotary_dim, float(cfg.rope_theta))
    if key not in _INV_FREQ:
        _INV_FREQ[key] = inv_freq(cfg, device)
    return _INV_FREQ[key]


def rope_supported(positions: torch.Tensor, cfg: ModelConfig, dtype: torch.dtype) -> bool:
    return positions.dim() == 1 and dtype in TL_DTYPES and cfg.rotary_dim % 2 == 0 and positions.numel() > 0


def rope_at(positions: torch.Tensor, cfg: ModelConfig, dtype: torch.dtype) -> Rope:
    """The twin of `Rope.at` (the RoPE tables of a call's positions and of their blocks' first positions) in one
    launch; the reference spends ~14 small kernels on each pair of tables."""
    r = cfg.rotary_dim
    L = positions.shape[0]
    out = torch.empty(4, L, r, dtype=dtype, device=positions.device)
    _rope_kernel[(L, 2)](positions.contiguous(), _inv_freq(positions.device, cfg), out, L,
                         cfg.indexer_compress_ratio, R=r, RH=triton.next_power_of_2(max(1, r // 2)),
                         DT=TL_DTYPES[dtype], num_warps=1, **pdl.launch(positions.device))
    return Rope(out[0], out[1], out[2], out[3])
