"""tools/fused_moe_lab.py under Triton's interpreter (the timing runs on the device box): the one-launch routed
experts, each program's GLU chunk and its partial down product added by the combine, give what the pair of
launches (GLU, down with the slot sum) and the model's combine give, bit for bit, with the down read as stored or
as column planes; each slot reads its own expert; and the planes hold the same blocks."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.tool_module import load_tool  # noqa: E402

lab = load_tool("fused_moe_lab")


@pytest.mark.parametrize("planes", [False, True])
def test_fused_launch_equals_the_pair(planes: bool) -> None:
    shapes = [(nb, 128, 4, 1, 32, planes) for nb in (1, 2, 4)]
    for row in lab.check("cpu", 512, 256, 3, 2, shapes, seed=3):  # two groups of four blocks per row
        assert row["scale"] > 0
        assert row["differing"] == 0, row


@pytest.mark.parametrize("planes", [False, True])
def test_fused_launch_reads_each_slots_expert(planes: bool) -> None:
    gen = torch.Generator().manual_seed(5)
    layer = lab.make_layer(3, 512, 128, gen, "cpu")
    x = torch.randn(1, 512, generator=gen).to(torch.bfloat16)
    sw = torch.tensor([0.75, 0.25], dtype=torch.bfloat16)
    gl = torch.zeros(1, 1, dtype=torch.bfloat16)
    shared = torch.zeros(1, 512, dtype=torch.bfloat16)
    f = lab.Fused(layer["gate"], layer["up"], layer["down"], 2, 128, 4, 1, 32, planes=planes)
    outs = [f(x, torch.tensor(ids, dtype=torch.int32), sw, gl, shared) for ids in ([0, 1], [1, 0], [2, 1])]
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])


def test_down_planes_hold_the_same_blocks() -> None:
    gen = torch.Generator().manual_seed(7)
    down = lab.random_rows("Q5_1_R", (2, 8), 256, gen, "cpu")  # 2 experts, 8 rows of 256
    for nb in (1, 2, 4):
        planes = lab.down_planes(down, nb).view(torch.int32).reshape(2, 256 // (32 * nb), 8 * 6 * nb)
        hdr, nib = planes[..., :8 * 2 * nb].reshape(2, -1, 8, 2 * nb), planes[..., 8 * 2 * nb:].reshape(2, -1, 8,
                                                                                                        4 * nb)
        w = down.view(torch.int32).reshape(2, 8, 2, 24)  # (expert, row, group of four blocks, words)
        for c in range(256 // (32 * nb)):
            for j in range(nb):
                b = c * nb + j
                g, blk = b // 4, b % 4
                assert torch.equal(hdr[:, c, :, j], w[:, :, g, blk])
                assert torch.equal(hdr[:, c, :, nb + j], w[:, :, g, 4 + blk])
                assert torch.equal(nib[:, c, :, 4 * j:4 * j + 4], w[:, :, g, 8 + 4 * blk:12 + 4 * blk])
