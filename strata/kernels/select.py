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
from strata.kernels.gemv import tickets

DIGIT_BITS = 4
"""Key bits per radix pass: 8 passes of 16 bins cover the 32-bit key. Each pass counts the 16 bins by comparison
(~1 warp-instruction per key); `tl.histogram` (2048 bins, 3 passes) measured 545 us per query at 32,768
candidates on an H200: its shared-memory atomics serialise when keys share a digit, and the top digits of
positive scores of one magnitude are all equal."""
BINS = 1 << DIGIT_BITS
MAX_BLOCK = 16384  # larger chunks only add registers
SIGN = tl.constexpr(-2147483648)
"""The sign bit: (unsigned key) ^ SIGN compares as a signed int32 in the key's unsigned order."""


@triton.jit
def _ukey(s):
    """Key of fp32 scores whose unsigned order (as int32 bits) is the float order, -0.0 folded into +0.0."""
    b = (s + 0.0).to(tl.int32, bitcast=True)  # -0.0 + 0.0 = +0.0
    return b ^ ((b >> 31) | SIGN)  # negatives: flip all bits; others: flip the sign bit


@triton.jit
def _query_row(s_ptr, s_sl):
    """(p, l, row) of a many-program selection kernel: program p of query l and that query's score row."""
    l = tl.program_id(1)
    return tl.program_id(0), l, s_ptr + l.to(tl.int64) * s_sl


@triton.jit
def _digit_counts(u, cand, bins, SHIFT: tl.constexpr, NBINS: tl.constexpr):
    """Counts [NBINS] of the digit at SHIFT among the keys u where cand holds. By comparison, not tl.histogram:
    its shared-memory atomics serialise when the keys share a digit (the top digits of positive scores of one
    magnitude are all equal)."""
    DMASK: tl.constexpr = NBINS - 1
    hit = (((u >> SHIFT) & DMASK)[:, None] == bins[None, :]) & cand[:, None]
    return tl.sum(hit.to(tl.int32), axis=0)


@triton.jit
def _count_digits(row, lo, hi, pre, hmask, offs, bins, SHIFT: tl.constexpr, BLOCK: tl.constexpr,
                  NBINS: tl.constexpr, EVEN: tl.constexpr):
    """Counts [NBINS] of the digit at SHIFT among the keys of row[lo:hi] whose bits under `hmask` equal `pre`
    (EVEN: hi - lo is a multiple of BLOCK, no bounds mask)."""
    hist = tl.zeros([NBINS], tl.int32)
    for c0 in range(lo, hi, BLOCK):
        o = c0 + offs
        if EVEN:
            u = _ukey(tl.load(row + o))
            cand = (u & hmask) == pre
        else:
            m = o < hi
            u = _ukey(tl.load(row + o, mask=m, other=0.0))
            cand = m & ((u & hmask) == pre)
        hist += _digit_counts(u, cand, bins, SHIFT, NBINS)
    return hist


@triton.jit
def _narrow(hist, bins, need, pre, hmask, SHIFT: tl.constexpr, NBINS: tl.constexpr):
    """From the digit counts of a pass: the digit holding the need-th largest key, and the narrowed (need, pre,
    hmask, going); `going` is False once the chosen bin holds exactly `need` keys (all of them are chosen, so the
    lower bits cannot matter)."""
    DMASK: tl.constexpr = NBINS - 1
    HM: tl.constexpr = ((DMASK << SHIFT) ^ 0x80000000) - 0x80000000  # the digit's bits, as an int32
    ge = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist  # keys with digit >= d
    d = tl.sum((ge >= need).to(tl.int32), axis=0) - 1  # the digit holding the need-th largest
    pick = bins == d
    above = tl.sum(tl.where(pick, ge - hist, 0), axis=0)
    inbin = tl.sum(tl.where(pick, hist, 0), axis=0)
    need = need - above
    return need, pre | (d << SHIFT), hmask | HM, inbin != need


@triton.jit
def _radix_pass(row, NB, need, pre, hmask, offs, bins, SHIFT: tl.constexpr,
                BLOCK: tl.constexpr, NBINS: tl.constexpr, EVEN: tl.constexpr):
    """One digit of the radix select over the whole row: `_count_digits`, then `_narrow`."""
    hist = _count_digits(row, 0, NB, pre, hmask, offs, bins, SHIFT, BLOCK, NBINS, EVEN)
    return _narrow(hist, bins, need, pre, hmask, SHIFT, NBINS)


@triton.jit
def _select_kernel(s_ptr, pos_ptr, idx_ptr, ok_ptr, NB, K, s_sl, s_il, s_ol,
                   C: tl.constexpr, CP: tl.constexpr, TP: tl.constexpr, BLOCK: tl.constexpr, BK: tl.constexpr,
                   NBINS: tl.constexpr, DIGIT: tl.constexpr, G: tl.constexpr, EVEN: tl.constexpr,
                   ONE: tl.constexpr = False, GDC: tl.constexpr = False):
    pdl.started(GDC)
    pdl.wait(GDC)
    l = tl.program_id(0)
    row = s_ptr + l.to(tl.int64) * s_sl
    out_i = idx_ptr + l.to(tl.int64) * s_il
    out_o = ok_ptr + l.to(tl.int64) * s_ol
    offs = tl.arange(0, BLOCK)
    bins = tl.arange(0, NBINS)

    # --- radix select: the prefix `pre` (under `hmask`, unsigned key order) of the K-th largest key
    zero = tl.full([], 0, tl.int32)
    need = zero + K  # picks still to make among the keys matching the prefix (a tensor even when K is 1)
    pre = zero
    hmask = zero
    going = need > 0
    if ONE:  # the row is one chunk: its keys are loaded once and stay in registers for every pass
        inrow = offs < NB
        keys = _ukey(tl.load(row + offs, mask=inrow, other=0.0))
    # DIGIT-bit digits from the top; constexpr shifts let the compiler drop the histogram's bin checks
    for p in tl.static_range(32 // DIGIT):
        if going:
            if ONE:
                SH: tl.constexpr = 32 - DIGIT * (p + 1)
                hist = _digit_counts(keys, inrow & ((keys & hmask) == pre), bins, SH, NBINS)
                need, pre, hmask, going = _narrow(hist, bins, need, pre, hmask, SH, NBINS)
            else:
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
        base = _store_firsts(out_i, o, sel, base, C)
    tl.debug_barrier()  # the slots written above by any thread are read below by others
    _expand(row, out_i, out_o, K, C, CP, BK)
    _tail(out_i, out_o, pos_ptr, l, K, C, TP)


@triton.jit
def _store_firsts(out_i, o, sel, base, C: tl.constexpr):
    """Compaction of one chunk, in block order: the first token o * C of each chosen block o ([groups, G], sel)
    at its slot, base + the chosen blocks before it (an exclusive prefix sum: in-thread groups, then across
    groups); returns base + the chunk's count."""
    e = sel.to(tl.int32)
    gs = tl.sum(e, axis=1)
    slot = base + (tl.cumsum(gs, axis=0) - gs)[:, None] + (tl.cumsum(e, axis=1) - e)
    tl.store(out_i + slot * C, o.to(tl.int64) * C, mask=sel)
    return base + tl.sum(gs, axis=0)


@triton.jit
def _expand(row, out_i, out_o, K, C: tl.constexpr, CP: tl.constexpr, BK: tl.constexpr):
    """Each of the K chosen blocks' c tokens from its first (stored by `_store_firsts`, before a barrier); valid
    where the block's score is finite (the block is visible)."""
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


def _operands(scores: torch.Tensor, positions: torch.Tensor, k: int, c: int,
              out: tuple[torch.Tensor, torch.Tensor] | None = None,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What every selection launcher checks and makes: scores (L, nb) with unit inner stride, contiguous
    positions, and the outputs idx (L, k*c + c-1) int64 and ok (same) bool, `out` or new."""
    L, nb = scores.shape
    assert 0 <= k <= nb and c >= 1
    W = k * c + c - 1
    if out is None:
        out = (torch.empty(L, W, dtype=torch.int64, device=scores.device),
               torch.empty(L, W, dtype=torch.bool, device=scores.device))
    idx, ok = out
    assert idx.shape == ok.shape == (L, W) and idx.dtype == torch.int64 and ok.dtype == torch.bool
    assert idx.stride(-1) == 1 and ok.stride(-1) == 1
    return (scores if scores.stride(-1) == 1 else scores.contiguous()), positions.contiguous(), idx, ok


def select_blocks(scores: torch.Tensor, positions: torch.Tensor, k: int, c: int, block: int | None = None,
                  num_warps: int | None = None, out: tuple[torch.Tensor, torch.Tensor] | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token indices (L, k*c + c-1) int64 of each query's top-k blocks by `scores` (L, nb) fp32, expanded to
    their c tokens, then the tail after the query's complete blocks; and their validity (finite score / tail
    position <= the query's `positions`). 0 <= k <= nb. See the module docstring for ties and order. `out`:
    contiguous (idx, ok) to write into (every element is written); `block`/`num_warps`: chunk and warps."""
    scores, positions, idx, ok = _operands(scores, positions, k, c, out)
    L, nb = scores.shape
    if idx.numel() == 0:
        return idx, ok
    if block is None:
        # one chunk up to 2048 blocks (a second, nearly empty chunk doubles every pass's loads: 19-20 -> 16-17 us
        # at 1,026-1,040 blocks on an H200); above that 1024: the 16-bin count holds a [block, 16] compare in
        # registers
        block = 2048 if nb <= 2048 else 1024
    block = min(block, MAX_BLOCK, max(16, triton.next_power_of_2(nb)))
    if num_warps is None:
        num_warps = 16 if block >= 1024 else 4
    _select_kernel[(L,)](scores, positions, idx, ok.view(torch.int8), nb, k,
                         scores.stride(0), idx.stride(0), ok.stride(0),
                         C=c, CP=triton.next_power_of_2(c), TP=triton.next_power_of_2(c - 1) if c > 1 else 0,
                         BLOCK=block, BK=min(1024, max(16, triton.next_power_of_2(k))), NBINS=BINS,
                         DIGIT=DIGIT_BITS, G=8,
                         EVEN=nb % block == 0, ONE=nb <= block, num_warps=num_warps,
                         **pdl.launch(scores.device))
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


# ---------------------------------------------------------------------------------------------------------------
# Short rows (decode at a few thousand positions): the same selection by ranks, spread over programs


RANK_ROWS = 16
"""Candidate blocks whose ranks one program of `select_blocks_ranked` counts (66 programs at 1,042 blocks)."""
RANK_CHUNK = 1024
"""Row blocks per step of that count: a [RANK_ROWS, RANK_CHUNK] comparison tile. (16 rows, 1024-block steps and
8 warps were the best of 8-32 rows, 512-2048 blocks and 4-8 warps for the form that compacted in block order,
bench/results/2026-12-04-h200-select-ranked-lab.json.)"""
RANK_WARPS = 8


@triton.jit
def _rank_select_kernel(s_ptr, pos_ptr, idx_ptr, ok_ptr, NB, K, s_sl, s_il, s_ol,
                        BS: tl.constexpr, RB: tl.constexpr, C: tl.constexpr, TP: tl.constexpr,
                        GDC: tl.constexpr = False):
    """Program (p, l): for the BS blocks i of row l from p * BS, rank(i) = the number of blocks that rank above i
    (a higher key, or the same key at a lower index), counted against the whole row RB blocks at a time. i is
    chosen when rank(i) < K, which is the radix select's set (the K largest keys, ties to the lowest block
    index), and its c tokens and their validity (its score finite) go to slot rank(i): no program waits for
    another. Program 0 also writes the tail."""
    pdl.started(GDC)
    pdl.wait(GDC)
    p, l, row = _query_row(s_ptr, s_sl)
    i = p * BS + tl.arange(0, BS)
    im = i < NB
    si = tl.load(row + i, mask=im, other=0.0)
    ki = _ukey(si) ^ SIGN  # signed order of key ^ SIGN: the float order
    rank = tl.zeros([BS], tl.int32)
    for c0 in range(0, NB, RB):
        j = c0 + tl.arange(0, RB)
        jm = j < NB
        kj = _ukey(tl.load(row + j, mask=jm, other=0.0)) ^ SIGN
        beats = (kj[None, :] > ki[:, None]) | ((kj[None, :] == ki[:, None]) & (j[None, :] < i[:, None]))
        rank += tl.sum((beats & jm[None, :]).to(tl.int32), axis=1)
    sel = im & (rank < K)
    out_i = idx_ptr + l.to(tl.int64) * s_il
    out_o = ok_ptr + l.to(tl.int64) * s_ol
    fin = (tl.abs(si) < float("inf")).to(tl.int8)  # NaN: False
    for t in tl.static_range(C):
        tl.store(out_i + rank * C + t, i.to(tl.int64) * C + t, mask=sel)
        tl.store(out_o + rank * C + t, fin, mask=sel)
    if p == 0:
        _tail(out_i, out_o, pos_ptr, l, K, C, TP)


def select_blocks_ranked(scores: torch.Tensor, positions: torch.Tensor, k: int, c: int, rows: int = RANK_ROWS,
                         chunk: int = RANK_CHUNK, num_warps: int = RANK_WARPS,
                         out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`select_blocks` by ranks, in one pass: every block's rank counted by comparison with the whole row,
    cdiv(nb, rows) programs per query, and each chosen block written at its rank. The same chosen set, ties,
    validity and tail as `select_blocks`, listed by rank (score descending, ties by block index: torch.topk's
    order in the reference) instead of block order; `attend` sees the order only as fp summation order. Its
    work grows as nb^2, so it serves short rows (`attention.select_tokens`: up to RANK_SELECT_MAX_BLOCKS), where
    the radix select's one program is a chain of dependent passes. `out` as in `select_blocks`."""
    assert scores.dtype == torch.float32
    scores, positions, idx, ok = _operands(scores, positions, k, c, out)
    L, nb = scores.shape
    if idx.numel() == 0:
        return idx, ok
    rows = max(16, triton.next_power_of_2(min(rows, max(1, nb))))
    _rank_select_kernel[(max(1, triton.cdiv(nb, rows)), L)](
        scores, positions, idx, ok.view(torch.int8), nb, k, scores.stride(0), idx.stride(0), ok.stride(0),
        BS=rows, RB=max(16, triton.next_power_of_2(min(chunk, max(1, nb)))), C=c,
        TP=triton.next_power_of_2(c - 1) if c > 1 else 0, num_warps=num_warps, **pdl.launch(scores.device))
    return idx, ok


# ---------------------------------------------------------------------------------------------------------------
# Long rows: the same selection spread over many programs per query


WIDE_CHUNK = 512
"""Candidate blocks per program of `select_blocks_wide` (64 programs per query at 128K positions). H200, k = 512 of
32,768 blocks: 21 us at 512, 26 at 1024, 35 at 2048 (torch.topk and the expansion: 58 us; the one-program
kernel: 198 us)."""
WIDE_MAX_L = 8
"""Queries per call `select_blocks_wide` serves (decode and short verify batches)."""


@triton.jit
def _wide_pass_kernel(s_ptr, st_ptr, hist_ptr, cnt_ptr, NB, K, CH, P, s_sl,
                      SHIFT: tl.constexpr, FIRST: tl.constexpr, BLOCK: tl.constexpr, NBINS: tl.constexpr,
                      GDC: tl.constexpr = False):
    """One radix pass over one query's row by P programs (program (p, l): blocks [p CH, (p + 1) CH) of query l):
    each adds its digit counts (`_count_digits`) to the query's histogram (integer atomics: the sums do not
    depend on their order); the last to draw a ticket picks the digit (`_narrow`), stores the narrowed state
    (need, prefix, mask, going) and puts the histogram and its ticket back to zero."""
    pdl.started(GDC)
    pdl.wait(GDC)
    p, l, row = _query_row(s_ptr, s_sl)
    st = st_ptr + l * 4
    zero = tl.full([], 0, tl.int32)
    if FIRST:
        need = zero + K
        pre = zero
        hmask = zero
        going = need > 0
        if (K == 0) & (p == 0):
            tl.store(st + tl.arange(0, 4), tl.zeros([4], tl.int32))
    else:
        need = tl.load(st)
        pre = tl.load(st + 1)
        hmask = tl.load(st + 2)
        going = tl.load(st + 3) != 0
    if going:
        lo = p * CH
        bins = tl.arange(0, NBINS)
        hist = _count_digits(row, lo, tl.minimum(lo + CH, NB), pre, hmask, tl.arange(0, BLOCK), bins, SHIFT, BLOCK,
                             NBINS, False)
        hp = hist_ptr + l * NBINS + bins
        tl.atomic_add(hp, hist, sem="relaxed", scope="gpu")
        tl.debug_barrier()  # every thread's counts are added before the ticket is drawn
        if tl.atomic_add(cnt_ptr + l, 1, sem="acq_rel", scope="gpu") == P - 1:
            hist = tl.atomic_xchg(hp, tl.zeros([NBINS], tl.int32), sem="relaxed", scope="gpu")
            need, pre, hmask, going = _narrow(hist, bins, need, pre, hmask, SHIFT, NBINS)
            i4 = tl.arange(0, 4)
            state = tl.where(i4 == 0, need, tl.where(i4 == 1, pre, tl.where(i4 == 2, hmask, going.to(tl.int32))))
            tl.store(st + i4, state)
            tl.atomic_xchg(cnt_ptr + l, 0, sem="relaxed", scope="gpu")


@triton.jit
def _wide_count_kernel(s_ptr, st_ptr, n_ptr, NB, K, CH, P, s_sl, BLOCK: tl.constexpr, GDC: tl.constexpr = False):
    """Per program: how many of its keys are above the selected prefix, and how many equal it (under its mask)."""
    pdl.started(GDC)
    pdl.wait(GDC)
    p, l, row = _query_row(s_ptr, s_sl)
    thr = tl.load(st_ptr + l * 4 + 1) ^ SIGN
    hmask = tl.load(st_ptr + l * 4 + 2)
    lo = p * CH
    hi = tl.minimum(lo + CH, tl.where(K > 0, NB, 0))
    offs = tl.arange(0, BLOCK)
    gt = tl.zeros([BLOCK], tl.int32)
    eq = tl.zeros([BLOCK], tl.int32)
    for c0 in range(lo, hi, BLOCK):
        o = c0 + offs
        m = o < hi
        mk = (_ukey(tl.load(row + o, mask=m, other=0.0)) & hmask) ^ SIGN
        gt += (m & (mk > thr)).to(tl.int32)
        eq += (m & (mk == thr)).to(tl.int32)
    tl.store(n_ptr + (l * 2) * P + p, tl.sum(gt, axis=0))
    tl.store(n_ptr + (l * 2 + 1) * P + p, tl.sum(eq, axis=0))


@triton.jit
def _wide_compact_kernel(s_ptr, pos_ptr, st_ptr, n_ptr, idx_ptr, ok_ptr, NB, K, CH, P, s_sl, s_il, s_ol,
                         PP: tl.constexpr, C: tl.constexpr, TP: tl.constexpr, BLOCK: tl.constexpr, G: tl.constexpr,
                         GDC: tl.constexpr = False):
    """Per program: its chosen blocks (keys above the prefix, and the first of those equal to it, in block order,
    up to the k picks) written expanded to their c tokens at their slots (block order over the whole row: the
    counts of the programs before it give its first slot and its share of the ties); program 0 writes the
    tail."""
    pdl.started(GDC)
    pdl.wait(GDC)
    p, l, row = _query_row(s_ptr, s_sl)
    out_i = idx_ptr + l.to(tl.int64) * s_il
    out_o = ok_ptr + l.to(tl.int64) * s_ol
    thr = tl.load(st_ptr + l * 4 + 1) ^ SIGN
    hmask = tl.load(st_ptr + l * 4 + 2)
    q = tl.arange(0, PP)
    qm = q < P
    gt = tl.load(n_ptr + (l * 2) * P + q, mask=qm, other=0)
    eq = tl.load(n_ptr + (l * 2 + 1) * P + q, mask=qm, other=0)
    ties = K - tl.sum(gt, axis=0)  # picks left for keys equal to the prefix, lowest block index first
    eq_before = tl.sum(tl.where(q < p, eq, 0), axis=0)
    quota = tl.minimum(tl.maximum(ties - eq_before, 0), tl.sum(tl.where(q == p, eq, 0), axis=0))
    base = tl.sum(tl.where(q < p, gt, 0), axis=0) + tl.minimum(eq_before, ties)
    lo = p * CH
    hi = tl.minimum(lo + CH, tl.where(K > 0, NB, 0))
    grp = tl.arange(0, BLOCK // G)[:, None] * G + tl.arange(0, G)[None, :]
    seen = tl.full([], 0, tl.int32)
    for c0 in range(lo, hi, BLOCK):
        o = c0 + grp
        m = o < hi
        sc = tl.load(row + o, mask=m, other=0.0)
        mk = (_ukey(sc) & hmask) ^ SIGN
        e_eq = (m & (mk == thr)).to(tl.int32)
        g_eq = tl.sum(e_eq, axis=1)
        rank = seen + (tl.cumsum(g_eq, axis=0) - g_eq)[:, None] + (tl.cumsum(e_eq, axis=1) - e_eq)
        sel = (m & (mk > thr)) | ((e_eq != 0) & (rank < quota))
        e = sel.to(tl.int32)
        gs = tl.sum(e, axis=1)
        slot = base + (tl.cumsum(gs, axis=0) - gs)[:, None] + (tl.cumsum(e, axis=1) - e)
        fin = (tl.abs(sc) < float("inf")).to(tl.int8)  # NaN: False
        for j in tl.static_range(C):
            tl.store(out_i + slot * C + j, o.to(tl.int64) * C + j, mask=sel)
            tl.store(out_o + slot * C + j, fin, mask=sel)
        base += tl.sum(gs, axis=0)
        seen += tl.sum(g_eq, axis=0)
    if p == 0:
        _tail(out_i, out_o, pos_ptr, l, K, C, TP)


def wide_supported(scores: torch.Tensor) -> bool:
    return scores.dim() == 2 and 1 <= scores.shape[0] <= WIDE_MAX_L and scores.dtype == torch.float32


def select_blocks_wide(scores: torch.Tensor, positions: torch.Tensor, k: int, c: int, chunk: int = WIDE_CHUNK,
                       ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`select_blocks` for long rows: the same chosen set, order and outputs, with each query's row spread over
    cdiv(nb, chunk) programs. 32 // DIGIT_BITS radix passes, then a count and a compaction: ten launches of
    short programs instead of one program streaming the row eight times (197 us at 32,768 blocks on an H200).
    The passes meet through a per-query histogram of integer atomics and a ticket, both kept in the stream's
    split-K ticket counters (`gemv.tickets`: zeros between launches); no host sync: capturable.
    None when the current stream has no split-K ticket region (`gemv.tickets`): the caller takes another path."""
    assert wide_supported(scores)
    scores, positions, idx, ok = _operands(scores, positions, k, c)
    L, nb = scores.shape
    dev = scores.device
    if idx.numel() == 0:
        return idx, ok
    chunk = max(16, triton.next_power_of_2(min(chunk, max(1, nb))))
    P = max(1, triton.cdiv(nb, chunk))
    block = min(chunk, 1024)
    cnt = tickets(dev)
    if cnt is None:  # no ticket region left for this stream: the caller's other path
        return None
    hist = cnt[WIDE_MAX_L:WIDE_MAX_L + L * BINS]  # zeros like the tickets, and zeroed again by the last program
    st = torch.empty(L, 4, dtype=torch.int32, device=dev)
    counts = torch.empty(L, 2, P, dtype=torch.int32, device=dev)
    gdc = pdl.launch(dev)
    for i in range(32 // DIGIT_BITS):
        _wide_pass_kernel[(P, L)](scores, st, hist, cnt, nb, k, chunk, P, scores.stride(0),
                                  SHIFT=32 - DIGIT_BITS * (i + 1), FIRST=i == 0, BLOCK=block, NBINS=BINS,
                                  num_warps=4, **gdc)
    _wide_count_kernel[(P, L)](scores, st, counts, nb, k, chunk, P, scores.stride(0), BLOCK=block, num_warps=4,
                               **gdc)
    _wide_compact_kernel[(P, L)](scores, positions, st, counts, idx, ok.view(torch.int8), nb, k, chunk, P,
                                 scores.stride(0), idx.stride(0), ok.stride(0), PP=triton.next_power_of_2(P), C=c,
                                 TP=triton.next_power_of_2(c - 1) if c > 1 else 0, BLOCK=block, G=8, num_warps=4,
                                 **gdc)
    return idx, ok
