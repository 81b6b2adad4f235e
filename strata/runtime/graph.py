"""One decode step over static buffers, captured as a CUDA graph and replayed per token.

The step's state is allocated once at a fixed capacity (max context), and every per-token value the device
needs — the token id, its position, the PLE rows gathered on the host — is copied into a static input buffer
before the replay. Inside, nothing depends on data: no host synchronisation, no allocation, the same kernels
every token. Outside CUDA (or with `capture=False`) the same step runs eagerly, which is how the CPU tests
check it against the growing-state decode path.
"""

from __future__ import annotations

import torch

from strata.errors import StrataError
from strata.model.experts import experts_gather
from strata.model.model import Model, StepInputs
from strata.model.ops import Ops
from strata.runtime.state import SequenceState


def capturable(ops: Ops) -> Ops:
    """The op table with the data-dependent reference expert loop replaced by its capturable twin (unless a
    backend already supplied a device-side expert kernel)."""
    from strata.model.experts import experts_ref

    if ops.experts is experts_ref:
        return Ops(**{**ops.__dict__, "experts": experts_gather})
    return ops


class DecodeStep:
    """A model's single-token decode step bound to one fixed-capacity sequence state."""

    def __init__(self, model: Model, capacity: int, capture: bool | None = None,
                 state: SequenceState | None = None):
        self.model = Model(model.w, model.dtype, model.device, capturable(model.ops))
        self.capacity = capacity
        if state is not None and not state.fixed_capacity(capacity):
            raise StrataError(f"a decode step needs a state allocated at a fixed capacity of {capacity} positions")
        self.state: SequenceState = state if state is not None else self.model.new_state(capacity)
        dev, cfg = model.device, model.cfg
        self.inputs = StepInputs(
            ids=torch.zeros(1, dtype=torch.int64, device=dev),
            positions=torch.zeros(1, dtype=torch.int64, device=dev),
            n_keys=capacity,
            ple={i: torch.zeros(1, cfg.ple_dim, dtype=model.dtype, device=dev) for i in cfg.ple},
        )
        self.capture = dev.type == "cuda" if capture is None else capture
        if self.capture and dev.type != "cuda":
            raise StrataError("graph capture needs a CUDA device")
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """Run a prompt (eagerly, any length) into the static state; returns its last logits (V,)."""
        if self.state.length + ids.numel() > self.capacity:
            raise StrataError(f"prompt of {ids.numel()} tokens does not fit the capacity {self.capacity}")
        return self.model.forward(ids.to(self.model.device), self.state, last_only=True)[-1]

    def _compute(self) -> torch.Tensor:
        h = self.model.run(self.inputs, self.state, static=True)
        return self.model.logits(h)[0]

    def _stage(self, token: int) -> None:
        if self.state.length >= self.capacity:
            raise StrataError(f"the sequence reached the decode capacity of {self.capacity} tokens")
        staged = self.model.stage(torch.tensor([token], dtype=torch.int64), self.state)
        self.inputs.ids.copy_(staged.ids, non_blocking=True)
        self.inputs.positions.copy_(staged.positions, non_blocking=True)
        for i, e in staged.ple.items():
            self.inputs.ple[i].copy_(e, non_blocking=True)

    @torch.inference_mode()
    def step(self, token: int) -> torch.Tensor:
        """Logits (V,) of one token, continuing the state. Captures the graph on the first CUDA call."""
        self._stage(token)
        if not self.capture:
            return self._compute()
        if self.graph is None:
            self._capture()
        self.graph.replay()
        return self.out

    def _capture(self) -> None:
        # The staged token is already in the input buffers: warm up on a side stream with a snapshot of the
        # state (warm-up writes the caches), restore it, then capture; the replay below computes the token.
        snapshot = self.state.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._compute()
                self._restore(snapshot)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self._compute()
        self._restore(snapshot)

    def _restore(self, snapshot: SequenceState) -> None:
        for mine, saved in zip(self.state.layers, snapshot.layers, strict=True):
            for name, t in vars(saved).items():
                if isinstance(t, torch.Tensor):
                    getattr(mine, name).copy_(t)
        for i, saved in snapshot.ple.items():
            self.state.ple[i].conv.copy_(saved.conv)
