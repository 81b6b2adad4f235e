"""Decode attention over selected cache rows, and the indexer's block scores: the twins of
`strata.model.attention.attend_ref` and of the scoring half of `strata.model.qsa.select_tokens`.

Attention (`attend`). At the real geometry a query attends to up to B + c - 1 = 2051 cache rows of 2 KV heads
x 256 dims: ~4 MiB of K/V gathered by index per layer, so the op is a memory-bound gather. The reference
materialises the gathered rows (and repeats them per GQA group); here each program reads its K/V rows straight
from `state.k` / `state.v` by index, once for all the query heads of its KV head (the GQA group is the M
dimension of the dot), with an online softmax in fp32 (flash-decoding). The key axis is split across programs
so that L x Hkv x splits fills the GPU; a second small launch merges the splits' (max, sum, partial output).
With a single split the first launch normalises and writes the output itself. The split count depends only on
shapes, never on data, so it is capturable. The dots run on the tensor cores in the model dtype (fp32 "ieee" for
fp32); off CUDA, where Triton's interpreter runs them and its dot mishandles bf16, tiles are upcast to fp32
after the same roundings.

Indexer scores (`block_scores`). At 128K context there are 32K pooled block keys (8 MiB in bf16). The
reference scores every block of the capacity-sized buffer and masks afterwards; the kernel masks the *loads*
by the query's visible block count (read from device memory), so it reads only the blocks that exist yet and
costs O(context), not O(capacity). The top-k and the token expansion are one more launch for up to
SELECT_KERNEL_MAX_BLOCKS candidates (`strata.kernels.select`: for a few queries the blocks' ranks counted by many
programs, blocks listed by rank; else a one-program radix select, blocks listed in block order; ties at the k-th
score to the lowest block index), the many-program radix select or torch.topk and the reference's expansion
beyond, so the selected set
agrees with `select_tokens` whenever the k-th block's margin exceeds fp32 accumulation-order rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from strata.config import ModelConfig
from strata.kernels import gemv_q8x, gemv_rr, pdl
from strata.kernels.gemv_rr import store_q8x_runs
from strata.kernels.select import (expand_blocks, select_blocks, select_blocks_ranked, select_blocks_wide,
                                  wide_supported)
from strata.model import topk
from strata.runtime.state import QSAState

TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

MAX_L = 16  # longest call the kernel takes: its split scratch grows as L x Hq x splits x hd fp32


@triton.jit
def _attn_split_kernel(q_ptr, k_ptr, v_ptr, idx_ptr, ok_ptr, out_ptr, m_ptr, l_ptr, acc_ptr, gate_ptr,
                       HQ, HD, W, CAP, G, SPLIT, NS,
                       s_ql, s_qh, s_kr, s_kh, s_vr, s_vh, s_il, s_ol, s_outl, s_gl, s_gh, scale,
                       GP: tl.constexpr, HDP: tl.constexpr, BW: tl.constexpr, SINGLE: tl.constexpr,
                       IEEE: tl.constexpr, UPCAST: tl.constexpr, DT: tl.constexpr, GATE: tl.constexpr,
                       GDC: tl.constexpr = False):
    pdl.started(GDC)
    pdl.wait(GDC)
    l = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    g = tl.arange(0, GP)
    gm = g < G
    heads = kvh * G + g
    d = tl.arange(0, HDP)
    dm = d < HD
    q = tl.load(q_ptr + l * s_ql + heads[:, None] * s_qh + d[None, :], mask=gm[:, None] & dm[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, HDP], tl.float32)
    start = sp * SPLIT
    for w0 in range(start, start + SPLIT, BW):
        w = w0 + tl.arange(0, BW)
        wm = w < W
        rows = tl.load(idx_ptr + l * s_il + w, mask=wm, other=0)
        rows = tl.minimum(tl.maximum(rows, 0), CAP - 1)
        valid = (tl.load(ok_ptr + l * s_ol + w, mask=wm, other=0) != 0) & wm
        lm = valid[:, None] & dm[None, :]
        kt = tl.load(k_ptr + rows[:, None] * s_kr + kvh * s_kh + d[None, :], mask=lm, other=0.0)
        vt = tl.load(v_ptr + rows[:, None] * s_vr + kvh * s_vh + d[None, :], mask=lm, other=0.0)  # with K's
        if UPCAST:
            kt = kt.to(tl.float32)
        if IEEE:
            sc = tl.dot(q, tl.trans(kt), input_precision="ieee")
        else:
            sc = tl.dot(q, tl.trans(kt))
        sc = tl.where(valid[None, :], sc * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        corr = tl.exp(m_i - m_safe)
        p = tl.exp(sc - m_safe[:, None])
        l_i = l_i * corr + tl.sum(p, axis=1)
        if UPCAST:
            pv = tl.dot(p.to(DT).to(tl.float32), vt.to(tl.float32), input_precision="ieee")
        elif IEEE:
            pv = tl.dot(p, vt, input_precision="ieee")
        else:
            pv = tl.dot(p.to(vt.dtype), vt)
        acc = acc * corr[:, None] + pv
        m_i = m_new
    if SINGLE:
        o = acc / l_i[:, None]
        om = gm[:, None] & dm[None, :]
        if GATE:
            o = _gated(o, gate_ptr + l * s_gl + heads[:, None] * s_gh + d[None, :], om, DT)
        tl.store(out_ptr + l * s_outl + heads[:, None] * HD + d[None, :], o.to(DT), mask=om)
    else:
        base = (l * HQ + heads) * NS + sp
        tl.store(m_ptr + base, m_i, mask=gm)
        tl.store(l_ptr + base, l_i, mask=gm)
        tl.store(acc_ptr + base[:, None] * HD + d[None, :], acc, mask=gm[:, None] & dm[None, :])


@triton.jit
def _gated(o, g_ptrs, mask, DT: tl.constexpr):
    """o * sigmoid(gate) as the model computes it in DT: the attention output and the sigmoid each rounded to
    DT, their product rounded at the store."""
    g = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
    return o.to(DT).to(tl.float32) * tl.sigmoid(g).to(DT).to(tl.float32)


@triton.jit
def _attn_merge_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, gate_ptr, xq_ptr, HQ, HD, NS, s_outl, s_gl, s_gh, s_xql,
                       BS: tl.constexpr, BD: tl.constexpr, ONE_PASS: tl.constexpr, DT: tl.constexpr,
                       GATE: tl.constexpr, Q8: tl.constexpr = 0, GDC: tl.constexpr = False):
    """out[l, h, BD dims] from the NS splits' (max, sum, partial output) of head h. ONE_PASS (NS <= BS): every
    split's max, sum and partial dims loaded at once, one dependent round trip; else BS splits at a time after
    a first pass for the max (a (splits x dims) tile would not fit in registers). Q8 (a word span of
    `gemv_rr.Q8X_ORDER`, 0: none; BD a multiple of 32 dividing HD): the program also stores its dims as Q8 units
    to xq (`gemv_rr.store_q8x_runs`), for the o projection's Q8 GEMV."""
    pdl.started(GDC)
    pdl.wait(GDC)
    l = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.program_id(2) * BD + tl.arange(0, BD)
    dm = d < HD
    base = (l * HQ + h) * NS
    sb = tl.arange(0, BS)
    if ONE_PASS:
        sm = sb < NS
        m = tl.load(m_ptr + base + sb, mask=sm, other=float("-inf"))
        lsum = tl.load(l_ptr + base + sb, mask=sm, other=0.0)
        acc = tl.load(acc_ptr + (base + sb)[:, None] * HD + d[None, :], mask=sm[:, None] & dm[None, :], other=0.0)
        mx = tl.max(m, axis=0)
        mx = tl.where(mx == float("-inf"), 0.0, mx)
        wgt = tl.exp(m - mx)
        o = tl.sum(acc * wgt[:, None], axis=0) / tl.sum(wgt * lsum, axis=0)
    else:
        mx = tl.full([BS], float("-inf"), tl.float32)
        for s0 in range(0, NS, BS):
            mx = tl.maximum(mx, tl.load(m_ptr + base + s0 + sb, mask=s0 + sb < NS, other=float("-inf")))
        mx = tl.max(mx, axis=0)
        mx = tl.where(mx == float("-inf"), 0.0, mx)
        o = tl.zeros([BD], tl.float32)
        den = tl.zeros([BS], tl.float32)
        for s0 in range(0, NS, BS):
            sm = s0 + sb < NS
            wgt = tl.exp(tl.load(m_ptr + base + s0 + sb, mask=sm, other=float("-inf")) - mx)
            den += wgt * tl.load(l_ptr + base + s0 + sb, mask=sm, other=0.0)
            acc = tl.load(acc_ptr + (base + s0 + sb)[:, None] * HD + d[None, :], mask=sm[:, None] & dm[None, :],
                          other=0.0)
            o += tl.sum(acc * wgt[:, None], axis=0)
        o = o / tl.sum(den, axis=0)
    if GATE:
        o = _gated(o, gate_ptr + l * s_gl + h * s_gh + d, dm, DT)
    tl.store(out_ptr + l * s_outl + h * HD + d, o.to(DT), mask=dm)
    if Q8 > 0:
        tl.debug_barrier()  # every thread's dims are stored before they are read back
        rr = (h * HD + tl.program_id(2) * BD) // 32 + tl.arange(0, BD // 32)[:, None]
        store_q8x_runs(out_ptr + l * s_outl, xq_ptr + l * s_xql, rr, rr >= 0, Q8, BD // 32, CG=True)


MERGE_TILE = 8192
"""Elements (splits x dims) of one merge program's tile: the splits of a decode row at the real geometry (65)
with 64 of a head's 256 dims, loaded in one round trip (4 programs per head)."""


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors to fill; 1 off CUDA, where the kernels run in the interpreter and every extra
    program only costs time."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def attend_supported(q: torch.Tensor, state: QSAState) -> bool:
    """Calls the kernel takes: few queries, a known dtype, K/V rows with a unit inner stride."""
    return (q.shape[0] <= MAX_L and q.dtype in TL_DTYPES and state.k.dtype == q.dtype
            and state.k.stride(-1) == 1 and state.v.stride(-1) == 1)


def attend(q: torch.Tensor, state: QSAState, idx: torch.Tensor, ok: torch.Tensor, cfg: ModelConfig,
           gate: torch.Tensor | None = None, split: int | None = None, block_w: int = 32,
           merge_tile: int = MERGE_TILE, q8_span: int | None = None) -> torch.Tensor:
    """Softmax attention of q (L, Hq, hd) over cache rows `idx` (L, W) where `ok`, times sigmoid(gate (L, Hq,
    hd)) when given (applied at the store); (L, Hq*hd) in q's dtype. `split` is the number of keys per program
    (a multiple of `block_w`; None picks one that fills the GPU); `merge_tile` the merge programs' tile
    (`MERGE_TILE`, a power of two). q8_span (a word span of `gemv_rr.Q8X_ORDER`): where the splits are merged
    in whole runs of 32 dims, the merge also writes the output as Q8 activations for words of that span and
    records them (`gemv_rr.record_q8x`) for the o projection's Q8 GEMV (`--activations q8`)."""
    L, hq, hd = q.shape
    hkv = cfg.num_key_value_heads
    G = hq // hkv
    W = idx.shape[1]
    dev = q.device
    q = q if q.stride(-1) == 1 else q.contiguous()
    idx = idx.contiguous()
    okb = ok.contiguous().view(torch.uint8)
    if split is None:
        want = max(1, triton.cdiv(2 * sm_count(dev), L * hkv))  # programs per (query, KV head)
        split = triton.cdiv(triton.cdiv(W, want), block_w) * block_w
    split = max(block_w, triton.cdiv(split, block_w) * block_w)
    ns = triton.cdiv(W, split)
    out = torch.empty(L, hq * hd, dtype=q.dtype, device=dev)
    single = ns == 1
    if single:
        m = lsum = acc = out  # unused by the kernel
    else:
        m = torch.empty(L * hq * ns, dtype=torch.float32, device=dev)
        lsum = torch.empty_like(m)
        acc = torch.empty(L * hq * ns * hd, dtype=torch.float32, device=dev)
    HDP = max(16, triton.next_power_of_2(hd))
    if gate is not None and (gate.shape != q.shape or gate.stride(-1) != 1):
        gate = gate.reshape(q.shape).contiguous()
    g = gate if gate is not None else q
    _attn_split_kernel[(L, hkv, ns)](
        q, state.k, state.v, idx, okb, out, m, lsum, acc, g,
        hq, hd, W, state.capacity, G, split, ns,
        q.stride(0), q.stride(1), state.k.stride(0), state.k.stride(1), state.v.stride(0), state.v.stride(1),
        idx.stride(0), okb.stride(0), out.stride(0), g.stride(0), g.stride(1), hd ** -0.5,
        GP=max(16, triton.next_power_of_2(G)), HDP=HDP, BW=block_w, SINGLE=single,
        IEEE=q.dtype == torch.float32 or not q.is_cuda, UPCAST=not q.is_cuda, DT=TL_DTYPES[q.dtype],
        GATE=gate is not None, **pdl.launch(dev))
    if not single:
        nsp = triton.next_power_of_2(ns)
        bd = max(16, min(HDP, merge_tile // nsp))
        bs = min(nsp, max(1, merge_tile // bd))
        emit = q8_span is not None and bd % 32 == 0 and hd % bd == 0 and hq * hd % gemv_q8x.UNIT_VALUES == 0
        xq = torch.empty(L, gemv_q8x.row_bytes(hq * hd), dtype=torch.int8, device=dev) if emit else out
        _attn_merge_kernel[(L, hq, triton.cdiv(hd, bd))](
            m, lsum, acc, out, g, xq, hq, hd, ns, out.stride(0), g.stride(0), g.stride(1), xq.stride(0), BS=bs,
            BD=bd, ONE_PASS=bs >= ns, DT=TL_DTYPES[q.dtype], GATE=gate is not None, Q8=q8_span if emit else 0,
            **pdl.launch(dev))
        if emit:
            gemv_rr.record_q8x(out, xq, q8_span)
    return out


@triton.jit
def _block_scores_kernel(q_ptr, blk_ptr, pos_ptr, out_ptr, NB, DI, C, s_ql, s_qh, s_b, s_ol, inv_sqrt,
                         HI: tl.constexpr, DP: tl.constexpr, BM: tl.constexpr, GDC: tl.constexpr = False):
    pdl.started(GDC)
    pdl.wait(GDC)
    l = tl.program_id(0)
    mb = tl.program_id(1)
    nbq = (tl.load(pos_ptr + l) + 1) // C  # complete blocks this query may see
    m = mb * BM + tl.arange(0, BM)
    vis = (m < nbq) & (m < NB)
    d = tl.arange(0, DP)
    dm = d < DI
    blk = tl.load(blk_ptr + m[:, None] * s_b + d[None, :], mask=vis[:, None] & dm[None, :], other=0.0)
    blk = blk.to(tl.float32)
    acc = tl.zeros([BM], tl.float32)
    for h in tl.static_range(HI):
        qh = tl.load(q_ptr + l * s_ql + h * s_qh + d, mask=dm, other=0.0).to(tl.float32)
        acc += tl.maximum(tl.sum(blk * qh[None, :], axis=1), 0.0)
    acc = tl.where(vis, acc * inv_sqrt, float("-inf"))
    tl.store(out_ptr + l * s_ol + m, acc, mask=m < NB)


def block_scores(q_idx: torch.Tensor, blocks: torch.Tensor, positions: torch.Tensor, cfg: ModelConfig,
                 block_m: int = 64) -> torch.Tensor:
    """Indexer scores (L, nb) fp32: sum over indexer heads of ReLU(q . k_block) / sqrt(Di), -inf for blocks
    the query cannot see yet (only visible blocks are read)."""
    L, hi, di = q_idx.shape
    nb = blocks.shape[0]
    q_idx = q_idx if q_idx.stride(-1) == 1 else q_idx.contiguous()
    blocks = blocks if blocks.stride(-1) == 1 else blocks.contiguous()
    positions = positions.contiguous()
    out = torch.empty(L, nb, dtype=torch.float32, device=q_idx.device)
    _block_scores_kernel[(L, triton.cdiv(nb, block_m))](
        q_idx, blocks, positions, out, nb, di, cfg.indexer_compress_ratio,
        q_idx.stride(0), q_idx.stride(1), blocks.stride(0), out.stride(0), 1.0 / cfg.indexer_head_dim ** 0.5,
        HI=hi, DP=triton.next_power_of_2(di), BM=block_m, **pdl.launch(q_idx.device))
    return out


SELECT_KERNEL_MAX_BLOCKS = 2048
"""Candidate blocks up to which the one-program selection kernel picks the top k. Its time grows with the
candidates: on an H200, ~16 us per QSA layer at 1,042 blocks (a 4K decode state) but 197 us at 32,768 (128K),
where torch.topk plus the expansion below costs ~85 us; longer rows go to `select_blocks_wide`."""

RANK_SELECT_MAX_BLOCKS = 2048
RANK_SELECT_MAX_QUERIES = 8
"""Rows (candidate blocks, queries) up to which the ranked selection (`select_blocks_ranked`: every block's
rank counted against the whole row by many programs; O(nb^2) comparisons) replaces the one-program kernel: decode
and short verify batches at a few thousand positions, where the one program's dependent passes are the cost."""


def select_tokens(q_idx: torch.Tensor, blocks: torch.Tensor, positions: torch.Tensor, cfg: ModelConfig,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """`strata.model.qsa.select_tokens` with the block scores above, then the top-k blocks expanded to token
    indices, the tail and validity: by `strata.kernels.select` (one launch: ranks counted by many programs for up to
    RANK_SELECT_MAX_QUERIES queries and RANK_SELECT_MAX_BLOCKS candidates, else one program) up to
    SELECT_KERNEL_MAX_BLOCKS candidates, by its many-program form beyond (`select_blocks_wide`, ten launches), and
    by torch.topk and `expand_blocks` (one launch) for more queries than that serves. Token indices (L, W) and their
    validity (L, W), W <= B + c - 1. Same chosen set as the reference whenever the k-th and (k+1)-th block scores
    differ (the kernels break ties by lowest block index and list the chosen blocks by rank or in block order,
    which `attend`, a softmax over the set, only sees as fp summation order)."""
    c, kb = cfg.indexer_compress_ratio, cfg.block_topk
    nb = blocks.shape[0]
    k = min(kb, nb)
    scores = block_scores(q_idx, blocks, positions, cfg) if k > 0 else q_idx.new_empty(q_idx.shape[0], 0,
                                                                                          dtype=torch.float32)
    if nb <= RANK_SELECT_MAX_BLOCKS and scores.shape[0] <= RANK_SELECT_MAX_QUERIES:
        return select_blocks_ranked(scores, positions, k, c)
    if nb <= SELECT_KERNEL_MAX_BLOCKS:
        return select_blocks(scores, positions, k, c)
    if wide_supported(scores):
        chosen = select_blocks_wide(scores, positions, k, c)
        if chosen is not None:
            return chosen
    top_v, top_b = topk.select(scores, k)
    return expand_blocks(top_v, top_b, positions, c)
