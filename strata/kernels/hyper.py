"""Fused hyper-connection read for one token: the twin of `strata.model.hyper.hc_read_ref` for L == 1.

The read is two dependent GEMVs over S*H = 10240 inputs at the real geometry (down (320, 10240) and up
(10240, 320), BF16, 6.5 MB each) with a grouped RMSNorm in front and a gated stream mean behind; it runs 80
times per token, so its cost is the weight bytes. The reference materialises the normalised state and three
GEMV outputs and launches ~15 kernels; here there are two launches:

1. `_hc_down_kernel`: every program recomputes the per-stream RMS statistics of x (20 KB, L2-resident),
   then streams BR rows of W_down (or, for the last programs, of W_inject) against the normalised state
   built on the fly, and applies SiLU(. / S) (or 2 sigma(. / S)). Program 0 also writes the S inverse RMS
   values so the second launch need not recompute them.
2. `_hc_up_kernel`: each program takes BH output features, computes their S gate rows sigma(W_up m) and the
   gated mean over streams of the normalised state.

Every intermediate is rounded to the model dtype where the reference rounds it (normalised state, each GEMV
output, the division by S, SiLU / sigmoid, the gated products, the mean), so bf16 results differ from the
reference only through fp32 accumulation order inside the GEMVs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from strata.kernels.attention import sm_count
from strata.weights.tensor import StoredTensor

TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
DENSE_KINDS = ("F32", "BF16", "F16")  # stored kinds `.dense` returns without dequantising


@triton.jit
def _rows_dot_normed(x_ptr, norm_ptr, w_ptr, row0, NROWS, H, eps,
                     S: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr):
    """sum_k W[row0 + r, k] * GN(x)[k] for BR rows, with GN's statistics computed here; fp32 (BR,)."""
    r = row0 + tl.arange(0, BR)
    rm = r < NROWS
    SH = S * H
    acc = tl.zeros([BR, BK], tl.float32)
    for s in tl.static_range(S):
        ss = tl.zeros([BK], tl.float32)
        for k0 in range(0, H, BK):
            k = k0 + tl.arange(0, BK)
            xv = tl.load(x_ptr + s * H + k, mask=k < H, other=0.0).to(tl.float32)
            ss += xv * xv
        rs = tl.rsqrt(tl.sum(ss, axis=0) / H + eps)
        for k0 in range(0, H, BK):
            k = k0 + tl.arange(0, BK)
            km = k < H
            xv = tl.load(x_ptr + s * H + k, mask=km, other=0.0).to(tl.float32)
            nv = tl.load(norm_ptr + s * H + k, mask=km, other=0.0)
            xn = (xv * rs * nv).to(DT).to(tl.float32)
            w = tl.load(w_ptr + r[:, None] * SH + s * H + k[None, :], mask=rm[:, None] & km[None, :], other=0.0)
            acc += w.to(tl.float32) * xn[None, :]
    return tl.sum(acc, axis=1)


@triton.jit
def _hc_down_kernel(x_ptr, norm_ptr, down_ptr, inj_ptr, m_ptr, iota_ptr, rstd_ptr, H, R, eps, NRB,
                    S: tl.constexpr, NI: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr):
    pid = tl.program_id(0)
    if pid < NRB:
        row0 = pid * BR
        y = _rows_dot_normed(x_ptr, norm_ptr, down_ptr, row0, R, H, eps, S, BR, BK, DT).to(DT).to(tl.float32)
        y = (y / S).to(DT).to(tl.float32)
        r = row0 + tl.arange(0, BR)
        tl.store(m_ptr + r, (y * tl.sigmoid(y)).to(DT), mask=r < R)
    else:
        row0 = (pid - NRB) * BR
        y = _rows_dot_normed(x_ptr, norm_ptr, inj_ptr, row0, NI, H, eps, S, BR, BK, DT).to(DT).to(tl.float32)
        y = (y / S).to(DT).to(tl.float32)
        y = tl.sigmoid(y).to(DT).to(tl.float32)
        r = row0 + tl.arange(0, BR)
        tl.store(iota_ptr + r, (2.0 * y).to(DT), mask=r < NI)
    if pid == 0:
        for s in tl.static_range(S):
            ss = tl.zeros([BK], tl.float32)
            for k0 in range(0, H, BK):
                k = k0 + tl.arange(0, BK)
                xv = tl.load(x_ptr + s * H + k, mask=k < H, other=0.0).to(tl.float32)
                ss += xv * xv
            tl.store(rstd_ptr + s, tl.rsqrt(tl.sum(ss, axis=0) / H + eps))


@triton.jit
def _hc_up_kernel(x_ptr, norm_ptr, rstd_ptr, up_ptr, m_ptr, a_ptr, H, R,
                  S: tl.constexpr, BH: tl.constexpr, BRK: tl.constexpr, DT: tl.constexpr):
    i = tl.program_id(0) * BH + tl.arange(0, BH)
    im = i < H
    tot = tl.zeros([BH], tl.float32)
    for s in tl.static_range(S):
        rows = s * H + i
        acc = tl.zeros([BH, BRK], tl.float32)
        for r0 in range(0, R, BRK):
            r = r0 + tl.arange(0, BRK)
            rm = r < R
            mv = tl.load(m_ptr + r, mask=rm, other=0.0).to(tl.float32)
            w = tl.load(up_ptr + rows[:, None] * R + r[None, :], mask=im[:, None] & rm[None, :], other=0.0)
            acc += w.to(tl.float32) * mv[None, :]
        gl = tl.sum(acc, axis=1).to(DT).to(tl.float32)
        gate = tl.sigmoid(gl).to(DT).to(tl.float32)
        xv = tl.load(x_ptr + rows, mask=im, other=0.0).to(tl.float32)
        nv = tl.load(norm_ptr + rows, mask=im, other=0.0)
        xn = (xv * tl.load(rstd_ptr + s) * nv).to(DT).to(tl.float32)
        tot += (gate * xn).to(DT).to(tl.float32)
    tl.store(a_ptr + i, (tot / S).to(DT), mask=im)


def supported(x: torch.Tensor, down: StoredTensor, up: StoredTensor, inject: StoredTensor | None) -> bool:
    """One token, a dtype the kernels know, and weights stored dense (quantized ones go to the reference,
    whose `linear` knows how to read them)."""
    return (x.shape[0] == 1 and x.dtype in TL_DTYPES and down.kind in DENSE_KINDS and up.kind in DENSE_KINDS
            and (inject is None or inject.kind in DENSE_KINDS))


def hc_read(x: torch.Tensor, norm: torch.Tensor, down: StoredTensor, up: StoredTensor,
            inject: StoredTensor | None, streams: int, eps: float, block_rows: int | None = None,
            block_h: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Block input a (1, H) and injection weights (1, S) (None without `inject`) from the state x (1, S*H).
    `block_rows` (W_down rows per program) and `block_h` (outputs per program of the second launch) are
    tuning knobs; by default each launch gets about two programs per SM (2 rows and 16 outputs at the real
    geometry on an H200)."""
    dt, dev = x.dtype, x.device
    S = streams
    SH = x.shape[-1]
    H = SH // S
    wd = down.dense(dt, dev).contiguous()
    wu = up.dense(dt, dev).contiguous()
    R = wd.shape[0]
    sms = sm_count(dev)
    if block_rows is None:
        block_rows = min(16, triton.next_power_of_2(triton.cdiv(R, 2 * sms)))
    if block_h is None:
        block_h = min(128, max(16, triton.next_power_of_2(triton.cdiv(H, 2 * sms))))
    ni = inject.shape[0] if inject is not None else 0
    wi = inject.dense(dt, dev).contiguous() if inject is not None else wd
    x = x.contiguous()
    norm = norm.float().contiguous()
    m = torch.empty(R, dtype=dt, device=dev)
    iota = torch.empty(1, max(ni, 1), dtype=dt, device=dev)
    rstd = torch.empty(S, dtype=torch.float32, device=dev)
    nrb = triton.cdiv(R, block_rows)
    bk = min(1024, triton.next_power_of_2(H))
    _hc_down_kernel[(nrb + triton.cdiv(ni, block_rows),)](
        x, norm, wd, wi, m, iota, rstd, H, R, eps, nrb,
        S=S, NI=ni, BR=block_rows, BK=bk, DT=TL_DTYPES[dt])
    a = torch.empty(1, H, dtype=dt, device=dev)
    _hc_up_kernel[(triton.cdiv(H, block_h),)](
        x, norm, rstd, wu, m, a, H, R,
        S=S, BH=block_h, BRK=min(128, triton.next_power_of_2(R)), DT=TL_DTYPES[dt])
    return a, (iota if inject is not None else None)
