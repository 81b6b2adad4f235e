"""One token's routed experts in one launch whose programs need no other program's result.

The step's pair of launches (the GLU, then the down projections with the slot sum, `gemv_experts_glu` and
`gemv_experts_sum`) makes every down program wait for the whole GLU. Here program (c, slot) computes
h = SiLU(G a) * (U a) for C = 32 NB intermediate features of its slot's expert, then that expert's down
projection over those C columns for all H rows: a partial product of its own (`PartialSums`). What the pair's
slot sum did, the MoE combine does (`combine_parts`): per slot the chunks' partials in order, each slot weighted
and the slots added in order in fp32, rounded once, then the shared expert's gated add as `moe.moe_combine`.

Types: gate/up Q4_K_RT (the GLU's tile-major stacks), down Q5_1_R read as stored: a program's columns are NB
blocks of each row's 96-byte group of four (`gemv_rr._q5_1_r_load`). The products are the row-register GEMV's
(`gemv_rr._super_block_rows`, `gemv_rr._q5_1_r_fma`), so the rounding is the pair's; the fp32 sums run in another
order (the down's K in chunks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from strata.kernels import gemv_blocks as gb
from strata.kernels import gemv_rr as rr
from strata.kernels import pdl
from strata.model.moe import PartialSums

GLU_TYPE, DOWN_TYPE = "Q4_K_RT", "Q5_1_R"


@dataclass(frozen=True)
class Shape:
    """A launch shape: NB Q5_1 blocks (32 NB intermediate features) per program, RD down rows per loop step,
    warps per program, GLU K-loop steps loaded at once (`gemv_rr._k_loop`'s PRE), features per combine program."""

    nb: int = 2
    rd: int = 256
    warps: int = 8
    pre: int = 5
    combine_bh: int = 64


SHAPE = Shape()
"""The launch shape (`tools/fused_moe_lab.py` times the others)."""

ENABLED = False
"""Whether one token's routed experts take this launch where it applies. Off until a GPU has measured it in the
step against the pair and checked it there (`tools/step_variants.py fused-experts:on`, `tools/fused_moe_lab.py`);
the CPU tests run it under the interpreter."""


@triton.jit
def program_slot(ids_ptr, GDC: tl.constexpr):
    """(chunk, slot, expert id) of this program, read after its PDL wait: the launch before wrote the ids."""
    pdl.wait(GDC)
    pdl.started(GDC)
    slot = tl.program_id(1).to(tl.int64)
    return tl.program_id(0), slot, tl.load(ids_ptr + slot, cache_modifier=".cg").to(tl.int64)


@triton.jit
def glu_chunk(x_ptr, g_ptr, u_ptr, e, e_stride, hp, c, BASE, X0, H: tl.constexpr, C: tl.constexpr,
              PRE: tl.constexpr, ASM: tl.constexpr, XA: tl.constexpr):
    """hp[0:C] = SiLU(G a) * (U a) over rows cC .. (c+1)C - 1 of expert e's Q4_K_RT gate/up stacks, rounded as the
    model rounds (`gemv_rr._rr_kernel`'s GLU), then a barrier: the program's threads may read it back. X0 is 0 (a
    stride the compiler cannot see, so the x loads take the weight words' thread layout)."""
    BR: tl.constexpr = 2 * C
    NCH: tl.constexpr = H // 256
    r = tl.arange(0, BR)
    rows = (c * C + r % C).to(tl.int64)  # gate rows, then the same up rows
    off = gb.row_offsets(rows, NCH * 144, 4, 288)
    rp = tl.multiple_of(tl.where(r < C, g_ptr + e * e_stride + off, u_ptr + e * e_stride + off), 16)
    xp = (x_ptr + r * X0)[:, None, None, None]
    res = rr._super_block_rows(rp, xp, tl.full([BR, 2, 4, 4], 0, tl.int32) + BASE, NCH, 2, BR, ASM, False, False,
                               False, XA, PRE, False, 8)
    gg, uu = tl.split(tl.permute(tl.reshape(res, [2, C]), (1, 0)))
    dt: tl.constexpr = hp.dtype.element_ty
    gg = gb.rounded(gg, dt)
    y = gb.rounded(gg / (1.0 + tl.exp(-gg)), dt) * gb.rounded(uu, dt)  # torch's silu, rounded as the model rounds
    tl.store(hp + tl.arange(0, C), gb.cast(y, dt))
    tl.debug_barrier()  # the program's h is stored before its threads read it back


@triton.jit
def _experts_kernel(x_ptr, g_ptr, u_ptr, d_ptr, ids_ptr, h_ptr, part_ptr, e_stride, d_stride, BASE, X0, D_STRIDE,
                    H: tl.constexpr, I: tl.constexpr, NB: tl.constexpr, RD: tl.constexpr, PRE: tl.constexpr,
                    ASM: tl.constexpr, XA: tl.constexpr, GDC: tl.constexpr = False):
    """Program (c, slot): h[slot, cC:(c+1)C] (C = 32 NB) of expert ids[slot] (`glu_chunk`), then
    part[slot, c, :] = D[e][:, cC:(c+1)C] h[slot, cC:(c+1)C] from its Q5_1_R rows: NB blocks of each row's group
    of four, RD rows per loop step, the next step's words loaded before this one's arithmetic."""
    c, slot, e = program_slot(ids_ptr, GDC)
    C: tl.constexpr = 32 * NB
    NCK: tl.constexpr = I // C
    glu_chunk(x_ptr, g_ptr, u_ptr, e, e_stride, h_ptr + slot * I + c * C, c, BASE, X0, H, C, PRE, ASM, XA)
    grp = (c * NB) // 4  # the rows' group of four blocks holding this chunk
    rd = tl.arange(0, RD)[:, None, None, None]
    s = tl.arange(0, 1)[None, :, None, None]
    blk = (c * NB) % 4 + tl.arange(0, NB)[None, None, :, None]
    k = tl.arange(0, 4)[None, None, None, :]
    wp = (d_ptr + e * d_stride + grp * 96).to(tl.pointer_type(tl.int32))
    hp = h_ptr + slot * I + grp * 128 + rd * X0
    base = tl.full([RD, 1, NB, 4], 0, tl.int32) + BASE
    NT: tl.constexpr = H // RD
    pp = part_ptr + (slot * NCK + c) * H
    nxt = rr._q5_1_r_load(wp + rd * (I // 32 * 6), 0, blk, k, D_STRIDE)
    for t in range(NT):
        cur = nxt
        nxt = rr._q5_1_r_load(wp + (tl.minimum(t + 1, NT - 1) * RD + rd) * (I // 32 * 6), 0, blk, k, D_STRIDE)
        acc = rr._q5_1_r_fma(tl.zeros([RD, 1, NB, 4], tl.float32), cur, hp, 0, s, blk, k, base, ASM, XA)
        tl.store(pp + t * RD + tl.arange(0, RD), tl.sum(tl.sum(tl.sum(acc, axis=3), axis=2), axis=1))


@triton.jit
def _combine_kernel(part_ptr, sw_ptr, gate_ptr, shared_ptr, out_ptr, H, S: tl.constexpr, NCK: tl.constexpr,
                    BH: tl.constexpr, DT: tl.constexpr, GDC: tl.constexpr = False, LATE: tl.constexpr = False):
    """out = round(sum over slots j in order of sw[j] * (sum over chunks c in order of part[j, c])) + round(
    sigmoid(gate) * shared), rounded as `moe._combine_kernel` rounds."""
    pdl.enter(GDC, LATE)
    h = tl.program_id(0) * BH + tl.arange(0, BH)
    hm = h < H
    routed = tl.zeros([BH], tl.float32)
    for j in tl.static_range(S):
        f = tl.zeros([BH], tl.float32)
        for c in tl.static_range(NCK):
            f += tl.load(part_ptr + (j * NCK + c) * H + h, mask=hm, other=0.0, cache_modifier=".cg")
        routed += f * tl.load(sw_ptr + j).to(tl.float32)
    g = tl.load(gate_ptr).to(tl.float32)
    sig = gb.rounded(1.0 / (1.0 + tl.exp(-g)), DT)
    sh = tl.load(shared_ptr + h, mask=hm, other=0.0).to(tl.float32)
    tl.store(out_ptr + h, gb.cast(gb.rounded(routed, DT) + gb.rounded(sig * sh, DT), DT), mask=hm)


_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def supported(x: torch.Tensor, gate: tuple[torch.Tensor, str], up: tuple[torch.Tensor, str],
              down: tuple[torch.Tensor, str], ids: torch.Tensor, shape: Shape | None = None) -> bool:
    """Whether `experts` takes one token's routed experts: the types above, one token, shapes the launch tiles
    (H a multiple of 512 and of the down rows per step, I of 128 and of the chunk), contiguous stacks."""
    shape = shape or SHAPE
    g, u, d = gate[0], up[0], down[0]
    if not (ENABLED and gate[1] == up[1] == GLU_TYPE and down[1] == DOWN_TYPE and x.shape[0] == 1
            and x.dtype in _TL and ids.dim() == 1 and 0 < ids.numel() <= 16 and g.dim() == d.dim() == 3):
        return False
    h_dim, i_dim = x.shape[-1], g.shape[1]
    c = 32 * shape.nb
    return (h_dim % 512 == 0 and h_dim % shape.rd == 0 and i_dim % 128 == 0 and i_dim % c == 0 and 128 % c == 0
            and g.shape == u.shape and g.stride() == u.stride() and g.is_contiguous() and u.is_contiguous()
            and d.is_contiguous() and d.shape[1] == h_dim and d.shape[2] == i_dim // 32 * 24
            and g.shape[2] == h_dim // 256 * 144 and g.shape[1] % 4 == 0)


def experts(x: torch.Tensor, gate: tuple[torch.Tensor, str], up: tuple[torch.Tensor, str],
            down: tuple[torch.Tensor, str], ids: torch.Tensor, weights: torch.Tensor,
            shape: Shape | None = None) -> PartialSums:
    """The routed experts of one token x (1, H) (`supported`), expert ids (k,) and slot weights (k,) on the
    device: one launch; the result's sum is taken by the combine (`combine_parts`) or `PartialSums.total`."""
    shape = shape or SHAPE
    h_dim, i_dim = x.shape[-1], gate[0].shape[1]
    k = ids.numel()
    nck = i_dim // (32 * shape.nb)
    h = torch.empty(k, i_dim, dtype=x.dtype, device=x.device)
    part = torch.empty(k * nck, h_dim, dtype=torch.float32, device=x.device)
    cuda = x.device.type == "cuda"
    _experts_kernel[(nck, k)](
        x, gate[0], up[0], down[0], ids, h, part, gate[0].stride(0), down[0].stride(0), 0x3F000000, 0, 1,
        H=h_dim, I=i_dim, NB=shape.nb, RD=shape.rd, PRE=max(1, min(shape.pre, h_dim // 512, rr.MAX_PRELOAD)),
        ASM=cuda, XA=rr.WIDEN_X_ASM if cuda else False, num_warps=shape.warps, **pdl.launch(x.device))
    return PartialSums(part.view(k, nck, h_dim), weights, x.dtype)


def combine_supported(routed: object, gate_logit: torch.Tensor, shared: torch.Tensor) -> bool:
    return (isinstance(routed, PartialSums) and routed.parts.is_contiguous() and shared.shape[0] == 1
            and shared.shape == (1, routed.parts.shape[2]) and gate_logit.shape == (1, 1)
            and shared.dtype == gate_logit.dtype == routed.dtype and shared.is_contiguous()
            and routed.dtype in _TL and routed.weights.is_contiguous())


def combine_parts(routed: PartialSums, gate_logit: torch.Tensor, shared: torch.Tensor,
                  shape: Shape | None = None) -> torch.Tensor:
    """`moe_combine_ref(routed.total(), gate_logit, shared)` in one launch (`combine_supported`)."""
    shape = shape or SHAPE
    k, nck, h_dim = routed.parts.shape
    out = torch.empty_like(shared)
    bh = shape.combine_bh
    _combine_kernel[(triton.cdiv(h_dim, bh),)](
        routed.parts, routed.weights, gate_logit, shared, out, h_dim, S=k, NCK=nck, BH=bh, DT=_TL[routed.dtype],
        num_warps=max(1, min(8, bh // 32)), **pdl.launch(shared.device, "combine"))
    return out
