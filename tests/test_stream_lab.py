"""tools/stream_lab.py's kernels under Triton's interpreter (the timing runs on the device box): the streaming
sums, the preloaded dependent sums, and the one-launch window whose persistent programs claim items in order and
hand over through a counter, which it puts back to zero for the next launch."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from tests.tool_module import load_tool  # noqa: E402

lab = load_tool("stream_lab")


def test_stream_sums_each_programs_share() -> None:
    src = torch.randint(-1000, 1000, (4 * 700,), dtype=torch.int32)
    out = torch.zeros(8, dtype=torch.int32)
    lab._stream_kernel[(4,)](src, out, 700, VEC=4, UNROLL=2, num_warps=1)
    assert out[:4].tolist() == src.view(4, 700).sum(1).tolist()


def test_window_hands_over_and_resets_its_counters() -> None:
    n_glu, glu_words, n_down, down_words = 5, 300, 7, 40
    src = torch.randint(-1000, 1000, (n_glu * glu_words + n_down * down_words,), dtype=torch.int32)
    cnt = torch.zeros(3, dtype=torch.int32)
    for _ in range(2):  # a second launch finds the counters at zero
        out = torch.zeros(n_glu + n_down, dtype=torch.int32)
        lab._window_kernel[(3,)](src, out, cnt, n_glu, n_glu + n_down, glu_words, down_words, n_glu * glu_words,
                                 VEC=4, UNROLL=1, BW=64, num_warps=1)
        glu = src[:n_glu * glu_words].view(n_glu, glu_words).sum(1)
        down = src[n_glu * glu_words:].view(n_down, down_words).sum(1) + glu[torch.arange(n_down) % n_glu]
        assert out.tolist() == glu.tolist() + down.tolist()
        assert cnt.tolist() == [0, 0, 0]


def test_preloaded_adds_its_dependency() -> None:
    src = torch.randint(-1000, 1000, (6 * 50,), dtype=torch.int32)
    dep = torch.tensor([7, 11], dtype=torch.int32)
    out = torch.zeros(6, dtype=torch.int32)
    lab._preloaded_kernel[(6,)](src, dep, out, 50, 2, BW=64, num_warps=1)
    assert out.tolist() == (src.view(6, 50).sum(1) + dep[torch.arange(6) % 2]).tolist()
