"""Top-k block selection and token expansion for the QSA indexer, in one launch: the twin of the top-k half of
`strata.model.qsa.select_tokens` (`torch.topk` plus ~8 small torch ops).

Why. `torch.topk` over the capacity-sized score row (8192 blocks at 32K positions, 32768 at 128K) costs ~58 us
per QSA layer on an H200 (a radix sort and a gather kernel), ten times the block scores it selects from. Here a
single program per query finds the k-th largest score with a radix select and writes the token indices and
their validity directly.

How (one program per query, the row streamed from L2 in chunks of `block`):
  * Key. Each fp32 score becomes a 32-bit key whose unsigned order is the float order (flip all bits of
    negatives, the sign bit of the rest); -0.0 is folded into +0.0, so equal floats tie as in torch.topk. (A NaN
    ranks by its sign bit; `block_scores` never yields one: its ReLU is a max, which drops NaN.)
  * Radix select. Up to eight passes over 4-bit digits of the key narrow the prefix T of the k-th largest key;
    each pass counts, by comparison, the 16 digit values among the keys that share the prefix found so far.
    After a pass the chosen digit's bin holds `need` of the remaining picks; when it holds exactly `need` keys,
    all of them are chosen and the remaining passes are skipped.
  * Ties. Only if keys exactly equal to T outnumber `need` (all 32 bits spent), one more pass finds the block
    index `icut` below which the first `need` of them lie.
  * Compaction. One pass marks the chosen blocks (key prefix above T, or equal to it below `icut`) and gives
    each its slot with an exclusive prefix sum (in-thread groups of 8, then across groups), carried across
    chunks; each chosen block's first token is stored at its slot. After a barrier, a short loop over the k
    slots writes the other c - 1 tokens and the validity, then the tail.

Cost (H200, one query, tools/gpu_check_fused.py): 197 us at 32,768 candidate blocks (the 128K-capacity row),
where torch.topk alone takes 58 us; one program streams the row once per pass and waits on each chunk's loads,
so the kernel serves rows up to `attention.SELECT_KERNEL_MAX_BLOCKS` and torch.topk the longer ones. (With
`tl.histogram` over 11-bit digits it took 545 us: its shared-memory atomics serialise when the keys share a
digit, and the top digits of positive scores of one magnitude are all equal.)

Everything is sized by shapes (L, nb, k, c), never by data, and no host sync happens: capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from strata.kernels import pdl

DIGIT_BITS = 4
"""Key bits per radix pass: 8 passes of 16 bins cover the 32-bit key. Each pass counts the 16 bins by comparison
(~1 warp-instruction per key); `tl.histogram` (2048 bins, 3 passes) measured 545 us per query at 32,768
candidates on an H200: its shared-memory atomics serialise when keys share a digit, and the top digits of
positive scores of one magnitude are all equal."""
BINS = 1 << DIGIT_BITS
MAX_BLOCK = 16384  # larger chunks only add registers


@triton.jit
def _ukey(s):
    """Key of fp32 scores whose unsigned order (as int32 bits) is the float order, -0.0 folded into +0.0."""
    b = (s + 0.0).to(tl.int32, bitcast=True)  # -0.0 + 0.0 = +0.0
    return b ^ ((b >> 31) | -2147483648)  # negatives: flip all bits; others: flip the sign bit


@triton.jit
def _radix_pass(row, NB, need, pre, hmask, offs, bins, SHIFT: tl.constexpr,
                BLOCK: tl.constexpr, NBINS: tl.constexpr, EVEN: tl.constexpr):
    """One digit of the radix select: histogram the digit at SHIFT of the keys matching `pre` under `hmask`,
    pick the digit holding the need-th largest, and narrow (need, pre, hmask); `going` is False once the chosen
    bin holds exactly `need` keys (all of them are chosen, so the lower bits cannot matter)."""
    DMASK: tl.constexpr = NBINS - 1
    HM: tl.constexpr = ((DMASK << SHIFT) ^ 0x80000000) - 0x80000000  # the digit's bits, as an int32
    hist = tl.zeros([NBINS], tl.int32)
    for c0 in range(0, NB, BLOCK):
        o = c0 + offs
        if EVEN:
            u = _ukey(tl.load(row + o))
            cand = (u & hmask) == pre
        else:
            m = o < NB
            u = _ukey(tl.load(row + o, mask=m, other=0.0))
            cand = m & ((u & hmask) == pre)
        # counted by comparison, not tl.histogram: its shared-memory atomics serialise when the keys share a
        # digit (the top digits of positive scores of one magnitude are all equal)
        hit = (((u >> SHIFT) & DMASK)[:, None] == bins[None, :]) & cand[:, None]
        hist += tl.sum(hit.to(tl.int32), axis=0)
    ge = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist  # keys with digit >= d
    d = tl.sum((ge >= need).to(tl.int32), axis=0) - 1  # the digit holding the need-th largest
    pick = bins == d
    above = tl.sum(tl.where(pick, ge - hist, 0), axis=0)
    inbin = tl.sum(tl.where(pick, hist, 0), axis=0)
    need = need - above
    return need, pre | (d << SHIFT), hmask | HM, inbin != need


@triton.jit
def _select_kernel(s_ptr, pos_ptr, idx_ptr, ok_ptr, NB, K, s_sl, s_il, s_ol,
                   C: tl.constexpr, CP: tl.constexpr, TP: tl.constexpr, BLOCK: tl.constexpr, BK: tl.constexpr,
                   NBINS: tl.constexpr, DIGIT: tl.constexpr, G: tl.constexpr, EVEN: tl.constexpr, GDC: tl.constexpr = False):
    pdl.started(GDC)
    pdl.wait(GDC)
    l = tl.program_id(0)
    row = s_ptr + l.to(tl.int64) * s_sl
    out_i = idx_ptr + l.to(tl.int64) * s_il
    out_o = ok_ptr + l.to(tl.int64) * s_ol
    offs = tl.arange(0, BLOCK)
    bins = tl.arange(0, NBINS)
    SIGN: tl.constexpr = -2147483648

    # --- radix select: the prefix `pre` (under `hmask`, unsigned key order) of the K-th largest key
    zero = tl.full([], 0, tl.int32)
    need = zero + K  # picks still to make among the keys matching the prefix (a tensor even when K is 1)
    pre = zero
    hmask = zero
    going = need > 0
    # DIGIT-bit digits from the top; constexpr shifts let the compiler drop the histogram's bin checks
    for p in tl.static_range(32 // DIGIT):
        if going:
            need, pre, hmask, going = _radix_pass(row, NB, need, pre, hmask, offs, bins, 32 - DIGIT * (p + 1),
                                                  BLOCK, NBINS, EVEN)

    # --- ties: if keys equal to the K-th largest outnumber the picks left, the lowest block indices win:
    # `icut` is one past the need-th such key in block order (rare: all 32 key bits are spent by then)
    thr = pre ^ SIGN  # signed order of (masked key ^ SIGN) is the unsigned order of the masked key
    icut = zero + NB
    if going:
        base = zero
        for c0 in range(0, NB, BLOCK):
            o = c0 + offs
            m = o < NB
            eq = m & (((_ukey(tl.load(row + o, mask=m, other=0.0)) & hmask) ^ SIGN) == thr)
            e = eq.to(tl.int32)
            hit = eq & (base + tl.cumsum(e, axis=0) == need)
            icut = tl.minimum(icut, tl.min(tl.where(hit, o + 1, NB), axis=0))
            base += tl.sum(e, axis=0)

    # --- compaction: every key above the prefix, and those equal to it below `icut`, in block order. Each
    # chosen block's first token goes to its slot (an exclusive prefix sum: per-thread groups of G, then
    # across groups); the expansion below reads them back.
    n_sel = tl.where(K > 0, NB, 0)  # K == 0: no pass ran, nothing is chosen
    base = zero
    grp = tl.arange(0, BLOCK // G)[:, None] * G + tl.arange(0, G)[None, :]
    for c0 in range(0, NB, BLOCK):
        o = c0 + grp
        if EVEN:
            mk = (_ukey(tl.load(row + o)) & hmask) ^ SIGN
            sel = ((mk > thr) | ((mk == thr) & (o < icut))) & (o < n_sel)
        else:
            m = o < n_sel
            mk = (_ukey(tl.load(row + o, mask=m, other=0.0)) & hmask) ^ SIGN
            sel = m & ((mk > thr) | ((mk == thr) & (o < icut)))
        e = sel.to(tl.int32)
        gs = tl.sum(e, axis=1)
        slot = base + (tl.cumsum(gs, axis=0) - gs)[:, None] + (tl.cumsum(e, axis=1) - e)
        tl.store(out_i + slot * C, o.to(tl.int64) * C, mask=sel)
        base += tl.sum(gs, axis=0)
    tl.debug_barrier()  # the slots written above by any thread are read below by others

    # --- expansion: each chosen block's c tokens; valid where its score is finite (the block is visible)
    j = tl.arange(0, CP)
    jm = j < C
    for k0 in range(0, K, BK):
        r = k0 + tl.arange(0, BK)
        rm = r < K
        first = tl.load(out_i + r * C, mask=rm, other=0)
        sc = tl.load(row + first // C, mask=rm, other=0.0)
        fin = tl.abs(sc) < float("inf")  # NaN: False
        at = r[:, None] * C + j[None, :]
        sm = rm[:, None] & jm[None, :]
        tl.store(out_i + at, first[:, None] + j[None, :], mask=sm & (j[None, :] > 0))
        tl.store(out_o + at, (fin[:, None] & jm[None, :]).to(tl.int8), mask=sm)

    _tail(out_i, out_o, pos_ptr, l, K, C, TP)


@triton.jit
def _tail(out_i, out_o, pos_ptr, l, K, C: tl.constexpr, TP: tl.constexpr):
    """The query's incomplete block after its K chosen blocks (c - 1 slots), valid up to and including its own
    position."""
    if TP > 0:
        pos = tl.load(pos_ptr + l).to(tl.int64)
        t = tl.arange(0, TP)
        tok = (pos + 1) // C * C + t
        tm = t < C - 1
        tl.store(out_i + K * C + t, tok, mask=tm)
        tl.store(out_o + K * C + t, (tok <= pos).to(tl.int8), mask=tm)


def select_blocks(scores: torch.Tensor, positions: torch.Tensor, k: int, c: int, block: int | None = None,
                  num_warps: int | None = None, out: tuple[torch.Tensor, torch.Tensor] | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token indices (L, k*c + c-1) int64 of each query's top-k blocks by `scores` (L, nb) fp32, expanded to
    their c tokens, then the tail after the query's complete blocks; and their validity (finite score / tail
    position <= the query's `positions`). 0 <= k <= nb. See the module docstring for ties and order. `out`:
    contiguous (idx, ok) to write into (every element is written); `block`/`num_warps`: chunk and warps."""
    L, nb = scores.shape
    assert 0 <= k <= nb and c >= 1
    scores = scores if scores.stride(-1) == 1 else scores.contiguous()
    positions = positions.contiguous()
    W = k * c + c - 1
    if out is None:
        out = (torch.empty(L, W, dtype=torch.int64, device=scores.device),
               torch.empty(L, W, dtype=torch.bool, device=scores.device))
    idx, ok = out
    assert idx.shape == ok.shape == (L, W) and idx.dtype == torch.int64 and ok.dtype == torch.bool
    assert idx.stride(-1) == 1 and ok.stride(-1) == 1
    if L == 0 or W == 0:
        return idx, ok
    if block is None:
        block = 1024  # the 16-bin count of a pass holds a [block, 16] compare in registers
    block = min(block, MAX_BLOCK, max(16, triton.next_power_of_2(nb)))
    if num_warps is None:
        num_warps = 16 if block >= 1024 else 4
    _select_kernel[(L,)](scores, positions, idx, ok.view(torch.int8), nb, k,
                         scores.stride(0), idx.stride(0), ok.stride(0),
                         C=c, CP=triton.next_power_of_2(c), TP=triton.next_power_of_2(c - 1) if c > 1 else 0,
                         BLOCK=block, BK=min(1024, max(16, triton.next_power_of_2(k))), NBINS=BINS,
                         DIGIT=DIGIT_BITS, G=8,
                         EVEN=nb % block == 0, num_warps=num_warps, **pdl.launch(scores.device))
    return idx, ok


@triton.jit
def _expand_kernel(v_ptr, b_ptr, pos_ptr, idx_ptr, ok_ptr, K, s_vl, s_bl, s_il, s_ol,
                   C: tl.constexpr, CP: tl.constexpr, TP: tl.constexpr, BK: tl.constexpr,
                   GDC: tl.constexpr = False):
    """idx/ok of one query from its k chosen blocks (b, their scores v): the expansion and tail of
    `_select_kernel`, for blocks chosen elsewhere (torch.topk)."""
    pdl.started(GDC)
    pdl.wait(GDC)
    l = tl.program_id(0).to(tl.int64)
    out_i = idx_ptr + l * s_il
    out_o = ok_ptr + l * s_ol
    j = tl.arange(0, CP)
    jm = j < C
    for k0 in range(0, K, BK):
        r = k0 + tl.arange(0, BK)
        rm = r < K
        blk = tl.load(b_ptr + l * s_bl + r, mask=rm, other=0).to(tl.int64)
        fin = tl.abs(tl.load(v_ptr + l * s_vl + r, mask=rm, other=0.0)) < float("inf")  # NaN: False
        at = r[:, None] * C + j[None, :]
        sm = rm[:, None] & jm[None, :]
        tl.store(out_i + at, blk[:, None] * C + j[None, :], mask=sm)
        tl.store(out_o + at, (fin[:, None] & jm[None, :]).to(tl.int8), mask=sm)
    _tail(out_i, out_o, pos_ptr, l, K, C, TP)


def expand_blocks(top_v: torch.Tensor, top_b: torch.Tensor, positions: torch.Tensor, c: int,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token indices (L, k*c + c-1) and validity of k chosen blocks per query (top_b (L, k) int64, their scores
    top_v (L, k) fp32: valid where finite), then the tail after the query's complete blocks, in one launch:
    what `select_blocks` writes, in the blocks' given order (the reference's expansion is ~8 small torch ops)."""
    L, k = top_b.shape
    W = k * c + c - 1
    idx = torch.empty(L, W, dtype=torch.int64, device=top_b.device)
    ok = torch.empty(L, W, dtype=torch.bool, device=top_b.device)
    if L == 0 or W == 0:
        return idx, ok
    top_v = top_v if top_v.stride(-1) == 1 else top_v.contiguous()
    top_b = top_b if top_b.stride(-1) == 1 else top_b.contiguous()
    _expand_kernel[(L,)](top_v, top_b, positions.contiguous(), idx, ok.view(torch.int8), k,
                         top_v.stride(0), top_b.stride(0), idx.stride(0), ok.stride(0),
                         C=c, CP=triton.next_power_of_2(c), TP=triton.next_power_of_2(c - 1) if c > 1 else 0,
                         BK=min(1024, max(16, triton.next_power_of_2(k))), **pdl.launch(top_b.device))
    return idx, ok
