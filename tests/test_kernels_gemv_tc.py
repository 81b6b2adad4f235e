"""The tensor-core Q4_K GEMV (strata.kernels.gemv_tc) against "dequantize, then x @ W^T in float64", on the CPU.

Under Triton's interpreter the tiles are fp32 and the dot is IEEE fp32 (the interpreter's dot mishandles 16-bit
tiles); the integers q and x (bfloat16 values) are exact in fp32 either way, so what is checked is the layout:
which nibble meets which x, which scale and min each sub-block gets. The GPU's own tile path (bf16 nibbles from
inline PTX, the tensor cores) is checked against the same reference by tools/gemv_tc_lab.py on the device.
Tolerance as tests/test_kernels_gemv.py: a misplaced weight or scale moves an output by ~1e-3 of sum |w x|.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton: the kernels run on the CPU

import importlib

import numpy as np
import pytest
import torch
import triton  # noqa: F401  (a missing triton fails this module; it never skips)
from triton.runtime.interpreter import InterpretedFunction

import strata.kernels.gemv as _gemv
import strata.kernels.gemv_blocks as _blocks
import strata.kernels.gemv_tc as _tc
import strata.kernels.pdl as _pdl
from strata.errors import StrataError
from strata.weights import quants

if not isinstance(_tc._tc_rows, InterpretedFunction):
    for _m in (_pdl, _blocks, _gemv, _tc):
        importlib.reload(_m)
TC = _tc
G = _gemv

RTOL = 1e-5


def q4k_rows(rows: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """(rows, row_bytes) Q4_K: random bytes, d and dmin +-[0.005, 0.02]."""
    n = rows * (k // 256)
    raw = rng.integers(0, 256, size=(n, 144), dtype=np.uint8)
    for off in (0, 2):
        v = (rng.uniform(0.005, 0.02, size=n) * rng.choice([-1.0, 1.0], size=n)).astype(np.float16)
        raw[:, off:off + 2] = v.view(np.uint8).reshape(n, 2)
    return torch.from_numpy(raw.reshape(rows, -1))


def rel_err(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    xd = x.double()
    return ((y.double() - xd @ w.T).abs() / (xd.abs() @ w.abs().T)).max().item()


def test_gemv_tc_plain() -> None:
    """Two chunks (K = 1024), 40 rows: two full row tiles of 16 and a partial one."""
    rng = np.random.default_rng(11)
    k = 1024
    raw = q4k_rows(40, k, rng)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    w = quants.dequantize(raw, 12, k).double()
    for prebuilt in (False, True):
        y = TC.gemv_tc(x, raw, "Q4_K", k, block_n=16, x_prebuilt=prebuilt)
        assert y.shape == (1, 40) and y.dtype == torch.float32
        assert rel_err(y, x, w) <= RTOL


@pytest.mark.parametrize("pipe", [False, True])
def test_gemv_tc_experts_glu_matches_cuda_core(pipe: bool) -> None:
    """The routed GLU for 3 slots (one expert twice) equals `gemv.gemv_experts_glu` to fp32 rounding, and silu(g) u
    from the reference weights; bf16 output rounded the same way."""
    rng = np.random.default_rng(12)
    k, n, e = 512, 24, 4
    g = torch.stack([q4k_rows(n, k, rng) for _ in range(e)])
    u = torch.stack([q4k_rows(n, k, rng) for _ in range(e)])
    ids = torch.tensor([3, 0, 3], dtype=torch.int32)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    y = TC.gemv_tc_experts_glu(x, g, u, ids, "Q4_K", k, block_n=8, pipe=pipe)
    xd = x.double()
    for s, ex in enumerate(ids.tolist()):
        gd = xd @ quants.dequantize(g[ex], 12, k).double().T
        ud = xd @ quants.dequantize(u[ex], 12, k).double().T
        ref = torch.nn.functional.silu(gd) * ud
        assert (y[s].double() - ref[0]).abs().max().item() <= 1e-5 * ref.abs().max().item()
    y_cc = G.gemv_experts_glu(x, g, u, ids, "Q4_K", k)
    assert (y - y_cc).abs().max().item() <= 1e-5 * y_cc.abs().max().item()
    k2 = 1024  # two chunks, split in two
    g2 = torch.stack([q4k_rows(n, k2, rng) for _ in range(e)])
    u2 = torch.stack([q4k_rows(n, k2, rng) for _ in range(e)])
    x2 = torch.randn(1, k2, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    y2 = TC.gemv_tc_experts_glu(x2, g2, u2, ids, "Q4_K", k2, block_n=8, pipe=pipe, split_k=2, x_prebuilt=pipe)
    y2_cc = G.gemv_experts_glu(x2, g2, u2, ids, "Q4_K", k2)
    assert (y2 - y2_cc).abs().max().item() <= 1e-5 * y2_cc.abs().max().item()
    yb = TC.gemv_tc_experts_glu(x, g, u, ids, "Q4_K", k, block_n=8, out_dtype=torch.bfloat16, x_prebuilt=True)
    yb_cc = G.gemv_experts_glu(x, g, u, ids, "Q4_K", k, out_dtype=torch.bfloat16)
    assert yb.dtype == torch.bfloat16
    assert (yb.float() - yb_cc.float()).abs().max().item() <= 1e-2 * yb_cc.float().abs().max().item()


def test_gemv_tc_refuses() -> None:
    """Inputs the kernel cannot read exactly are refused, naming what is wrong."""
    rng = np.random.default_rng(13)
    raw = q4k_rows(8, 512, rng)
    with pytest.raises(StrataError, match="bfloat16 or float16"):
        TC.gemv_tc(torch.randn(1, 512), raw, "Q4_K", 512)
    with pytest.raises(StrataError, match="not supported"):
        TC.gemv_tc(torch.randn(1, 512).bfloat16(), raw, "Q8_0", 512)
    with pytest.raises(StrataError, match="multiple of 512"):
        TC.gemv_tc(torch.randn(1, 256).bfloat16(), q4k_rows(8, 256, rng), "Q4_K", 256)
    with pytest.raises(StrataError, match="row of 512"):
        TC.gemv_tc(torch.randn(2, 512).bfloat16(), raw, "Q4_K", 512)
