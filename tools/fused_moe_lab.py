"""The routed experts' GLU and down projections in one launch with no dependency between its programs, by launch
shape and by how the down projections are laid out (a lab; run on the device box, the kernel check also under
TRITON_INTERPRET=1).

In the decode step the routed GLU and the routed down projections were a PDL pair: the down's programs wait for
the whole GLU, then read h, multiply and sum the slots (~23 us of a GDN layer's path on an H100 from the routing's
end, against ~12 us in which one launch can merely stream both launches' bytes, `tools/stream_lab.py`).
`strata.kernels.moe_fused` makes program (chunk c, slot s) compute h for 32 NB intermediate features of its
slot's expert and then that expert's down projection over those columns for all H rows: partial products the MoE
combine adds. Here it is timed against the pair, in several launch shapes, with the down read as stored (Q5_1_R
rows: NB blocks of each row's 96-byte group) and re-laid as column planes (`down_planes`: [I / C chunks][H rows x
2 NB header words][H rows x 4 NB nibble words], so that a program's down bytes are two contiguous runs).

Timed as 48 layers back to back in a CUDA graph with PDL, each layer its own stacks (64 experts each, the slots'
experts random): the step's pair (GLU, down with the slot sum, combine) against the one launch and the combine of
its partial sums.

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
from strata.kernels import gemv_rr as rr  # noqa: E402
from strata.kernels import moe_fused, pdl  # noqa: E402
from strata.kernels.moe import moe_combine  # noqa: E402
from strata.model.moe import PartialSums, moe_combine_ref  # noqa: E402
from strata.weights import repack  # noqa: E402
from tools.gpu_check_gemv import time_graph  # noqa: E402

HIDDEN, INTER, SLOTS, LAYERS, EXPERTS = 2560, 640, 10, 48, 64
Q4_K_RT_TILE, Q4_K_RT_STEP = 4, 288
GLU, DOWN = moe_fused.GLU_TYPE, moe_fused.DOWN_TYPE


@triton.jit
def _planes_kernel(x_ptr, g_ptr, u_ptr, d_ptr, ids_ptr, h_ptr, part_ptr, e_stride, d_stride, BASE, X0, D_STRIDE,
                   H: tl.constexpr, I: tl.constexpr, NB: tl.constexpr, RD: tl.constexpr, PRE: tl.constexpr,
                   ASM: tl.constexpr, XA: tl.constexpr, GDC: tl.constexpr = False):
    """`moe_fused._experts_kernel` with the down read from column planes (`down_planes`): a program's down bytes
    are two contiguous runs instead of NB blocks of every row's 96-byte group."""
    c, slot, e = moe_fused.program_slot(ids_ptr, GDC)
    C: tl.constexpr = 32 * NB
    NCK: tl.constexpr = I // C
    hp = h_ptr + slot * I + c * C
    moe_fused.glu_chunk(x_ptr, g_ptr, u_ptr, e, e_stride, hp, c, BASE, X0, H, C, PRE, ASM, XA)
    dbase = d_ptr + e * d_stride + c * (H * 24 * NB)
    hw = dbase.to(tl.pointer_type(tl.int32))
    nw = (dbase + H * 8 * NB).to(tl.pointer_type(tl.int32))
    rd = tl.arange(0, RD)[:, None, None, None]
    s = tl.arange(0, 1)[None, :, None, None]
    blk = tl.arange(0, NB)[None, None, :, None]
    k = tl.arange(0, 4)[None, None, None, :]
    xd = hp + rd * X0
    base = tl.full([RD, 1, NB, 4], 0, tl.int32) + BASE
    NT: tl.constexpr = H // RD
    pp = part_ptr + (slot * NCK + c) * H
    nxt = _planes_load(hw, nw, rd, blk, k, NB, D_STRIDE)
    for t in range(NT):
        cur = nxt
        nxt = _planes_load(hw, nw, tl.minimum(t + 1, NT - 1) * RD + rd, blk, k, NB, D_STRIDE)
        acc = rr._q5_1_r_fma(tl.zeros([RD, 1, NB, 4], tl.float32), cur, xd, 0, s, blk, k, base, ASM, XA)
        tl.store(pp + t * RD + tl.arange(0, RD), tl.sum(tl.sum(tl.sum(acc, axis=3), axis=2), axis=1))


@triton.jit
def _planes_load(hw, nw, rows, blk, k, NB: tl.constexpr, D_STRIDE):
    """(nibble words, (d, m) words, qh words) of `rows` of a chunk's planes, as `gemv_rr._q5_1_r_load` gives them."""
    hrow = hw + rows * (2 * NB)
    return tl.load(nw + rows * (4 * NB) + blk * 4 + k), tl.load(hrow + blk * D_STRIDE), \
        tl.load(hrow + NB + blk * D_STRIDE)


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


class Fused:
    """The one-launch routed experts and the combine of their partial sums for one layer's stacks: as the step
    runs them (`moe_fused`, the down as stored), or with the down as column planes (`planes`)."""

    def __init__(self, gate_t: torch.Tensor, up_t: torch.Tensor, down: torch.Tensor, nb: int, rd: int,
                 warps: int, pre: int, combine_bh: int, planes: bool = False) -> None:
        """down: the Q5_1_R stack (E, H, row bytes), of which `planes` makes column planes."""
        self.gate, self.up, self.down = (gate_t, GLU), (up_t, GLU), (down, DOWN)
        self.planes = down_planes(down, nb) if planes else None
        self.shape = moe_fused.Shape(nb, rd, warps, pre, combine_bh)

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, sw: torch.Tensor, gate_logit: torch.Tensor,
                 shared: torch.Tensor) -> torch.Tensor:
        if self.planes is None:
            parts = moe_fused.experts(x, self.gate, self.up, self.down, ids, sw, self.shape)
        else:
            parts = self._planes(x, ids, sw)
        return moe_fused.combine_parts(parts, gate_logit, shared, self.shape)

    def _planes(self, x: torch.Tensor, ids: torch.Tensor, sw: torch.Tensor) -> PartialSums:
        k, hid, inter, sh = ids.numel(), x.shape[-1], self.gate[0].shape[1], self.shape
        nck = inter // (32 * sh.nb)
        h = torch.empty(k, inter, dtype=x.dtype, device=x.device)
        part = torch.empty(k * nck, hid, dtype=torch.float32, device=x.device)
        cuda = x.device.type == "cuda"
        _planes_kernel[(nck, k)](
            x, self.gate[0], self.up[0], self.planes, ids, h, part, self.gate[0].stride(0), self.planes.stride(0),
            0x3F000000, 0, 1, H=hid, I=inter, NB=sh.nb, RD=sh.rd, PRE=max(1, min(sh.pre, hid // 512)), ASM=cuda,
            XA=rr.WIDEN_X_ASM if cuda else False, num_warps=sh.warps, **pdl.launch(x.device))
        return PartialSums(part.view(k, nck, hid), sw, x.dtype)


def random_q(name: str, shape: tuple[int, ...], k: int, gen: torch.Generator, device: str) -> torch.Tensor:
    """Random stored rows of a block type (`tools/gpu_check_gemv.random_rows`, on any device)."""
    t = G.gemv_type(name)
    nb = k // t.block_elems
    data = torch.randint(0, 256, (*shape, nb, t.block_bytes), dtype=torch.uint8, generator=gen, device=device)
    for off in t.f16_fields:
        mag = torch.rand((*shape, nb), generator=gen, device=device) * 0.015 + 0.005
        sign = torch.randint(0, 2, (*shape, nb), generator=gen, device=device) * 2 - 1
        data[..., off:off + 2] = (mag * sign).to(torch.float16).view(torch.uint8).reshape(*shape, nb, 2)
    return data.reshape(*shape, nb * t.block_bytes)


def make_layer(e: int, h: int, inter: int, gen: torch.Generator, device: str) -> dict:
    """One layer's stacks: gate/up as Q4_K_RT (from random Q4_K_R rows), down as Q5_1_R rows."""
    gate = repack.tile_major(random_q("Q4_K_R", (e, inter), h, gen, device), Q4_K_RT_TILE, Q4_K_RT_STEP)
    up = repack.tile_major(random_q("Q4_K_R", (e, inter), h, gen, device), Q4_K_RT_TILE, Q4_K_RT_STEP)
    down = random_q("Q5_1_R", (e, h), inter, gen, device)
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
