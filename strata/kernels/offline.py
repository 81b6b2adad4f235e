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
