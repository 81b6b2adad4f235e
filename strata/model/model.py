"""The qwen4_exp text model: embedding -> 4-stream hyper-connection state -> layers -> final mixer -> head.

`Model.forward(ids, state)` runs any number of new tokens of one sequence, continuing `state`; prefill is a
call with many tokens, decode a call with one. The same code serves both.
"""

from __future__ import annotations

import torch

from strata.model.gdn import gdn_layer
from strata.model.hyper import hc_read, hc_write
from strata.model.moe import moe_layer
from strata.model.ops import Ops
from strata.model.ple import ple_layer
from strata.model.qsa import qsa_layer
from strata.runtime.state import SequenceState
from strata.weights.schema import Weights


class Model:
    """The math of the model over a canonical weight set. Stateless: all sequence state is passed in."""

    def __init__(self, weights: Weights, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 ops: Ops | None = None):
        self.w = weights
        self.cfg = weights.cfg
        self.dtype = dtype
        self.device = torch.device(device)
        self.ops = ops or Ops()

    def new_state(self) -> SequenceState:
        return SequenceState.empty(self.cfg, self.dtype, self.device)

    def hidden(self, ids: torch.Tensor, state: SequenceState) -> torch.Tensor:
        """Final hidden states (L, H) for the new ids; advances `state`."""
        cfg, w, ops = self.cfg, self.w, self.ops
        L = ids.shape[0]
        positions = torch.arange(state.length, state.length + L, device=self.device)
        e = ops.embed(ids, w["embed"], self.dtype).to(self.device)
        x = e.repeat(1, cfg.hc_count)
        S, eps = cfg.hc_count, cfg.rms_norm_eps
        for i in range(cfg.num_hidden_layers):
            if i in state.ple:
                x = x + ple_layer(x, ids, w, i, cfg, state.ple[i], ops)
            a, inject = hc_read(x, w, f"L{i}.hc_attn", S, eps, ops)
            if cfg.is_linear(i):
                y = gdn_layer(a, w, i, cfg, state.layers[i], ops)
            else:
                y = qsa_layer(a, positions, w, i, cfg, state.layers[i], ops)
            x = hc_write(x, inject, y)
            a, inject = hc_read(x, w, f"L{i}.hc_ffn", S, eps, ops)
            x = hc_write(x, inject, moe_layer(a, w, i, cfg, ops))
        state.length += L
        state.tokens.extend(ids.tolist())
        h, _ = hc_read(x, w, "final", S, eps, ops, inject=False)
        return h

    def forward(self, ids: torch.Tensor, state: SequenceState, last_only: bool = False) -> torch.Tensor:
        """Logits (L, V) in the model dtype (or (1, V) with `last_only`) for the new ids; advances `state`."""
        h = self.hidden(ids, state)
        if last_only:
            h = h[-1:]
        return self.ops.linear(h, self.w.head)
