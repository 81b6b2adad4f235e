"""Fused hyper-connection read for one token: the twin of `strata.model.hyper.hc_read_ref` for L == 1.

The read is two dependent GEMVs over S*H inputs (at the real geometry S*H = 10240: W_down (320, 10240) and
W_up (10240, 320), BF16, 6.5 MB each) with a grouped RMSNorm in front and a gated stream mean behind. It runs
~100 times per token. 6.5 MB is only about two bandwidth-latency products of an H200's memory (~4.8 TB/s x
~0.7 us), so a launch approaches the bandwidth floor only if every program issues all its weight loads at once,
early, and nothing is serialised behind them. Two launches:

1. `_hc_down_kernel`, grid (row blocks, S * K chunks per stream): program (b, c) loads one [BR, BK] tile of
   W_down (the last row blocks: W_inject) inside one stream s, 16-byte vectors along contiguous K, together with
   its inputs and norm scales and its stream's x (H values, L2-resident) for the stream's inverse RMS, and
   writes the fp32 dot products of its rows with the normalised chunk to `part[chunk, row]`. Splitting K is what
   gives the launch several hundred programs of 16-32 KB each while keeping rows per program high: every row
   block re-reads the chunk inputs and fp32 norm scales (6 bytes per input), so thin row blocks over all of K
   would read more of those than of weights.
2. `_hc_up_kernel`, grid (H / BH,): each program loads BH output features of all S streams ([S, BH, R] of
   W_up, R contiguous per row), sums the K-chunk partials of the down rows in a fixed order (every program
   needs all of m = SiLU(W_down xn / S) anyway; the sums come from L2), applies the roundings, and computes its
   S gate rows and the gated stream mean. The last program also reduces the inject rows' partials into
   iota = 2 sigma(. / S).

`hc_write_read` folds the preceding write x' = x + inject_prev * y into the same two launches (a separate
write launch costs ~1 us of graph gap plus ~1.5 us of runtime, ~96 times per token): the down programs form x'
from x, y and inject_prev wherever they read x (all inputs are L2-resident, 20 KB at the real geometry), the
row-block-0 programs store it, and the up kernel reads the stored x'.

Partial sums go through a buffer and are reduced in a fixed order, never with atomics, so the result does not
depend on scheduling and a CUDA-graph replay equals the eager call bit for bit. Nothing synchronises with the
host; the two scratch buffers come from the caching allocator (so graph capture keeps them).

Every intermediate is rounded to the model dtype where the reference rounds it (normalised state, each GEMV
output, the division by S, SiLU / sigmoid, the gated products, the mean), so bf16 results differ from the
reference only through fp32 accumulation order inside the GEMVs and the approximate transcendentals.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from strata.kernels import gemv_q8x, gemv_rr, pdl
from strata.kernels.attention import sm_count
from strata.kernels.gemv import tickets
from strata.kernels.gemv_rr import store_q8x_runs
from strata.weights.tensor import StoredTensor

TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
DENSE_KINDS = ("F32", "BF16", "F16")  # stored kinds `.dense` returns without dequantising
STATS_BLOCK = 2048  # x values per statistics load: bounds the registers the inverse-RMS pass holds


@triton.jit
def _hc_down_kernel(x_ptr, norm_ptr, down_ptr, inj_ptr, part_ptr, rstd_ptr, wi_ptr, y_ptr, xo_ptr, cnt_ptr, m_ptr,
                    iota_ptr, H, R, NI, RT, NRBD, eps,
                    S: tl.constexpr, KPS: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, HB: tl.constexpr,
                    NHB: tl.constexpr, DT: tl.constexpr, WRITE: tl.constexpr, TICKETS: tl.constexpr,
                    GDC: tl.constexpr = False, LATE: tl.constexpr = False):
    """part[pk, row] = sum over the chunk's k of W[row, k] * GN(x)[k] (fp32) for BR rows; rstd[s] by one
    program per stream. All global loads come first: the compiler does not move loads above the barriers of
    the reductions, so this is what puts the weight tile in flight together with the statistics.

    WRITE: the state read is x' = x + round(wi[s] * y) (the preceding block's write, rounded as
    `hc_write_ref`), formed on the fly from x, y and wi wherever x is read (the chunk and the statistics pass),
    so the write costs no launch; the row-block-0 programs, whose chunks tile x exactly once, store x' to xo
    for the up kernel (launched after this one) and the caller.

    TICKETS: the last of a row block's S*KPS programs to finish (a ticket from cnt[row block]) sums the block's
    partials in chunk order and stores the finished rows: m = SiLU(round(sum) / S) (fp32, to m) for down rows,
    iota = 2 sigma(round(sum) / S) for inject rows; so the up programs load m instead of each summing every
    partial again (640 x 25 KB of L2 reads per read at the real geometry). Same sums, same order: same bits. GDC (PDL): the weight tile and norm scales
    are loaded before the wait for the previous kernel, the state after (LATE: `pdl.LATE_RELEASE`)."""
    if not LATE:
        pdl.started(GDC)
    pr = tl.program_id(0)
    pk = tl.program_id(1)
    s = pk // KPS
    c = pk % KPS
    SH = S * H
    if pr < NRBD:
        r = pr * BR + tl.arange(0, BR)
        rm = r < R
        wrow = down_ptr + r * SH
        col = r
    else:
        r = (pr - NRBD) * BR + tl.arange(0, BR)
        rm = r < NI
        wrow = inj_ptr + r * SH
        col = R + r
    k = s * H + c * BK + tl.arange(0, BK)[None, :]  # [1, BK]: the weight tile's layout, no conversion
    km = k < (s + 1) * H
    w = tl.load(wrow[:, None] + k, mask=rm[:, None] & km, other=0.0)
    nv = tl.load(norm_ptr + k, mask=km, other=0.0)
    pdl.wait(GDC)
    if LATE:
        pdl.started(GDC)
    xv = tl.load(x_ptr + k, mask=km, other=0.0).to(tl.float32)
    if WRITE:
        wis = tl.load(wi_ptr + s).to(tl.float32)
        yv = tl.load(y_ptr + k - s * H, mask=km, other=0.0).to(tl.float32)
        xv = (xv + (wis * yv).to(DT).to(tl.float32)).to(DT).to(tl.float32)
    if KPS == 1:  # the chunk is the whole stream
        ss = tl.sum(tl.sum(xv * xv, axis=1), axis=0)
    else:  # the same instruction sequence in every program of stream s, so all agree on rstd[s]
        acc_ss = tl.zeros([HB], tl.float32)
        for t in tl.static_range(NHB):
            h = t * HB + tl.arange(0, HB)
            xs = tl.load(x_ptr + s * H + h, mask=h < H, other=0.0).to(tl.float32)
            if WRITE:
                ys = tl.load(y_ptr + h, mask=h < H, other=0.0).to(tl.float32)
                xs = (xs + (wis * ys).to(DT).to(tl.float32)).to(DT).to(tl.float32)
            acc_ss += xs * xs
        ss = tl.sum(acc_ss, axis=0)
    rs = tl.rsqrt(tl.math.div_rn(ss, H.to(tl.float32)) + eps)
    xn = (xv * rs * nv).to(DT).to(tl.float32)
    tl.store(part_ptr + pk * RT + col, tl.sum(w.to(tl.float32) * xn, axis=1), mask=rm)
    if (pr == 0) & (c == 0):
        tl.store(rstd_ptr + s, rs)
    if TICKETS:
        tl.debug_barrier()  # every thread's partial is written before the ticket is drawn
        if tl.atomic_add(cnt_ptr + pr, 1, sem="acq_rel", scope="gpu") == S * KPS - 1:
            p = tl.zeros([BR], tl.float32)
            for kc in tl.static_range(S * KPS):  # fixed order, as the up kernel's sum
                p += tl.load(part_ptr + kc * RT + col, mask=rm, other=0.0, cache_modifier=".cg")
            y = p.to(DT).to(tl.float32)
            y = tl.math.div_rn(y, S).to(DT).to(tl.float32)
            if pr < NRBD:
                tl.store(m_ptr + r, (y * tl.sigmoid(y)).to(DT).to(tl.float32), mask=rm)
            else:
                tl.store(iota_ptr + r, (2.0 * tl.sigmoid(y).to(DT).to(tl.float32)).to(DT), mask=rm)
            tl.atomic_xchg(cnt_ptr + pr, 0, sem="relaxed", scope="gpu")  # back to 0 for the next launch
    if WRITE:  # noqa: SIM102 - a compile-time branch around a run-time one
        if pr == 0:  # last: a store ahead of the statistics loads would keep them from being issued early
            tl.store(xo_ptr + k, xv.to(DT), mask=km)


@triton.jit
def _hc_up_kernel(x_ptr, norm_ptr, rstd_ptr, up_ptr, part_ptr, m_ptr, a_ptr, iota_ptr, xq_ptr, qcnt_ptr, H, R, NI,
                  RT, S: tl.constexpr, SP: tl.constexpr, NKC: tl.constexpr, BH: tl.constexpr, RC: tl.constexpr,
                  NRC: tl.constexpr, NIP: tl.constexpr, DT: tl.constexpr, TICKETS: tl.constexpr,
                  Q8: tl.constexpr = 0, GDC: tl.constexpr = False, LATE: tl.constexpr = False):
    """a[i] = mean_s GN(x)[s, i] * sigma((W_up m)[s*H + i]) for BH features i, m = SiLU((sum of the down
    partials) / S); the last program also writes iota = 2 sigma((sum of the inject partials) / S). The loads
    come first for the same reason as in the down kernel; the loop over NRC column chunks has no barrier, so
    the compiler may issue all chunks' loads together, but that is its choice (NRC = 1 leaves it none).
    GDC (PDL): the norm scales and the first column chunk of W_up are loaded before the wait for the down
    kernel, everything it wrote after. TICKETS: the down kernel finished m and iota (see there); m is loaded.
    LATE: `pdl.LATE_RELEASE`. Q8 (a word span of `gemv_q8x.ORDER`, 0: none): a is also stored as Q8 units
    (`gemv_rr.store_q8x_runs`) to xq, each run of 32 features by the last of its programs to draw a ticket from
    qcnt (BH < 32), or by its program (BH >= 32)."""
    if not LATE:
        pdl.started(GDC)
    pid = tl.program_id(0)
    ni = tl.where(pid == tl.num_programs(0) - 1, NI, 0)  # inject rows this program handles
    sv = tl.arange(0, SP)
    i = pid * BH + tl.arange(0, BH)
    fm = (sv[:, None] < S) & (i[None, :] < H)  # [SP, BH]
    row = sv[:, None] * H + i[None, :]
    nv = tl.load(norm_ptr + row, mask=fm, other=0.0)
    r0 = tl.arange(0, RC)
    w0 = tl.load(up_ptr + row[:, :, None] * R + r0[None, None, :], mask=fm[:, :, None] & (r0 < R)[None, None, :],
                 other=0.0)
    pdl.wait(GDC)
    if LATE:
        pdl.started(GDC)
    xv = tl.load(x_ptr + row, mask=fm, other=0.0).to(tl.float32)
    rs = tl.load(rstd_ptr + sv, mask=sv < S, other=0.0)
    if (NIP > 0) and not TICKETS:  # loaded (predicated) by every program, used by the last
        n = tl.arange(0, NIP)
        pi = tl.zeros([NIP], tl.float32)
        for kc in tl.static_range(NKC):
            pi += tl.load(part_ptr + kc * RT + R + n, mask=n < ni, other=0.0)
    acc = tl.zeros([SP, BH], tl.float32)
    for j in tl.static_range(NRC):
        r = j * RC + tl.arange(0, RC)
        rm = r < R
        if j == 0:
            w = w0
        else:
            w = tl.load(up_ptr + row[:, :, None] * R + r[None, None, :], mask=fm[:, :, None] & rm[None, None, :],
                        other=0.0)
        if TICKETS:
            mv = tl.load(m_ptr + r, mask=rm, other=0.0)
        else:
            p = tl.zeros([RC], tl.float32)
            for kc in tl.static_range(NKC):  # fixed order: the same sum in every program and every call
                p += tl.load(part_ptr + kc * RT + r, mask=rm, other=0.0)
            y = p.to(DT).to(tl.float32)
            y = tl.math.div_rn(y, S).to(DT).to(tl.float32)
            mv = (y * tl.sigmoid(y)).to(DT).to(tl.float32)
        acc += tl.sum(w.to(tl.float32) * mv[None, None, :], axis=2)
    gate = tl.sigmoid(acc.to(DT).to(tl.float32)).to(DT).to(tl.float32)
    xn = (xv * rs[:, None] * nv).to(DT).to(tl.float32)
    prod = tl.where(fm, (gate * xn).to(DT).to(tl.float32), 0.0)
    tl.store(a_ptr + i, tl.math.div_rn(tl.sum(prod, axis=0), S).to(DT), mask=i < H)
    if Q8 > 0:
        tl.debug_barrier()  # every thread's features are stored before the run is read back
        if BH < 32:
            run = pid // (32 // BH)
            if tl.atomic_add(qcnt_ptr + run, 1, sem="acq_rel", scope="gpu") == 32 // BH - 1:
                rr = run + tl.zeros([1, 1], tl.int32)
                store_q8x_runs(a_ptr, xq_ptr, rr, rr >= 0, Q8, 1, CG=True)
                tl.atomic_xchg(qcnt_ptr + run, 0, sem="relaxed", scope="gpu")  # back to 0 for the next launch
        else:
            rr = pid * (BH // 32) + tl.arange(0, BH // 32)[:, None]
            store_q8x_runs(a_ptr, xq_ptr, rr, rr < H // 32, Q8, BH // 32, CG=True)
    if (NIP > 0) and not TICKETS:
        yi = pi.to(DT).to(tl.float32)
        yi = tl.math.div_rn(yi, S).to(DT).to(tl.float32)
        yi = tl.sigmoid(yi).to(DT).to(tl.float32)
        tl.store(iota_ptr + n, (2.0 * yi).to(DT), mask=n < ni)


def supported(x: torch.Tensor, down: StoredTensor, up: StoredTensor, inject: StoredTensor | None) -> bool:
    """One token, a dtype the kernels know, and weights stored dense (quantized ones go to the reference,
    whose `linear` knows how to read them)."""
    return (x.shape[0] == 1 and x.dtype in TL_DTYPES and down.kind in DENSE_KINDS and up.kind in DENSE_KINDS
            and (inject is None or inject.kind in DENSE_KINDS))


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def hc_read_defaults(streams: int, hidden: int, rank: int, sms: int, block_h: int | None = None) -> dict:
    """The knob values `hc_read` uses when none are given (see `hc_read` for their meaning), and why; `block_h`
    fixes the up kernel's features per program and sizes its column tile for it.

    Down: 8 rows per program, then the widest K chunk (<= 1024) that still gives about three programs per SM, so
    every SM has ~50 KB of weights in flight from the start. The last program of each row block sums the block's
    partials (`finish_in_down`), so thin row blocks spread that tail over more programs; they re-read the
    inputs and fp32 norm scales more often (6 bytes per input per row block), which costs less. Up: about eight
    programs per SM; each holds its [S, BH, R] weights as one tile (R padded to a power of two: registers, not
    bytes) while that stays <= 16K elements, so that all of it is in flight at once. 4 warps each.
    Measured on an H200 by tools/gpu_check_fused.py (the sweep of `hc_read_configs`, one session): 7.6 us per
    read against 9.7 with 16 rows, K chunks of 512 and four up programs per SM, 8.1-8.4
    with 8 rows and four up programs per SM, 8.8 with 16 rows and eight.
    At the real geometry (S=4, H=2560, R=320, 132 SMs): 41 x 12 down programs of [8, 1024] (16 KB), 1280 up
    programs of [4, 2, 512 (320 used)] (5 KB)."""
    S, H, R = streams, hidden, rank
    br = min(8, triton.next_power_of_2(R))
    nrb = triton.cdiv(R, br) + triton.cdiv(S, br)
    bk = min(1024, triton.next_power_of_2(H))
    while bk > 64 and nrb * S * triton.cdiv(H, bk) < 3 * sms:
        bk //= 2
    bh = block_h or max(1, min(64, _pow2_floor(H // max(1, 8 * sms))))
    rc = min(triton.next_power_of_2(R), max(16, _pow2_floor(16384 // (triton.next_power_of_2(S) * bh))))
    return {"block_rows": br, "block_k": bk, "block_h": bh, "block_r": rc, "warps_down": 4, "warps_up": 4}


def hc_read_configs(streams: int, hidden: int, rank: int, sms: int) -> list[dict]:
    """A handful of knob settings worth sweeping on the GPU (each a dict of `hc_read` keyword arguments), the
    default first. They trade the K split against the row block (fewer partial rows for every up program to
    reduce versus more re-reads of the inputs by the down programs), and the up program size (SM balance
    versus partial-sum reads per weight byte)."""
    S, H, R = streams, hidden, rank
    d = hc_read_defaults(S, H, R, sms)
    h2 = triton.next_power_of_2(H)
    rp = triton.next_power_of_2(R)
    out = [d]
    for kw in ({"block_rows": 16, "block_k": min(512, h2), "block_h": 2 * d["block_h"]},  # four up programs per SM
               {"block_rows": 8, "block_k": min(1024, h2)},  # 12 partial rows at the real geometry
               {"block_rows": 8, "block_k": min(2048, h2), "warps_down": 8},  # 8
               {"block_rows": 4, "block_k": h2, "warps_down": 8},  # one chunk per stream: 4, no statistics pass
               {"block_rows": 32, "block_k": min(256, h2)},
               {"block_h": 2 * d["block_h"], "block_r": rp, "warps_up": 8},
               {"block_h": max(1, d["block_h"] // 2)},
               {"block_r": max(16, min(64, rp))},  # R = 320: five unpadded column chunks
               {"block_rows": 8, "block_k": min(1024, h2), "block_h": 2 * d["block_h"], "block_r": rp, "warps_up": 8},
               {"warps_down": 8, "warps_up": 8},
               {"block_rows": 8, "block_k": min(1024, h2), "block_h": max(1, d["block_h"] // 2)},
               {"block_rows": 4, "block_k": min(1024, h2)},  # more, shorter finishing programs
               {"block_rows": 8, "block_k": min(512, h2)},
               {"block_rows": 4, "block_k": min(2048, h2), "warps_down": 8},
               {"finish_in_down": False}):  # every up program sums the partials
        c = dict(d, **kw)
        if c not in out:
            out.append(c)
    return out


def hc_read(x: torch.Tensor, norm: torch.Tensor, down: StoredTensor, up: StoredTensor,
            inject: StoredTensor | None, streams: int, eps: float, block_rows: int | None = None,
            block_h: int | None = None, *, block_k: int | None = None, block_r: int | None = None,
            warps_down: int | None = None, warps_up: int | None = None, finish_in_down: bool = True,
            q8_span: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Block input a (1, H) and injection weights (1, S) (None without `inject`) from the state x (1, S*H).

    Tuning knobs, powers of two (None: `hc_read_defaults`, from the SM count and the shapes): `block_rows`
    W_down / W_inject rows per down program; `block_k` inputs of one stream per down program (>= H: one chunk
    per stream); `block_h` output features per up program (times S weight rows); `block_r` W_up columns per up
    tile (< R: several chunks, less padding of R, more load instructions); `warps_down`, `warps_up` warps per
    program; `finish_in_down` (default): the down kernel's last program of each row block sums its partials
    (split-K tickets, `gemv.tickets`; False, or no counters left: every up program sums them).

    q8_span (a word span of `gemv_q8x.ORDER`): the up kernel also writes a as Q8 activations for words of that
    span and records them (`gemv_rr.record_q8x`), so the Q8 GEMVs that read a (`--activations q8`) need no
    quantize launch; where the shapes or the ticket counters do not allow it, nothing is recorded and they
    quantize a themselves."""
    _, a, iota = _launch(x, None, norm, down, up, inject, streams, eps, block_rows, block_h, block_k, block_r,
                         warps_down, warps_up, finish_in_down, q8_span)
    return a, iota


def hc_write_read(x: torch.Tensor, inject_prev: torch.Tensor, y: torch.Tensor, norm: torch.Tensor,
                  down: StoredTensor, up: StoredTensor, inject: StoredTensor | None, streams: int, eps: float,
                  block_rows: int | None = None, block_h: int | None = None, *, block_k: int | None = None,
                  block_r: int | None = None, warps_down: int | None = None, warps_up: int | None = None,
                  finish_in_down: bool = True, q8_span: int | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The write x' = x + inject_prev (1, S) x y (1, H) folded into the read of x', in the read's two launches
    (the twin of `strata.model.hyper.hc_write_read_ref`): (x' (1, S*H), a, injection weights | None). The
    down programs form x' where they read x; the up kernel reads the x' they stored. Knobs and q8_span as
    `hc_read`."""
    return _launch(x, (inject_prev, y), norm, down, up, inject, streams, eps, block_rows, block_h, block_k,
                   block_r, warps_down, warps_up, finish_in_down, q8_span)


def _q8_counters(dev: torch.device, span: int | None, hidden: int, block_h: int) -> torch.Tensor | None:
    """The ticket counters the up kernel's Q8 units need (any tensor where its programs need none), or None when
    it writes no units: none asked for, a hidden size the units do not tile, or no counters left."""
    if span is None or hidden % gemv_q8x.UNIT_VALUES or (block_h > 32 and hidden % block_h):
        return None
    if block_h >= 32:
        return torch.empty(1, dtype=torch.int32, device=dev)
    cnt = tickets(dev)
    return cnt if cnt is not None and cnt.numel() >= hidden // 32 else None


def _launch(x, write, norm, down, up, inject, streams, eps, block_rows, block_h, block_k, block_r, warps_down,
            warps_up, finish_in_down=True, q8_span=None):
    """Both launches of the read, of x (write None) or of x + round(inject_prev * y) (write = (inject_prev,
    y)): (x' or None, a, iota or None)."""
    dt, dev = x.dtype, x.device
    S = streams
    SH = x.shape[-1]
    H = SH // S
    wd = down.dense(dt, dev).contiguous()
    wu = up.dense(dt, dev).contiguous()
    R = wd.shape[0]
    ni = inject.shape[0] if inject is not None else 0
    wi = inject.dense(dt, dev).contiguous() if inject is not None else wd
    d = hc_read_defaults(S, H, R, sm_count(dev))
    br = block_rows or d["block_rows"]
    bk = min(block_k or d["block_k"], triton.next_power_of_2(H))
    bh = block_h or d["block_h"]
    rc = min(block_r or d["block_r"], triton.next_power_of_2(R))
    x = x.contiguous()
    norm = norm.float().contiguous()
    if write is not None:
        inj_prev, y = write[0].contiguous(), write[1].contiguous()
        x_new = torch.empty_like(x)
    else:
        inj_prev, y, x_new = x, x, x  # unused (WRITE=False): any pointer
    kps = triton.cdiv(H, bk)  # K chunks per stream
    nkc = S * kps
    rt = triton.cdiv(R + ni, 16) * 16  # partial rows padded so that each starts 64-byte aligned
    nrbd = triton.cdiv(R, br)
    part = torch.empty(nkc, rt, dtype=torch.float32, device=dev)
    rstd = torch.empty(S, dtype=torch.float32, device=dev)
    hb = min(STATS_BLOCK, triton.next_power_of_2(H))
    row_blocks = nrbd + triton.cdiv(ni, br)
    cnt = tickets(dev) if finish_in_down else None
    if cnt is not None and row_blocks > cnt.numel():
        cnt = None
    m = torch.empty(R, dtype=torch.float32, device=dev)
    a = torch.empty(1, H, dtype=dt, device=dev)
    iota = torch.empty(1, max(ni, 1), dtype=dt, device=dev)
    qcnt = _q8_counters(dev, q8_span, H, bh)
    xq = torch.empty(1, gemv_q8x.row_bytes(H), dtype=torch.int8, device=dev) if qcnt is not None else None
    _hc_down_kernel[(row_blocks, nkc)](
        x, norm, wd, wi, part, rstd, inj_prev, y, x_new, cnt if cnt is not None else rstd, m, iota,
        H, R, ni, rt, nrbd, eps,
        S=S, KPS=kps, BR=br, BK=bk, HB=hb, NHB=triton.cdiv(H, hb), DT=TL_DTYPES[dt], WRITE=write is not None,
        TICKETS=cnt is not None, num_warps=warps_down or d["warps_down"], **pdl.launch(dev, "hc_down"))
    _hc_up_kernel[(triton.cdiv(H, bh),)](
        x_new, norm, rstd, wu, part, m, a, iota, xq if xq is not None else m, qcnt if qcnt is not None else rstd,
        H, R, ni, rt, S=S, SP=triton.next_power_of_2(S), NKC=nkc, BH=bh, RC=rc, NRC=triton.cdiv(R, rc),
        NIP=triton.next_power_of_2(ni) if ni else 0, DT=TL_DTYPES[dt], TICKETS=cnt is not None,
        Q8=q8_span if xq is not None else 0, num_warps=warps_up or d["warps_up"], **pdl.launch(dev, "hc_up"))
    if xq is not None:
        gemv_rr.record_q8x(a, xq, q8_span)
    return (x_new if write is not None else None), a, (iota if inject is not None else None)
