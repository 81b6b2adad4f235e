"""Kernels compiled for a GPU on a machine without one.

Triton compiles for a `GPUTarget` with no device present. The CPU tests read the PTX of what the interpreter never
runs this way (the PDL wait and release points, `tests/test_kernels_pdl_order.py`), and `tools/gemv_sass.py`
counts the GEMVs' SASS instructions.
"""

from __future__ import annotations

import triton
from triton.backends.compiler import GPUTarget


def compile_for(fn, ptrs: dict[str, str], ints: dict[str, int | float], consts: dict, num_warps: int,
                arch: int = 90) -> triton.compiler.CompiledKernel:
    """`fn` (a `triton.jit` function) compiled for sm_`arch`, specialised as a launch would specialise it: every
    pointer (`ptrs`: argument -> type, "*bf16") 16-byte aligned, ints equal to 1 made constants (unless the
    kernel does not specialise them), ints divisible by 16 marked so, floats fp32, large ints i64. Every argument
    is in `ptrs`, `ints` or `consts` (the constexprs); a missing one raises KeyError naming it."""
    sig, attrs, consts = {}, {}, dict(consts)
    for i, a in enumerate(fn.arg_names):
        if a in consts:
            sig[a] = "constexpr"
        elif a in ptrs:
            sig[a] = ptrs[a]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif a in ints:
            v = ints[a]
            if isinstance(v, float):
                sig[a] = "fp32"
                continue
            if v == 1 and a not in fn.do_not_specialize:
                sig[a] = "constexpr"
                consts[a] = 1
                continue
            sig[a] = "i64" if abs(v) >= 2 ** 31 else "i32"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            raise KeyError(f"{fn.__name__}: no value for argument {a!r}")
    src = triton.compiler.ASTSource(fn, sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=num_warps))


def compile_rr(kind: str, n: int, k: int, *, glu: bool = False, x: str = "bf16", has_ids: bool = False,
               ids_early: bool = False, release: int | None = None, widen: bool | None = None, gdc: bool = False,
               shape: tuple[int, int, int] | None = None, q8x: bool = False, probe: bool = False, arch: int = 90,
               ) -> tuple[triton.compiler.CompiledKernel, dict]:
    """One one-token launch of `gemv_rr._rr_kernel` over n rows of k weights of `kind` (its `launch_shape`, or
    `shape` = (rows, chunks per step, warps); no K split, bf16 output), compiled for sm_`arch`, and its launch
    facts. release: a `gemv_rr.RELEASE` mode (AFTER_LOOP when None); widen: `gemv_rr.WIDEN_X_ASM` when None;
    gdc: with PDL; q8x: x as Q8 activations (`gemv_q8x`; `x` is then ignored). A tile-major kind compiles as its
    launches do: its row-major twin's loop with TILE."""
    from strata.kernels import gemv, gemv_rr

    base, tile, _ = gemv_rr.TILE_MAJOR.get(kind, (kind, 0, 0))
    widen = gemv_rr.WIDEN_X_ASM if widen is None else widen
    elems, chunk_bytes = gemv_rr.CHUNK[kind]
    n_chunks = k // elems
    br, sbc, warps = shape or gemv_rr.launch_shape(kind, n_chunks, -(-n // 8))[:3]
    rb = n_chunks * chunk_bytes
    ptrs = dict(x_ptr="*i8" if q8x else f"*{x}", g_ptr="*u8", u_ptr="*u8", ids_ptr="*i32", out_ptr="*bf16", part_ptr="*fp32",
                cnt_ptr="*i32", sw_ptr="*fp32", q_ptr="*i8", probe_ptr="*i64")
    ints = dict(N=n, g_row_stride=rb, u_row_stride=rb, g_slot_stride=rb * n, u_slot_stride=rb * n, x_slot_stride=0,
                out_slot_stride=0, q_slot_stride=0, BASE=gemv_rr._BASE[kind], X_ROW_STRIDE=0, D_STRIDE=1)
    consts = dict(KIND=base, CHUNK_ELEMS=elems, CHUNK_BYTES=chunk_bytes, NCH=n_chunks, SBC=sbc, BR=br, GLU=glu,
                  HAS_IDS=has_ids, ASM=True, SPLIT_SUM=gemv._split_sum, SPLIT=1, SLOT_SUM=0, IDS_EARLY=ids_early,
                  RELEASE=gemv_rr.AFTER_LOOP if release is None else release,
                  PRE=gemv_rr.preload_steps(kind, n_chunks // sbc, q8x), XW=widen, XQ=q8x, QOUT=0, PROBE=probe,
                  TILE=tile, GDC=gdc)
    ck = compile_for(gemv_rr._rr_kernel, ptrs, ints, consts, warps, arch)
    return ck, dict(type=kind, n=n, k=k, kernel="rr glu" if glu else "rr", BN=br, warps=warps, NB=sbc,
                    x="q8" if q8x else x,
                    x_widen=widen, weights_per_thread=br * sbc * elems / (warps * 32))


def compile_experts_gemm(kind: str, n: int, k: int, *, glu: bool = False, x: str = "bf16", bm: int = 16,
                         arch: int = 90) -> triton.compiler.CompiledKernel:
    """One launch of `experts_gemm._experts_gemm_kernel` (gate/up with `glu`, else down) over expert stacks of n
    rows of k weights of `kind`, x of type `x` ("bf16", "fp32"), tiles of `bm` slots, with PDL, for
    sm_`arch`: what a prefill on that GPU compiles."""
    from strata.kernels import experts_gemm as eg
    from strata.kernels import gemv

    t = gemv.gemv_type(kind)
    nb, cx, chunk_w = eg._chunk(t, k)
    w_type = {None: "*u8", "float32": "*fp32", "bfloat16": "*bf16", "float16": "*fp16"}[
        None if t.dense_dtype is None else str(t.dense_dtype).split(".")[-1]]
    row = k if t.dense_dtype is not None else gemv.row_bytes(kind, k)
    out = ("*" + x) if glu else "*fp32"
    ptrs = dict(x_ptr=f"*{x}", w_ptr=w_type, u_ptr=w_type, tab_ptr="*fp32" if t.table == "IQ4" else
                "*i32" if t.table else w_type, tiles_ptr="*i32", x_rows_ptr="*i64", out_rows_ptr="*i64", out_ptr=out)
    ints = dict(N=n, n_chunks=k // cx, n_tiles=832, x_stride=k, w_row_stride=row, w_expert_stride=row * n,
                out_stride=n)
    load, unpack = eg.decoder(t)
    consts = dict(LOAD=load, UNPACK=unpack, CHUNK_W=chunk_w, CX=cx, NB=nb,
                  BM=bm, BN=eg.BLOCK_N, GLU=glu, X_ROWS=glu, OUT_ROWS=not glu, ACT="silu", F32_DOT=x == "fp32",
                  GDC=True, **gemv.tile_args(t, k, chunk_w))
    return compile_for(eg._experts_gemm_kernel, ptrs, ints, consts, eg.NUM_WARPS, arch)
