"""tools/tma_lab.py's kernels under Triton's interpreter (the timing runs on the device box): the descriptor read
sums every word once, whatever the program count and stages; the BF16 and the planar Q8_0 and 4-bit GEMVs, by
descriptor and by plain loads, equal the dequantised product, every row block (the persistent programs' items)
written."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from tests.tool_module import load_tool  # noqa: E402

lab = load_tool("tma_lab")


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
