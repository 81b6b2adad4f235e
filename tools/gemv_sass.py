"""Offline instruction count of the GEMV kernels (no GPU needed): compile for sm_90, disassemble, count the main loop.

Compiles `strata.kernels.gemv._gemv_kernel` (or the GLU kernel) for a GPUTarget("cuda", 90) with the
constexprs `_launch` would pass for a one-token decode of an N x K matrix of the given type (defaults, or
--bn/--warps/--nb overrides), with the integer/pointer specialization the launcher would apply (ints that are
multiples of 16 and 16-byte aligned pointers marked divisible by 16; the weight pointer is, the strides are when
the row bytes are). It then disassembles the cubin with the nvdisasm shipped inside Triton and reports, for the
K loop body (the block between the loop label and its backward branch):

    regs, spills (local memory), instructions by class, and instructions per weight per thread
    (loop-body instructions / (weights decoded per loop step / threads per program)).

If nvdisasm is missing it falls back to counting PTX instructions in the loop (labelled "ptx").

    python tools/gemv_sass.py Q4_K Q5_1 Q8_0 Q6_K                 # defaults at 10240x2560
    python tools/gemv_sass.py Q4_K --n 640 --k 2560 --bn 2 --warps 4
    python tools/gemv_sass.py Q4_K --dump                          # print the loop body's SASS
    python tools/gemv_sass.py lab:NAME                             # a GemvType defined in tools/gemv_lab.py
    python tools/gemv_sass.py Q4_K_R Q8_0_R Q5_1_R --rr --x fp32    # the row-register kernel (kernels/gemv_rr.py)
    python tools/gemv_sass.py Q4_K_R --rr --out counts.json         # also write the reports as JSON
    python tools/gemv_sass.py Q4_K_R --rr --x-widen 1               # bf16 x widened by inline PTX
    python tools/gemv_sass.py Q4_K_R Q8_0_R Q5_1_R --rr --x q8      # Q8 activations (kernels/gemv_q8x.py)
    python tools/gemv_sass.py Q4_K_R --experts-gemm --kernel glu --n 640 --k 2560   # the prefill's expert GEMM
"""

from __future__ import annotations

import argparse
import collections
import json
import dataclasses
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from strata.kernels import experts_gemm as EG  # noqa: E402
from strata.kernels import gemv as G  # noqa: E402
from strata.kernels import gemv_rr as RR  # noqa: E402
from strata.kernels.offline import compile_experts_gemm, compile_for, compile_rr  # noqa: E402

_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def _spec(v: int) -> tuple[str, bool]:
    """(signature type, divisible by 16) of an int argument as the launcher specializes it."""
    return "i32", v % 16 == 0


def compile_kernel(t: G.GemvType, n: int, k: int, bn: int | None = None, nw: int | None = None,
                   nb: int | None = None, kernel: str = "gemv", x_dtype: str = "bf16", arch: int = 90):
    """The CompiledKernel of one launch of `kernel` ("gemv" or "glu") and its launch facts."""
    if nb is not None:
        t = dataclasses.replace(t, max_chunk_blocks=nb)
    n_chunks, dec = G._decode_args(t, k)
    rows = G._rows(t, 1, bn, n)
    warps = G._warps(t, 1, nw, n)
    w_ty = {None: "*u8"}.get(t.dense_dtype, {"F32": "*fp32", "F16": "*fp16", "BF16": "*bf16"}.get(t.name, "*u8"))
    rb = G.row_bytes(t.type_id, k) if t.type_id >= 0 else k // t.block_elems * t.block_bytes
    row_stride = k if t.dense_dtype is not None else rb
    if kernel == "gemv":
        fn = G._gemv_kernel
        ints = dict(N=n, n_chunks=n_chunks, w_row_stride=row_stride, w_slot_stride=0, x_tok_stride=k,
                    x_slot_stride=0, out_tok_stride=n, out_slot_stride=0)
        ptrs = dict(x_ptr=f"*{x_dtype}", w_ptr=w_ty, ids_ptr=w_ty, tab_ptr="*fp32" if t.table else w_ty,
                    out_ptr="*fp32", part_ptr="*fp32", cnt_ptr="*i32", sw_ptr="*fp32")
        consts = dict(dec, BN=rows, T=1, T_PAD=1, HAS_IDS=False, SPLIT=1, SLOT_SUM=0, GDC=False)
        tile_rows = rows
    elif kernel == "glu":
        fn = G._glu_kernel
        rows = max(2, rows // 2)
        ints = dict(N=n, n_chunks=n_chunks, g_row_stride=row_stride, u_row_stride=row_stride, g_slot_stride=0,
                    u_slot_stride=0, x_tok_stride=k, x_slot_stride=0, out_tok_stride=n, out_slot_stride=0)
        ptrs = dict(x_ptr=f"*{x_dtype}", g_ptr=w_ty, u_ptr=w_ty, ids_ptr=w_ty, tab_ptr="*fp32" if t.table else w_ty,
                    out_ptr="*fp32", part_ptr="*fp32", cnt_ptr="*i32")
        consts = dict(dec, BN=rows, T=1, T_PAD=1, HAS_IDS=False, ACT="silu", ALIGN=16 if rb % 16 == 0 else 1,
                      SPLIT=1, GDC=False)
        tile_rows = 2 * rows
    else:
        raise ValueError(kernel)
    ck = compile_for(fn, ptrs, ints, consts, warps, arch)
    weights = tile_rows * dec["CHUNK_X"]
    return ck, dict(type=t.name, n=n, k=k, kernel=kernel, BN=rows, warps=warps, NB=dec["NB"],
                    weights_per_thread=weights / (warps * 32))


_CLASSES = [
    ("LDG", re.compile(r"^LDG")), ("LDS", re.compile(r"^LDS")), ("STS", re.compile(r"^STS")),
    ("LDSM", re.compile(r"^LDSM")), ("STG", re.compile(r"^STG")),
    ("FFMA", re.compile(r"^FFMA")), ("FADD", re.compile(r"^FADD")), ("FMUL", re.compile(r"^FMUL")),
    ("HADD2/HFMA2", re.compile(r"^H(ADD|FMA|MUL)2")),
    ("I2F/F2F/F2I", re.compile(r"^(I2F|F2F|F2I|I2FP|F2FP)")),
    ("LOP3", re.compile(r"^LOP3")), ("SHF", re.compile(r"^SHF")), ("PRMT", re.compile(r"^PRMT")),
    ("IMAD", re.compile(r"^IMAD")), ("IADD3/VIADD/LEA", re.compile(r"^(IADD3|VIADD|LEA|IADD)")),
    ("SEL/ISETP/FSEL", re.compile(r"^(SEL|ISETP|FSEL|FSETP|VIMNMX|IMNMX)")),
    ("SGXT/BFE/BMSK", re.compile(r"^(SGXT|BFE|BMSK|BFI)")),
    ("MOV", re.compile(r"^(MOV|UMOV)")), ("BAR", re.compile(r"^BAR")), ("SHFL", re.compile(r"^SHFL")),
    ("uniform", re.compile(r"^U")), ("BRA", re.compile(r"^BRA")), ("HMMA/WGMMA", re.compile(r"^(HMMA|HGMMA)")),
]


def _opcode(line: str) -> str | None:
    m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
    return m.group(2) if m else None


def sass_loop(cubin: bytes) -> tuple[list[str], int, int, int]:
    """(the K loop body's SASS lines, registers, local-memory bytes, the kernel's instructions) of a one-function
    cubin. The loop is the longest span between a label and a later backward branch to it."""
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "k.cubin"
        f.write_bytes(cubin)
        text = subprocess.run([str(_BIN / "nvdisasm"), "-c", str(f)], check=True, capture_output=True,
                              text=True).stdout
        res = subprocess.run([str(_BIN / "cuobjdump"), "-res-usage", str(f)], check=True, capture_output=True,
                             text=True).stdout
    regs = int(re.search(r"REG:(\d+)", res).group(1))
    local = int(re.search(r"LOCAL:(\d+)", res).group(1))
    lines = text.splitlines()
    labels = {m.group(1): i for i, l in enumerate(lines) if (m := re.match(r"^(\.L_x_\d+):", l))}
    best = None
    for i, l in enumerate(lines):
        m = re.search(r"BRA\s+`\((\.L_x_\d+)\)", l)
        if m and labels.get(m.group(1), 1 << 30) < i:
            span = (labels[m.group(1)], i)
            if best is None or span[1] - span[0] > best[1] - best[0]:
                best = span
    body = [l for l in lines[best[0]:best[1] + 1] if _opcode(l)] if best else []
    return body, regs, local, sum(1 for l in lines if _opcode(l))


def classify(body: list[str]) -> dict[str, int]:
    counts: dict[str, int] = collections.Counter()
    for l in body:
        op = _opcode(l)
        if op.startswith("LDG"):
            width = re.search(r"\.(U8|S8|U16|S16|64|128)\b", op)
            counts["LDG." + (width.group(1) if width else "32")] += 1
            continue
        for name, rx in _CLASSES:
            if rx.match(op):
                counts[name] += 1
                break
        else:
            counts["other:" + op.split(".")[0]] += 1
    return dict(counts)


def ptx_loop_count(ptx: str) -> int:
    """PTX fallback: instructions between the first loop label and its backward branch."""
    lines = [l.strip() for l in ptx.splitlines()]
    labels = {l[:-1]: i for i, l in enumerate(lines) if re.match(r"^\$L__BB\d+_\d+:$", l)}
    best = 0
    for i, l in enumerate(lines):
        m = re.search(r"bra(\.uni)?\s+(\$L__BB\d+_\d+);", l)
        if m and labels.get(m.group(2), 1 << 30) < i:
            best = max(best, sum(1 for x in lines[labels[m.group(2)]:i + 1]
                                 if x and not x.startswith(("$", "//", "{", "}", "."))))
    return best


def analyze(t: G.GemvType, n: int, k: int, bn=None, nw=None, nb=None, kernel="gemv", dump=False,
            x_dtype: str = "bf16") -> dict:
    if kernel.startswith("rr"):
        ck, facts = compile_rr(t.name, n, k, glu=kernel == "rr glu", x=x_dtype, q8x=x_dtype == "q8")
    elif kernel.startswith("gemm"):
        EG.BLOCK_N, EG.NUM_WARPS = bn or EG.BLOCK_N, nw or EG.NUM_WARPS
        glu = kernel == "gemm glu"
        ck = compile_experts_gemm(t.name, n, k, glu=glu, x=x_dtype)
        cx = EG._chunk(t, k)[1]
        facts = dict(type=t.name, n=n, k=k, kernel=kernel, BN=EG.BLOCK_N, warps=EG.NUM_WARPS, NB=cx // t.block_elems,
                     x=x_dtype, weights_per_thread=(2 if glu else 1) * EG.BLOCK_N * cx / (32 * EG.NUM_WARPS))
    else:
        ck, facts = compile_kernel(t, n, k, bn, nw, nb, kernel, x_dtype)
    ttgir = ck.asm["ttgir"]
    facts["convert_layout"] = ttgir.count("ttg.convert_layout")
    facts["local_alloc"] = ttgir.count("ttg.local_alloc")
    try:
        body, regs, local, total = sass_loop(ck.asm["cubin"])
        facts.update(regs=regs, spill_bytes=local, loop_instrs=len(body), source="sass", kernel_instrs=total)
        if kernel.startswith("rr"):  # instructions a thread executes per weight, the loop counted per iteration
            steps = k // RR.CHUNK[t.name][0] // facts["NB"]
            pre = RR.preload_steps(t.name, steps)
            iters = (steps if pre == 1 else steps - pre) if len(body) > 1 else 0  # no loop left: unrolled
            facts["kernel_instr_per_weight"] = (total + len(body) * (iters - 1)) / (facts["weights_per_thread"] * steps)
        facts["classes"] = classify(body)
        if dump:
            print("\n".join(body))
    except (FileNotFoundError, subprocess.CalledProcessError):
        facts.update(loop_instrs=ptx_loop_count(ck.asm["ptx"]), source="ptx")
    facts["instr_per_weight"] = facts["loop_instrs"] / facts["weights_per_thread"]
    return facts


def _resolve(name: str) -> G.GemvType:
    if name.startswith("lab:"):
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import gemv_lab  # noqa: PLC0415
        return gemv_lab.LAB_TYPES.get(name[4:]) or getattr(gemv_lab, name[4:])
    return G.gemv_type(name)


def report(f: dict) -> str:
    cls = f.get("classes", {})
    ldg = " ".join(f"{c}={v}" for c, v in sorted(cls.items()) if c.startswith("LDG"))
    rest = " ".join(f"{c}={v}" for c, v in sorted(cls.items(), key=lambda kv: -kv[1]) if not c.startswith("LDG"))
    return (f"{f['type']:<8} {f['kernel']:<4} {f['n']}x{f['k']} BN={f['BN']} warps={f['warps']} NB={f['NB']}: "
            f"regs={f.get('regs')} spill={f.get('spill_bytes')} loop={f['loop_instrs']} ({f['source']}) "
            f"w/thread={f['weights_per_thread']:g} -> {f['instr_per_weight']:.2f} instr/weight; "
            f"convert_layout={f['convert_layout']}"
            + (f"; executed per weight {f['kernel_instr_per_weight']:.2f}" if "kernel_instr_per_weight" in f else "")
            + f"\n    {ldg}\n    {rest}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("types", nargs="+", help="type names (Q4_K ...) or lab:NAME for a GemvType in gemv_lab.py")
    ap.add_argument("--n", type=int, default=10240)
    ap.add_argument("--k", type=int, default=2560)
    ap.add_argument("--bn", type=int, default=None)
    ap.add_argument("--warps", type=int, default=None)
    ap.add_argument("--nb", type=int, default=None, help="blocks per loop step (max_chunk_blocks)")
    ap.add_argument("--kernel", default="gemv", choices=("gemv", "glu"))
    ap.add_argument("--dump", action="store_true", help="print the loop body's SASS")
    ap.add_argument("--no-prefetch", action="store_true", help="the decoder whole (no load/unpack pipelining)")
    ap.add_argument("--rr", action="store_true", help="the row-register kernel (kernels/gemv_rr.py) of a *_R type")
    ap.add_argument("--experts-gemm", action="store_true",
                    help="the prefill's grouped expert GEMM (kernels/experts_gemm.py; --kernel glu: gate/up); "
                         "--bn/--warps set its BLOCK_N/NUM_WARPS; instructions per weight decoded per thread")
    ap.add_argument("--x", default="bf16", choices=("bf16", "fp32", "q8"),
                    help="x's element type (default bf16; q8: Q8 activations, `gemv_q8x`, with --rr)")
    ap.add_argument("--x-widen", default=None, choices=("0", "1", "free"),
                    help="the row-register kernel with bf16 x widened by inline PTX (1), by .to(float32) (0) or "
                         "not at all (free: a timing probe, wrong values); default: gemv_rr.WIDEN_X_ASM")
    ap.add_argument("--out", default=None, help="also write the reports as JSON here")
    args = ap.parse_args()
    if args.x_widen is not None:
        RR.WIDEN_X_ASM = "free" if args.x_widen == "free" else args.x_widen == "1"
    facts = []
    for name in args.types:
        t = _resolve(name)
        if args.no_prefetch:
            t = dataclasses.replace(t, load=None, unpack=None)
        kernel = ("rr glu" if args.kernel == "glu" else "rr") if args.rr else args.kernel
        if args.experts_gemm:
            kernel = "gemm glu" if args.kernel == "glu" else "gemm"
        f = analyze(t, args.n, args.k, args.bn, args.warps, args.nb, kernel, args.dump, args.x)
        facts.append(f)
        print(report(f))
    if args.out:
        Path(args.out).write_text(json.dumps(dict(triton=triton.__version__, reports=facts), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
