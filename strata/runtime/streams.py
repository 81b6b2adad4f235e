"""Independent branches of a layer on CUDA streams of their own (`Ops.branches`).

At batch 1 most decode kernels fill only part of the GPU and each is short, so two chains of kernels that do not
depend on each other (the routed experts and the shared expert of a MoE layer) finish sooner side by side than
one after the other. Branch 0 runs on the caller's stream, each further branch on a side stream forked from it
(it waits for everything queued before the call) and joined back (the caller's stream waits for it before
anything queued after the call). Forks and joins are stream events, so a captured CUDA graph keeps them as
graph edges and replays the branches concurrently.

Memory: a tensor a branch allocates belongs to its stream's pool; it is used on the caller's stream only after
the join, and the side stream's next work waits for the next fork, which the caller queues after that use.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from strata.model.ops import branches_ref


CAPTURE_LANE = 0
"""The side stream a decode step warms up and is captured on (`strata.runtime.graph`); branches use 1, 2, ..."""

_streams: dict[tuple[int, int], torch.cuda.Stream] = {}


def side_stream(device: torch.device, lane: int) -> torch.cuda.Stream:
    """Side stream `lane` of `device`, made once per process and shared by every engine and decode step. The
    split-K ticket counters (`strata.kernels.gemv.tickets`) give each stream a region of their own and have
    only a few, so the streams that run kernels must be a small fixed set, not one per step or per engine."""
    key = (device.index if device.index is not None else torch.cuda.current_device(), lane)
    if key not in _streams:
        _streams[key] = torch.cuda.Stream(device=key[0])
    return _streams[key]


class SideStreams:
    """`Ops.branches` on CUDA: branch i > 0 on side stream `CAPTURE_LANE + i` of x's device."""

    def __call__(self, x: torch.Tensor, fns: Sequence[Callable[[], object]]) -> list[object]:
        if not x.is_cuda or len(fns) < 2:
            return branches_ref(x, fns)
        main = torch.cuda.current_stream(x.device)
        sides = [side_stream(x.device, CAPTURE_LANE + i) for i in range(1, len(fns))]
        outs: list[object] = [None] * len(fns)
        for i, side in enumerate(sides, 1):
            side.wait_stream(main)
            with torch.cuda.stream(side):
                outs[i] = fns[i]()
        outs[0] = fns[0]()
        for side in sides:
            main.wait_stream(side)
        return outs
