"""tools/handoff_lab.py's chain kernel under Triton's interpreter (the timing runs on the device box): the PDL-wait
and flag modes compute the same chain, each launch's value from every output of the one before, and the flag mode
puts its counters back to zero, so a captured chain replays from the same state."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from tests.tool_module import load_tool  # noqa: E402

lab = load_tool("handoff_lab")


def test_wait_and_flag_modes_compute_the_same_chain() -> None:
    programs, length = 4, 3
    w = torch.randn(programs * 4096 // 4, generator=torch.Generator().manual_seed(1))
    outs = {}
    for mode in ("pdl", "flag"):
        bufs = torch.zeros(length + 1, programs)
        bufs[0] = torch.arange(programs, dtype=torch.float32)
        cnt = torch.zeros(length + 1, dtype=torch.int32)
        ack = torch.zeros(length + 1, dtype=torch.int32)
        cnt[0] = programs
        for k in range(length):
            lab._link_kernel[(programs,)](bufs[k], bufs[k + 1], w, cnt[k:], cnt[k + 1:], ack[k:], programs, programs,
                                          MODE=lab.MODES[mode], WORK=4096, BG=programs)
        outs[mode] = bufs
        if mode == "flag":  # every consumed counter is back at zero; the last launch's is raised by all its programs
            assert cnt[:length].tolist() == [0] * length and cnt[length] == programs and not ack.any()
    want = torch.zeros(length + 1, programs)
    want[0] = torch.arange(programs, dtype=torch.float32)
    wsum = w.reshape(programs, 1024).sum(1) * 1e-9
    for k in range(length):
        want[k + 1] = want[k].sum() * 0.5 + wsum + torch.arange(programs)
    assert torch.equal(outs["pdl"], outs["flag"])
    assert torch.allclose(outs["pdl"], want, rtol=1e-6)
