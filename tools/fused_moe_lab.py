"""The routed experts' GLU and down projections in one launch with no dependency between its programs, against the
step's pair of launches (a lab; run on the device box, the kernel check also under TRITON_INTERPRET=1).

In the decode step the routed GLU and the routed down projections are a PDL pair: the down's programs wait for
the whole GLU, then read h, multiply and sum the slots (~23 us of a GDN layer's path on an H100 from the routing's
end, against ~12 us in which one launch can merely stream both launches' bytes, `tools/stream_lab.py`). Here
program (chunk c, slot s) computes h for 32 NB intermediate features of its slot's expert (the row-register GLU
over the chunk's Q4_K_RT gate and up rows) and then that expert's down projection over those columns for all H
rows: a partial product of its own, needing no other program's h. The MoE combine that follows adds the partial
products (per slot the chunks in order, the slots weighted in order, rounded once, then the shared expert's gated
add, as `moe.moe_combine`). The down is read as stored (Q5_1_R rows: NB blocks of each row's 96-byte group) or
re-laid as column planes (`down_planes`: [I / C chunks][H rows x 2 NB header words][H rows x 4 NB nibble words],
so that a program's down bytes are two contiguous runs).

Timed as 48 layers back to back in a CUDA graph with PDL, each layer its own stacks (64 experts each, the slots'
experts random): the pair (GLU, down with the slot sum, combine) against the one launch and the combine of its
partial sums, in several launch shapes. Measured on an H100 (docs/performance-log.md, 2026-12-07): 30-146 us per
layer against the pair's 23.2, and in the 4K step (on `wip/moe-fused`, where the op tables take it) 6.453-6.457 ms per
replay against 4.52 (NB = 2): a program's GLU chunk runs its whole K loop in one program, so the launch has 100-200
programs (NB = 2, 1) where the pair's GLU has 1,600.

    python tools/fused_moe_lab.py --out fused-moe-lab.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from strata.kernels import gemv as G  # noqa: E402
from strata.kernels import gemv_blocks as gb  # noqa: E402
from strata.kernels import gemv_rr as rr  # noqa: E402
from strata.kernels import pdl  # noqa: E402
from strata.kernels.moe import moe_combine  # noqa: E402
from strata.model.moe import moe_combine_ref  # noqa: E402
from strata.weights import repack  # noqa: E402
from tools.gpu_check_gemv import random_rows, time_graph  # noqa: E402

HIDDEN, INTER, SLOTS, LAYERS, EXPERTS = 2560, 640, 10, 48, 64
GLU, DOWN = "Q4_K_RT", "Q5_1_R"


@triton.jit
def _glu_chunk(x_ptr, g_ptr, u_ptr, e, e_stride, hp, c, BASE, X0, H: tl.constexpr, C: tl.constexpr,
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
def _fused_kernel(x_ptr, g_ptr, u_ptr, d_ptr, ids_ptr, h_ptr, part_ptr, e_stride, d_stride, BASE, X0, D_STRIDE,
                  H: tl.constexpr, I: tl.constexpr, NB: tl.constexpr, RD: tl.constexpr, PRE: tl.constexpr,
                  PLANES: tl.constexpr, ASM: tl.constexpr, XA: tl.constexpr, GDC: tl.constexpr = False):
    """Program (c, slot): h[slot, cC:(c+1)C] (C = 32 NB) of expert ids[slot] (`_glu_chunk`), then
    part[slot, c, :] = D[e][:, cC:(c+1)C] h[slot, cC:(c+1)C], RD rows per loop step (the next step's words loaded
    before this one's arithmetic), from the Q5_1_R rows as stored (NB blocks of each row's group of four) or with
    PLANES from the column planes (`down_planes`)."""
    pdl.wait(GDC)  # the expert ids are written by the launch before
    pdl.started(GDC)
    C: tl.constexpr = 32 * NB
    NCK: tl.constexpr = I // C
    c = tl.program_id(0)
    slot = tl.program_id(1).to(tl.int64)
    e = tl.load(ids_ptr + slot, cache_modifier=".cg").to(tl.int64)
    _glu_chunk(x_ptr, g_ptr, u_ptr, e, e_stride, h_ptr + slot * I + c * C, c, BASE, X0, H, C, PRE, ASM, XA)
    rd = tl.arange(0, RD)[:, None, None, None]
    s = tl.arange(0, 1)[None, :, None, None]
    k = tl.arange(0, 4)[None, None, None, :]
    if PLANES:
        blk = tl.arange(0, NB)[None, None, :, None]
        dbase = d_ptr + e * d_stride + c * (H * 24 * NB)
        hw = dbase.to(tl.pointer_type(tl.int32))
        nw = (dbase + H * 8 * NB).to(tl.pointer_type(tl.int32))
        hp = h_ptr + slot * I + c * C + rd * X0
    else:  # the chunk's blocks within the rows' group of four; h addressed from the group's start
        grp = (c * NB) // 4
        blk = (c * NB) % 4 + tl.arange(0, NB)[None, None, :, None]
        hw = (d_ptr + e * d_stride + grp * 96).to(tl.pointer_type(tl.int32))
        nw = hw
        hp = h_ptr + slot * I + grp * 128 + rd * X0
    base = tl.full([RD, 1, NB, 4], 0, tl.int32) + BASE
    NT: tl.constexpr = H // RD
    pp = part_ptr + (slot * NCK + c) * H
    nxt = _down_load(hw, nw, rd, blk, k, NB, D_STRIDE, PLANES, I)
    for t in range(NT):
        cur = nxt
        nxt = _down_load(hw, nw, tl.minimum(t + 1, NT - 1) * RD + rd, blk, k, NB, D_STRIDE, PLANES, I)
        acc = rr._q5_1_r_fma(tl.zeros([RD, 1, NB, 4], tl.float32), cur, hp, 0, s, blk, k, base, ASM, XA)
        tl.store(pp + t * RD + tl.arange(0, RD), tl.sum(tl.sum(tl.sum(acc, axis=3), axis=2), axis=1))


@triton.jit
def _down_load(hw, nw, rows, blk, k, NB: tl.constexpr, D_STRIDE, PLANES: tl.constexpr, I: tl.constexpr):
    """(nibble words, (d, m) words, qh words) of `rows`, as `gemv_rr._q5_1_r_load` gives them: of the Q5_1_R rows
    at hw (blocks blk of their group), or with PLANES of a chunk's planes."""
    if PLANES:
        hrow = hw + rows * (2 * NB)
        return tl.load(nw + rows * (4 * NB) + blk * 4 + k), tl.load(hrow + blk * D_STRIDE), \
            tl.load(hrow + NB + blk * D_STRIDE)
    return rr._q5_1_r_load(hw + rows * (I // 32 * 6), 0, blk, k, D_STRIDE)


@triton.jit
def _combine_kernel(part_ptr, sw_ptr, gate_ptr, shared_ptr, out_ptr, H, S: tl.constexpr, NCK: tl.constexpr,
                    BH: tl.constexpr, DT: tl.constexpr, GDC: tl.constexpr = False, LATE: tl.constexpr = False):
    """out = round(sum over slots j in order of sw[j] * (sum over chunks c in order of part[j, c])) + round(
    sigmoid(gate) * shared), rounded as `moe._combine_kernel` rounds: the MoE combine taking the partial sums."""
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


def down_planes(rows: torch.Tensor, nb: int) -> torch.Tensor:
    """Q5_1_R expert stacks (E, H, I / 128 * 96) -> the same blocks as column planes, (E, H * I / 32 * 24) uint8:
    per chunk of nb blocks (32 nb columns), [H x (d, m) words of its blocks, then their qh words][H x their 16
    nibble bytes each]."""
    e, h, nbytes = rows.shape
    nblk = nbytes // 24
    w = rows.contiguous().view(torch.int32).reshape(e, h, nblk // 4, 24)
    dm = w[..., 0:4].reshape(e, h, nblk)
    qh = w[..., 4:8].reshape(e, h, nblk)
    nib = w[..., 8:24].reshape(e, h, nblk, 4)
    nck = nblk // nb
    hdr = torch.cat([dm.reshape(e, h, nck, nb), qh.reshape(e, h, nck, nb)], -1).permute(0, 2, 1, 3)
    nbl = nib.reshape(e, h, nck, nb * 4).permute(0, 2, 1, 3)
    planes = torch.cat([hdr.reshape(e, nck, h * 2 * nb), nbl.reshape(e, nck, h * 4 * nb)], -1)
    return planes.contiguous().view(torch.uint8).reshape(e, -1)


_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


class Fused:
    """The one-launch routed experts and the combine of their partial sums for one layer's stacks, in one launch
    shape: NB Q5_1 blocks (32 NB intermediate features) per program, RD down rows per loop step, warps per program,
    GLU K-loop steps loaded at once (PRE), features per combine program (BH); the down read as stored or as column
    planes."""

    def __init__(self, gate_t: torch.Tensor, up_t: torch.Tensor, down: torch.Tensor, nb: int, rd: int,
                 warps: int, pre: int, combine_bh: int, planes: bool = False) -> None:
        """gate_t, up_t: Q4_K_RT stacks (E, I, row bytes); down: the Q5_1_R stack (E, H, row bytes)."""
        self.gate, self.up, self.planes = gate_t, up_t, planes
        self.down = down_planes(down, nb) if planes else down.reshape(down.shape[0], -1)
        self.nb, self.rd, self.warps, self.pre, self.bh = nb, rd, warps, pre, combine_bh

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, sw: torch.Tensor, gate_logit: torch.Tensor,
                 shared: torch.Tensor) -> torch.Tensor:
        k, hid, inter = ids.numel(), x.shape[-1], self.gate.shape[1]
        nck = inter // (32 * self.nb)
        h = torch.empty(k, inter, dtype=x.dtype, device=x.device)
        part = torch.empty(k, nck, hid, dtype=torch.float32, device=x.device)
        cuda = x.device.type == "cuda"
        _fused_kernel[(nck, k)](
            x, self.gate, self.up, self.down, ids, h, part, self.gate.stride(0), self.down.stride(0), 0x3F000000,
            0, 1, H=hid, I=inter, NB=self.nb, RD=self.rd, PRE=max(1, min(self.pre, hid // 512)),
            PLANES=self.planes, ASM=cuda, XA=rr.WIDEN_X_ASM if cuda else False, num_warps=self.warps,
            **pdl.launch(x.device))
        out = torch.empty_like(shared)
        _combine_kernel[(triton.cdiv(hid, self.bh),)](
            part, sw, gate_logit, shared, out, hid, S=k, NCK=nck, BH=self.bh, DT=_TL[x.dtype],
            num_warps=max(1, min(8, self.bh // 32)), **pdl.launch(x.device, "combine"))
        return out


def make_layer(e: int, h: int, inter: int, gen: torch.Generator, device: str) -> dict:
    """One layer's stacks: gate/up as Q4_K_RT (from random Q4_K_R rows), down as Q5_1_R rows."""
    tile = repack.TILE_LAYOUTS[repack.Q4_K_RT_ID]
    gate = repack.tile_major(random_rows("Q4_K_R", (e, inter), h, gen, device), tile.tile, tile.step)
    up = repack.tile_major(random_rows("Q4_K_R", (e, inter), h, gen, device), tile.tile, tile.step)
    down = random_rows("Q5_1_R", (e, h), inter, gen, device)
    return {"gate": gate, "up": up, "down": down}


def pair(layer: dict, x: torch.Tensor, ids: torch.Tensor, sw: torch.Tensor, gate_logit: torch.Tensor,
         shared: torch.Tensor, combine=moe_combine) -> torch.Tensor:
    """The step's launches: GLU, down with the slot sum (ids settled), combine."""
    h_dim, inter = x.shape[-1], layer["gate"].shape[1]
    h = G.gemv_experts_glu(x, layer["gate"], layer["up"], ids, GLU, h_dim, out_dtype=x.dtype)
    routed = G.gemv_experts_sum(h, layer["down"], ids, sw, DOWN, inter, out_dtype=x.dtype, ids_settled=True)
    return combine(routed, gate_logit, shared)


def check(device: str, h: int, inter: int, e: int, slots: int,
          shapes: list[tuple[int, int, int, int, int, bool]], seed: int = 0) -> list[dict]:
    """Each fused shape against the pair's GLU and down on the same weights, combined by the model's formula
    (`moe_combine_ref`; the interpreter truncates casts to bf16, which `moe_combine`'s kernel uses): the largest
    absolute and relative differences of the output and how many of its values differ."""
    gen = torch.Generator(device=device).manual_seed(seed)
    layer = make_layer(e, h, inter, gen, device)
    x = torch.randn(1, h, generator=gen, device=device).to(torch.bfloat16)
    ids = torch.randperm(e, generator=gen, device=device)[:slots].to(torch.int32)
    sw = torch.softmax(torch.randn(slots, generator=gen, device=device), 0).to(torch.bfloat16)
    gate_logit = torch.randn(1, 1, generator=gen, device=device).to(torch.bfloat16)
    shared = (torch.randn(1, h, generator=gen, device=device) * 0.1).to(torch.bfloat16)
    want = pair(layer, x, ids, sw, gate_logit, shared, moe_combine_ref).float()
    rows = []
    for nb, rd, warps, pre, bh, planes in shapes:
        f = Fused(layer["gate"], layer["up"], layer["down"], nb, rd, warps, pre, bh, planes)
        got = f(x, ids, sw, gate_logit, shared).float()
        diff = (got - want).abs()
        rel = (diff / want.abs().clamp_min(1e-30)).max().item()
        rows.append({"shape": [nb, rd, warps, pre, bh, "planes" if planes else "rows"], "max_abs": diff.max().item(),
                     "max_rel": rel, "scale": want.abs().max().item(), "differing": int((diff > 0).sum().item())})
    return rows


SHAPES = [(2, 256, 8, 5, 64, False), (1, 256, 8, 5, 32, False), (4, 128, 8, 5, 64, False),
          (2, 256, 16, 5, 64, False), (2, 256, 8, 5, 64, True), (1, 256, 8, 1, 32, False), (1, 512, 16, 5, 32, False),
          (2, 128, 4, 5, 64, False), (1, 128, 4, 5, 32, False), (4, 256, 16, 5, 64, False), (1, 256, 8, 5, 32, True),
          (4, 128, 8, 5, 64, True)]
"""(NB, RD, warps, PRE, combine BH, planes) of the fused launches timed (planes: the down as column planes)."""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--shapes", type=int, default=len(SHAPES), help="time the first N of SHAPES")
    ap.add_argument("--shape", action="append", default=[], metavar="NB,RD,W,PRE,BH[,planes]",
                    help="time this shape instead (repeatable)")
    args = ap.parse_args()
    shapes = SHAPES[:args.shapes]
    if args.shape:
        shapes = [(*(int(v) for v in a.split(",")[:5]), a.endswith(",planes")) for a in args.shape]
    pdl.set_enabled(True)
    report: dict = {"commit": args.commit, "gpu": torch.cuda.get_device_name(0), "geometry": {
        "hidden": HIDDEN, "inter": INTER, "slots": SLOTS, "layers": LAYERS, "experts_per_stack": EXPERTS}}
    report["check"] = check("cuda", HIDDEN, INTER, EXPERTS, SLOTS, shapes)
    for row in report["check"]:
        print("check", row, flush=True)
    gen = torch.Generator(device="cuda").manual_seed(1)
    layers = [make_layer(EXPERTS, HIDDEN, INTER, gen, "cuda") for _ in range(LAYERS)]
    x = torch.randn(1, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
    ids = [torch.randperm(EXPERTS, generator=gen, device="cuda")[:SLOTS].to(torch.int32) for _ in range(LAYERS)]
    sw = torch.softmax(torch.randn(SLOTS, generator=gen, device="cuda"), 0).to(torch.bfloat16)
    gl = torch.randn(1, 1, generator=gen, device="cuda").to(torch.bfloat16)
    shared = (torch.randn(1, HIDDEN, generator=gen, device="cuda") * 0.1).to(torch.bfloat16)
    rows = []
    calls = [lambda i=i: pair(layers[i], x, ids[i], sw, gl, shared) for i in range(LAYERS)]
    us = time_graph(calls) * 1e6
    rows.append({"launches": "pair (GLU, down + slot sum, combine)", "us_per_layer": us})
    print(f"{'pair':<40}{us:8.2f} us per layer", flush=True)
    for nb, rd, warps, pre, bh, planes in shapes:
        fs = [Fused(lay["gate"], lay["up"], lay["down"], nb, rd, warps, pre, bh, planes) for lay in layers]
        calls = [lambda i=i: fs[i](x, ids[i], sw, gl, shared) for i in range(LAYERS)]
        us = time_graph(calls) * 1e6
        name = f"fused nb={nb} rd={rd} warps={warps} pre={pre} bh={bh}{' planes' if planes else ''}"
        rows.append({"launches": name, "us_per_layer": us})
        print(f"{name:<40}{us:8.2f} us per layer", flush=True)
        del fs
        torch.cuda.empty_cache()
    report["timings"] = rows
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
