"""The engine: one loaded model, placed on a device, driving prefill and decode over sequence states.

It owns what the model math does not: which dtype and device the model runs in, checking token ids before
they reach an embedding, chunking long prompts, and the choice of op table (reference or a fast backend).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from strata.errors import StrataError
from strata.model.model import Model, SequenceState
from strata.model.ops import ACTIVATIONS, Ops, with_activations
from strata.runtime.host_memory import check_mode as check_ple_table_mode
from strata.runtime.host_memory import place_ple_tables
from strata.weights.schema import Weights

if TYPE_CHECKING:
    from strata.runtime.graph import DecodeStep, DeviceDraw

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "models" / "default"
DEFAULT_CONTEXT = 32768  # positions a fixed-capacity (graph) state holds unless the engine is told otherwise


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise StrataError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}") from None


def load_weights(path: str | Path) -> Weights:
    """Open a model (HF folder or GGUF file) lazily and validate it."""
    path = Path(path)
    if not path.exists():
        raise StrataError(f"model path {path} does not exist")
    try:
        from strata.weights.loader import load_weights as load_any
    except ImportError:
        from strata.weights.hf import load_hf as load_any
    return load_any(path)


class Engine:
    """A model ready to run: `new_state()`, `prefill(ids, state)`, `decode(token, state)`. On a CUDA device the
    weights are placed there (the PLE table stays on the host unless `ple_table` is "device") and the Triton
    kernels are installed. ple_table: whether the PLE tables' pages are read into memory first, copied into the
    GPU's memory or into page-locked host memory the GPU reads (`strata.runtime.host_memory`); progress: a
    progress bar on stderr while they are."""

    def __init__(self, weights: Weights, dtype: str | torch.dtype = "float32", device: str = "cpu",
                 ops: Ops | None = None, path: Path | None = None, graphs: bool | None = None,
                 context: int | None = None, activations: str = "float", ple_table: str = "auto",
                 progress: bool = False):
        check_ple_table_mode(ple_table)  # before the weights are placed
        self.device = torch.device(device)
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        if context is not None and context < 1:
            raise StrataError(f"context must be a positive number of positions, got {context}")
        self.context = min(context or DEFAULT_CONTEXT, weights.cfg.max_position_embeddings)
        self.dtype = resolve_dtype(dtype)
        if activations not in ACTIVATIONS:
            raise StrataError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")
        if ops is not None and activations != "float":
            raise StrataError("activations: give either an op table or an activation mode, not both")
        if self.device.type == "cuda":
            from strata.runtime.placement import fast_ops, place

            weights = place(weights, self.device, self.dtype)
            ops = ops or fast_ops(activations=activations)
        elif ops is None:
            ops = with_activations(Ops(), activations)
        self.weights, self.ple_table = place_ple_tables(weights, ple_table, self.device, progress)
        """What was done with the PLE tables: "resident", "mapped" (`hold_ple_tables`), "device" (in the GPU's
        memory, `tables_to_device`), "pinned" (in page-locked host memory the GPU reads, `tables_to_pinned`) or
        "none"."""
        self.cfg = weights.cfg
        self.path = path
        self.model = Model(self.weights, self.dtype, self.device, ops)

    @classmethod
    def load(cls, path: str | Path | None = None, dtype: str | torch.dtype = "float32", device: str = "cpu",
             ops: Ops | None = None, graphs: bool | None = None, context: int | None = None,
             activations: str = "float", ple_table: str = "auto", progress: bool = False) -> Engine:
        """Load the model at `path` (the bundled default model when None)."""
        path = Path(path) if path is not None else DEFAULT_MODEL
        return cls(load_weights(path), dtype, device, ops, path, graphs, context, activations, ple_table, progress)

    @property
    def max_context(self) -> int:
        """Most positions one sequence may hold: the graph states' capacity, else the model's context length."""
        return self.context if self.graphs else self.cfg.max_position_embeddings

    def new_state(self) -> SequenceState:
        """A fresh sequence. With graphs, its caches are allocated once for `context` positions so that its
        single-token decode runs as one captured step (on CUDA: a CUDA graph replayed per token)."""
        if self.graphs:
            return self.model.new_state(capacity=self.context)
        return self.model.new_state()

    def check_ids(self, ids: Sequence[int]) -> torch.Tensor:
        """ids as an int64 tensor, refusing any id outside the vocabulary."""
        t = torch.as_tensor(list(ids), dtype=torch.int64)
        if t.ndim != 1:
            raise StrataError("token ids must be a flat list of integers")
        V = self.cfg.vocab_size
        bad = ((t < 0) | (t >= V)).nonzero().flatten()
        if bad.numel():
            i = int(bad[0])
            raise StrataError(f"token id {int(t[i])} at position {i} is outside the vocabulary [0, {V})")
        return t.to(self.device)

    @torch.inference_mode()
    def prefill(self, ids: Sequence[int], state: SequenceState, chunk_size: int = 512,
                all_logits: bool = False) -> torch.Tensor:
        """Run the prompt through the model in chunks. Returns float32 logits of every position (L, V) with
        `all_logits`, else of the last position (V,). Chunk boundaries do not change the result."""
        t = self.check_ids(ids)
        if t.numel() == 0:
            raise StrataError("empty prompt: at least one token is needed")
        if chunk_size < 1:
            raise StrataError(f"chunk_size must be >= 1, got {chunk_size}")
        outs = []
        for start in range(0, t.numel(), chunk_size):
            piece = t[start:start + chunk_size]
            last = not all_logits
            outs.append(self.model.forward(piece, state, last_only=last).float())
        return torch.cat(outs) if all_logits else outs[-1][-1]

    @torch.inference_mode()
    def decode(self, token: int, state: SequenceState) -> torch.Tensor:
        """One token through the single-token path; float32 logits (V,). A fixed-capacity state (see
        `new_state`) goes through its captured step, built on its first decode."""
        t = self.check_ids([token])
        if self.graphs and state.fixed_capacity(self.context):
            return self._decode_step(state).step(int(t[0])).float().clone()
        return self.model.forward(t, state)[-1].float()

    def _decode_step(self, state: SequenceState) -> DecodeStep:
        """The captured step of a fixed-capacity state, built on its first decode."""
        if state.decode_step is None:
            from strata.runtime.graph import DecodeStep

            state.decode_step = DecodeStep(self.model, self.context, state=state)
        return state.decode_step

    def decode_ahead(self, token: int, state: SequenceState, draw: DeviceDraw | None = None,
                     ) -> Iterator[int] | None:
        """The ids that follow `token`, each chosen inside the captured step on the device (the argmax, or a
        draw with `draw`'s parameters and seed); only the ids come back to the host, and the step for the next id
        runs while the host handles the current one where the step can feed itself (`DecodeStep.ids_ahead`).
        When the caller stops asking, `state` holds every id it was given (`state.tokens`), the last one
        included; the ids end with the one chosen at the state's last position. None when `state` does not
        decode through a captured step, or for a draw off CUDA (the draw kernel runs compiled on CUDA only): the
        caller then samples the logits of `decode`."""
        t = self.check_ids([token])
        if not (self.graphs and state.fixed_capacity(self.context)) or (draw is not None and
                                                                         self.device.type != "cuda"):
            return None
        step = self._decode_step(state)
        if draw is not None:
            step.sampler.configure(draw.temperature, draw.top_k, draw.top_p, draw.min_p, draw.seed)
        return step.ids_ahead(int(t[0]), sampled=draw is not None)
