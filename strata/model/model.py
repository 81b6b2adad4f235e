"""The qwen4_exp text model: embedding -> S-stream hyper-connection state -> layers -> final mixer -> head.

A call is split in two: `stage` does the host work (positions, the PLE n-gram hash and table gathers, which
read a table that may live in host RAM or on disk) and `run` does the device work. `run` has shapes that
depend only on the call length and state capacities, so a decode step can be captured once and replayed;
prefill is a call with many tokens, decode a call with one, through the same code.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from strata.model.gdn import gdn_layer
from strata.model.hyper import hc_read, hc_write_read
from strata.model.moe import moe_layer
from strata.model.ops import Ops
from strata.model.ple import ple_advance, ple_hist_into, ple_layer, ple_rows, ple_rows_into
from strata.model.qsa import Rope, qsa_layer
from strata.runtime.state import SequenceState
from strata.weights.schema import Weights


@dataclass
class StepInputs:
    """What one call feeds the device: ids and positions (device), the number of key positions any query may
    see, and the PLE table rows gathered per PLE layer, as stored (decoded on the device)."""

    ids: torch.Tensor  # (L,) int64
    positions: torch.Tensor  # (L,) int64
    n_keys: int
    ple: dict[int, torch.Tensor]  # layer -> (L, ngram_heads, stored row width)


@dataclass
class Carry:
    """The residual state between layers: the S-stream state x, the last block's write not yet applied
    (inject, y) or None, and the rotary tables of the call's positions (None without QSA layers)."""

    x: torch.Tensor
    pending: tuple[torch.Tensor, torch.Tensor] | None
    rope: Rope | None


class Model:
    """The math of the model over a canonical weight set. Stateless: all sequence state is passed in."""

    def __init__(self, weights: Weights, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 ops: Ops | None = None):
        self.w = weights
        self.cfg = weights.cfg
        self.dtype = dtype
        self.device = torch.device(device)
        self.ops = ops or Ops()

    def new_state(self, capacity: int | None = None) -> SequenceState:
        return SequenceState.empty(self.cfg, self.dtype, self.device, capacity)

    def stage(self, ids: torch.Tensor, state: SequenceState, to_device: bool = True) -> StepInputs:
        """Host work for the new ids; advances the state's token count and n-gram context. The inputs are moved
        to the model's device unless `to_device` is False (a caller staging them into its own buffers)."""
        L = ids.shape[0]
        positions = torch.arange(state.length, state.length + L)
        ple = {i: ple_rows(ids, self.w, i, self.cfg, s) for i, s in state.ple.items()}
        state.length += L
        state.tokens.extend(ids.tolist())
        if to_device:
            ids, positions = ids.to(self.device), positions.to(self.device)
            ple = {i: e.to(self.device) for i, e in ple.items()}
        return StepInputs(ids, positions, state.length, ple)

    def stage_token(self, token: int, state: SequenceState, ple_out: dict[int, torch.Tensor | np.ndarray],
                    history: bool = False) -> int:
        """`stage` of one id for a caller with its own host buffers: each PLE layer's stored rows written into
        `ple_out[layer]` (ngram_heads, row width; or the uint8 numpy array of its bytes), or with `history` (a
        step that hashes and gathers on the device, `Ops.ple_gather`) the id's n-gram history ((n,) int64: its
        context, then the id). Advances the state like `stage`; returns the id's position."""
        for i, s in state.ple.items():
            if history:
                ple_hist_into(token, s, ple_out[i])
            else:
                ple_rows_into(token, self.w, i, self.cfg, s, ple_out[i])
        state.length += 1
        state.tokens.append(token)
        return state.length - 1

    def fed(self, token: int, state: SequenceState) -> None:
        """The host's record of an id a decode step fed itself on the device (`DecodeStep.ids_ahead`): the state
        advanced as `stage_token` advances it, with nothing staged."""
        for s in state.ple.values():
            ple_advance(token, s)
        state.length += 1
        state.tokens.append(token)

    def run(self, inputs: StepInputs, state: SequenceState, static: bool = False) -> torch.Tensor:
        """Final hidden states (L, H); writes the device-side caches of `state`. `static` keeps every shape
        independent of the data (for a captured step)."""
        carry = self.run_layers(self.begin(inputs), inputs, state, 0, self.cfg.num_hidden_layers, static)
        return self.finish(carry)

    def begin(self, inputs: StepInputs) -> Carry:
        """The residual state before layer 0: the embedded ids repeated over the streams (and the rotary tables
        of the positions, once for every QSA layer)."""
        cfg = self.cfg
        x = self.ops.embed(inputs.ids, self.w["embed"], self.dtype).repeat(1, cfg.hc_count)
        has_qsa = not all(cfg.is_linear(i) for i in range(cfg.num_hidden_layers))
        return Carry(x, None, self.ops.rope(inputs.positions, cfg, self.dtype) if has_qsa else None)

    def run_layers(self, carry: Carry, inputs: StepInputs, state: SequenceState, start: int, stop: int,
                   static: bool = False) -> Carry:
        """Layers start .. stop - 1 on the carried residual state. Only layers in that range read their inputs
        (a PLE layer its table rows), so a decode step can run the layers before the first PLE layer while the
        host is still gathering that layer's rows."""
        cfg, w, ops = self.cfg, self.w, self.ops
        S, eps = cfg.hc_count, cfg.rms_norm_eps
        x, pending, rope = carry.x, carry.pending, carry.rope
        # Each block's write x += inject * y is deferred into the read that follows it (`ops.hc_write_read`, which
        # a fast backend runs in the read's launches): `pending` holds the (inject, y) not yet applied. Only a
        # PLE layer, whose mix reads the written state before the block's read, applies it on its own.
        for i in range(start, stop):
            if i in inputs.ple:
                if pending is not None:
                    x, pending = ops.hc_write(x, *pending), None
                x = x + ple_layer(x, inputs.ple[i], w, i, cfg, state.ple[i], ops)
            if pending is None:
                a, inject = hc_read(x, w, f"L{i}.hc_attn", S, eps, ops)
            else:
                x, a, inject = hc_write_read(x, *pending, w, f"L{i}.hc_attn", S, eps, ops)
            if cfg.is_linear(i):
                y = gdn_layer(a, w, i, cfg, state.layers[i], ops)
            else:
                y = qsa_layer(a, inputs.positions, rope, inputs.n_keys, w, i, cfg, state.layers[i], ops, static)
            x, a, inject = hc_write_read(x, inject, y, w, f"L{i}.hc_ffn", S, eps, ops)
            pending = (inject, moe_layer(a, w, i, cfg, ops))
        return Carry(x, pending, rope)

    def finish(self, carry: Carry) -> torch.Tensor:
        """The final mixer's read of the residual state after the last layer: (L, H)."""
        S, eps = self.cfg.hc_count, self.cfg.rms_norm_eps
        if carry.pending is None:  # no layers
            h, _ = hc_read(carry.x, self.w, "final", S, eps, self.ops, inject=False)
        else:
            _, h, _ = hc_write_read(carry.x, *carry.pending, self.w, "final", S, eps, self.ops, inject=False)
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(h, self.w.head)

    def forward(self, ids: torch.Tensor, state: SequenceState, last_only: bool = False) -> torch.Tensor:
        """Logits (L, V) in the model dtype (or (1, V) with `last_only`) for the new ids; advances `state`."""
        h = self.run(self.stage(ids, state), state)
        return self.logits(h[-1:] if last_only else h)
