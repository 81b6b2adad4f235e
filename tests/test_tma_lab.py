"""tools/tma_lab.py's kernels under Triton's interpreter (the timing runs on the device box): the descriptor read
sums every word once, whatever the program count and stages; the BF16 and the planar Q8_0 and 4-bit GEMVs, by
descriptor and by plain loads, equal the dequantised product, every row block (the persistent programs' items)
written. Compiled for sm_90 (offline, in a subprocess without the interpreter), the descriptor forms fetch their
tiles by bulk copies, one per plane and pipeline stage, and the plain-load forms by none.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

if __name__ != "__main__":  # the test process (the compiling subprocess runs this file without it)
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from tests.tool_module import load_tool  # noqa: E402

lab = load_tool("tma_lab")
BULK = re.compile(r"cp\.async\.bulk\.tensor")
STAGES = 4


@pytest.mark.parametrize("programs,bm,stages", [(1, 8, 2), (3, 8, 3), (5, 16, 2)])
def test_descriptor_read_sums_every_word_once(programs: int, bm: int, stages: int) -> None:
    g = torch.Generator().manual_seed(programs * 100 + bm)
    rows = 48
    words = torch.randint(-1000, 1000, (rows, lab.COLS), dtype=torch.int32, generator=g)
    out = torch.zeros(programs, dtype=torch.int32)
    desc = TensorDescriptor.from_tensor(words, [bm, lab.COLS])
    lab._read_tma[(programs,)](desc, out, -(-rows // bm), BM=bm, STAGES=stages)
    assert int(out.sum()) == int(words.sum())


@pytest.mark.parametrize("tma", [False, True])
def test_bf16_gemv(tma: bool) -> None:
    g = torch.Generator().manual_seed(1 + tma)
    n, k, br, bk = 24, 640, 4, 128  # K not a power of two, as at the real geometry
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    x = torch.randn(k, generator=g).to(torch.bfloat16)
    y = torch.full((n,), float("nan"))
    desc = TensorDescriptor.from_tensor(w, [br, bk]) if tma else w
    lab._gemv_bf16[(4,)](desc, w, x, y, n // br, K=k, BR=br, BK=bk, TMA=tma, STAGES=2)
    torch.testing.assert_close(y, w.float() @ x.float(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("programs", [1, 3])
def test_planar_q8_gemv(tma: bool, programs: int) -> None:
    g = torch.Generator().manual_seed(programs + 10 * tma)
    n, k, br = 40, 768, 8
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    d = (torch.rand(n, k // 32, generator=g) * 0.01).to(torch.float16)
    x = torch.randn(k, generator=g).to(torch.bfloat16)
    want = (q.float().view(n, -1, 32) * d.float()[:, :, None]).view(n, k) @ x.float()
    nb = n // br
    qd = TensorDescriptor.from_tensor(q, [br, 256]) if tma else q
    dd = TensorDescriptor.from_tensor(d, [br, 8]) if tma else d
    y = torch.full((n,), float("nan"))
    lab._gemv_planes[(programs,)](qd, dd, dd, q, d, d, x, y, nb, -(-nb // programs), K=k, BR=br, BITS=8, TMA=tma,
                                  STAGES=2)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("programs", [1, 3])
def test_planar_q4_gemv(tma: bool, programs: int) -> None:
    g = torch.Generator().manual_seed(7 + programs + 10 * tma)
    n, k, br = 40, 768, 8
    q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    sc = (torch.rand(n, k // 32, generator=g) * 0.01).to(torch.float16)
    mn = (torch.rand(n, k // 32, generator=g) * 0.01).to(torch.float16)
    x = torch.randn(k, generator=g).to(torch.bfloat16)
    dense = lab.q4p_dense(q, sc, mn)
    assert dense[0, 1] == (q[0, 1] & 15).float() * sc[0, 0].float() - mn[0, 0].float()  # the layout as documented
    assert dense[0, 128 + 33] == (q[0, 33] >> 4).float() * sc[0, 5].float() - mn[0, 5].float()
    nb = n // br
    planes = (q, sc, mn)
    descs = tuple(TensorDescriptor.from_tensor(t, box) for t, box in zip(planes, ([br, 128], [br, 8], [br, 8]))) \
        if tma else planes
    y = torch.full((n,), float("nan"))
    lab._gemv_planes[(programs,)](*descs, *planes, x, y, nb, -(-nb // programs), K=k, BR=br, BITS=4, TMA=tma,
                                  STAGES=2)
    torch.testing.assert_close(y, dense @ x.float(), rtol=1e-5, atol=1e-4)


def _planes_ptx(bits: int, tma: bool) -> str:
    """`_gemv_planes` at the real K for sm_90, 16 rows a block, STAGES stages."""
    import triton
    from triton.backends.compiler import GPUTarget

    q, qw = ("i8", 256) if bits == 8 else ("u8", 128)
    sig = {"qd": f"tensordesc<{q}[16, {qw}]>" if tma else f"*{q}", "sd": "tensordesc<fp16[16, 8]>" if tma else "*fp16",
           "md": "tensordesc<fp16[16, 8]>" if tma else "*fp16", "qp": f"*{q}", "sp": "*fp16", "mp": "*fp16",
           "x": "*bf16", "y": "*fp32", "nblocks": "i32", "per": "i32"}
    consts = {"K": 2560, "BR": 16, "BITS": bits, "TMA": tma, "STAGES": STAGES}
    src = triton.compiler.ASTSource(lab._gemv_planes, {**sig, **{k: "constexpr" for k in consts}}, constexprs=consts)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4)).asm["ptx"]


def test_descriptor_forms_compile_to_bulk_copies_for_sm90() -> None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": root}
    run = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    counts = dict(line.split() for line in run.stdout.split("\n") if line.startswith("planes"))
    counts = {k: int(v) for k, v in counts.items()}
    # the pipeliner issues one bulk copy per plane for each stage in flight (prologue and loop body)
    assert counts == {"planes8-tma": 2 * STAGES, "planes4-tma": 3 * STAGES, "planes8-regs": 0, "planes4-regs": 0}


if __name__ == "__main__":  # the test's subprocess: compile for sm_90 and count the bulk copies
    for bits in (8, 4):
        for tma in (True, False):
            print(f"planes{bits}-{'tma' if tma else 'regs'}", len(BULK.findall(_planes_ptx(bits, tma))))
