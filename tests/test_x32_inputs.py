"""The fp32 copies of GEMV inputs (`gemv_rr.WRITE_X32`) through the whole model: in a bf16 model the HC reads, the
GDN step and the attention merge also write their outputs' values as fp32, and the row-register GEMVs that read
those outputs load the copies instead of widening bf16 themselves. Widening is exact, so the logits must be the
same bits with the copies and without, and the copies must actually be read (run under the interpreter on the
CPU, the bench's type mix at a small geometry)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: run the kernels on the CPU

import torch  # noqa: E402

from strata.kernels import gemv_rr  # noqa: E402
from strata.kernels import ops as K_OPS  # noqa: E402
from strata.kernels.fused import fused_ops  # noqa: E402
from strata.model.ops import Ops  # noqa: E402
from strata.runtime.engine import Engine  # noqa: E402
from strata.runtime.placement import gpu_layout  # noqa: E402
from tests import reference  # noqa: E402
from tests.test_q8_activations import _weights  # noqa: E402


def test_fp32_copies_of_gemv_inputs_change_no_bit(monkeypatch) -> None:
    placed = gpu_layout(_weights(), dtype=torch.bfloat16)
    monkeypatch.setattr(K_OPS, "_on_gpu", lambda x: True)  # run the CUDA entries under the interpreter
    shape = gemv_rr.launch_shape  # 16x the rows per program: 16x fewer programs for the interpreter to run
    monkeypatch.setattr(gemv_rr, "launch_shape", lambda *a: (lambda s: (16 * s[0], *s[1:]))(shape(*a)))
    read = []  # row-register launches, and whether each read an fp32 copy
    launch = gemv_rr.launch
    monkeypatch.setattr(gemv_rr, "launch", lambda kind, x, *a, **kw: read.append(x.dtype == torch.float32)
                        or launch(kind, x, *a, **kw))
    ids = torch.randint(2, placed.cfg.vocab_size, (5,), generator=torch.Generator().manual_seed(4)).tolist()

    def logits(copies: bool) -> torch.Tensor:
        monkeypatch.setattr(gemv_rr, "WRITE_X32", copies)
        fast = Engine(placed, dtype="bfloat16", ops=fused_ops(K_OPS.triton_ops(Ops()), force=True))
        return reference.decode_logits(fast, ids, 2)

    plain = logits(False)
    assert read and not any(read)
    read.clear()
    assert torch.equal(logits(True), plain)
    assert any(read) and not all(read), read  # the HC reads', GDN's, attention's outputs; not the routed GLU's
