"""One decode step over static buffers, captured as a CUDA graph and replayed per token.

The step's state is allocated once at a fixed capacity (max context), and every per-token value the device
needs — the token id, its position, the PLE rows gathered on the host — is written into a page-locked buffer,
which each captured graph copies into its static inputs as its first node (the eager step: one copy before it).
Inside, nothing depends on data: no host synchronisation, no allocation, the same kernels every token. Outside
CUDA (or with `capture=False`) the same step runs eagerly, which is how the CPU tests check it against the
growing-state decode path.

Where the PLE tables live in host memory and the first PLE layer is not layer 0, the step is captured as two
graphs split at that layer: the host writes the id and position, replays the front (embedding and the layers
before it, after its copy of the id and position), and only then hashes the token's n-grams, gathers their table
rows and replays the rest (which copies them first). The device runs the front while the host stages the rows and
launches the second graph, so neither the staging nor that launch is on the token's critical path. Where the
tables are in device memory (`--ple-table device`), the host writes each PLE layer's n-gram history (the context
and the id) instead, the step's first launches hash it and gather the rows (`Ops.ple_gather`), and the step is
one graph: a token's host work is a few integers and one replay call, whatever the host's speed.

Such a one-graph step can also run ahead of the host (`ids_ahead`): a second graph per way of ending the step
starts by advancing its own inputs on the device from the id the previous step chose (the id, the position +1,
each n-gram history shifted by that id: `feed_ref`, one launch on a GPU), so the host launches the step for the
next token before it reads the current one, and the GPU never waits for the host's read, its bookkeeping or the
caller's use of the token. The cost: when the caller stops, the step for the last token read has already run, so
the state holds that token too (`state.tokens` says so). A split step runs its front ahead the same way: the host
launches the front of the next step (fed from the previous choice) before it reads the current id, then stages
that id's rows and launches the rest, so the device runs the front while the host reads, stages and launches,
and the id's read is off the token's critical path as well.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from strata.errors import StrataError
from strata.model.experts import experts_gather
from strata.model.model import Carry, Model, StepInputs
from strata.model.ops import Ops, linear_q8_ref
from strata.model.ple import NgramTables
from strata.kernels.host_pages import page_locked
from strata.runtime.state import SequenceState
from strata.runtime.streams import CAPTURE_LANE, side_stream
from strata.weights.tensor import raw_rows


def capturable(ops: Ops) -> Ops:
    """The op table with the data-dependent reference expert loop replaced by its capturable twin (unless a
    backend already supplied a device-side expert kernel), rounding activations as the table's `linear` does."""
    from strata.model.experts import experts_ref

    if ops.experts is experts_ref:
        gather = functools.partial(experts_gather, q8=True) if ops.linear is linear_q8_ref else experts_gather
        return Ops(**{**ops.__dict__, "experts": gather})
    return ops


def _lap(phases: dict[str, float] | None, name: str, since: float) -> float:
    """The time now (0.0 without `phases`), the seconds since `since` added to phases[name] (unless name is "")."""
    if phases is None:
        return 0.0
    now = time.perf_counter()
    if name:
        phases[name] = phases.get(name, 0.0) + now - since
    return now


@dataclass(frozen=True)
class DeviceDraw:
    """A random draw made inside the captured step (`strata.kernels.sample`): temperature > 0, then top-k (0 =
    off), top-p (1 = off), min-p (0 = off); the seed fixes the sequence of draws of one request."""

    temperature: float
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0


def torch_greedy_token(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`greedy_token` by torch's argmax alone (a memset and a reduction kernel on a CUDA device)."""
    return logits.argmax() if out is None else out.copy_(logits.argmax())


def greedy_token(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`logits.argmax()` (0-d int64; written into `out` where given), the last node of a greedy step: one Triton
    launch on a CUDA device (`strata.kernels.sample.argmax`, the same index), torch's elsewhere. Torch's is a
    memset and a reduction kernel, 11 us from the head's end in a profiled replay on an H200
    (bench/results/2026-12-04-h200-synthetic-decode-d60dd42.json, `replay_kernels.timeline`)."""
    if logits.is_cuda:
        from strata.kernels.sample import argmax, argmax_supported

        if argmax_supported(logits):
            return argmax(logits, out=out)
    return torch_greedy_token(logits, out)


def feed_ref(ints: torch.Tensor, token: torch.Tensor, starts: tuple[int, ...], n: int) -> None:
    """A step run ahead advances its own inputs: `ints` (the step's static int64 inputs: the id, the position,
    and from each of `starts` a PLE layer's n-gram history of n ids) gets `token` (one int64 element on the same
    device: the id the previous step chose) as its id, the position + 1, and each history shifted by one with
    `token` appended. In place, with no host synchronisation (capturable)."""
    tok = token.reshape(())
    for s in starts:
        ints[s:s + n - 1] = ints[s + 1:s + n].clone()
        ints[s + n - 1] = tok
    ints[0] = tok
    ints[1] += 1


def feed(ints: torch.Tensor, token: torch.Tensor, starts: tuple[int, ...], n: int) -> None:
    """`feed_ref`, in one Triton launch on a CUDA device (`strata.kernels.feed`)."""
    if ints.is_cuda:
        from strata.kernels.feed import feed as feed_kernel

        return feed_kernel(ints, token, starts, n)
    return feed_ref(ints, token, starts, n)


class DecodeStep:
    """A model's single-token decode step bound to one fixed-capacity sequence state."""

    def __init__(self, model: Model, capacity: int, capture: bool | None = None,
                 state: SequenceState | None = None, split: bool = True, ple_gather: bool | None = None):
        """ple_gather: hash a token's n-grams and gather its PLE rows on the model's device (`Ops.ple_gather`);
        None (default): where every PLE table's stored rows are one tensor the model's CUDA device reads (in its
        memory, or page-locked host memory: `--ple-table device`, `pinned`). True refuses tables it cannot read."""
        self.model = Model(model.w, model.dtype, model.device, capturable(model.ops))
        self.capacity = capacity
        if state is not None and not state.fixed_capacity(capacity):
            raise StrataError(f"a decode step needs a state allocated at a fixed capacity of {capacity} positions")
        self.state: SequenceState = state if state is not None else self.model.new_state(capacity)
        dev, cfg = model.device, model.cfg
        self.tables = self._device_tables(ple_gather)
        """Each PLE layer's stored rows (rows, row bytes) uint8 on the device and its hashing geometry, where the
        step gathers them itself; None where the host stages them."""
        # The static inputs are views of one device buffer, filled from one page-locked buffer of the same layout
        # by one copy per token: the id and the position (int64), then each PLE layer's stored rows (or, where the
        # device gathers them, its n-gram history: n int64).
        forms = ({i: self._stored_row_form(i) for i in cfg.ple} if self.tables is None
                 else {i: torch.zeros(cfg.ngram_size, dtype=torch.int64) for i in cfg.ple})
        offsets, size = {}, 16
        for i, f in forms.items():
            offsets[i] = size
            size += -(-f.numel() * f.element_size() // 16) * 16
        pin = dev.type == "cuda"
        self._packed = torch.zeros(size, dtype=torch.uint8, device=dev)
        self._host = torch.zeros(size, dtype=torch.uint8, pin_memory=pin)
        self._host_ints = self._host[:16].view(torch.int64).numpy()  # [id, position], written without torch ops
        self._ints = self._packed.view(torch.int64)  # the same inputs as int64: what a step run ahead advances
        # each PLE layer's n-gram history in `_ints`, where the step gathers its rows (a feed shifts them)
        self._starts = tuple(offsets[i] // 8 for i in cfg.ple) if self.tables is not None else ()

        def view(buf: torch.Tensor, i: int) -> torch.Tensor:
            f = forms[i]
            return buf[offsets[i]:offsets[i] + f.numel() * f.element_size()].view(f.dtype).view(f.shape)

        if self.tables is None:
            ple = {i: view(self._packed, i) for i in cfg.ple}
            # each PLE layer's rows as the uint8 numpy array of their bytes (ngram_heads, row bytes): the host
            # gathers a token's rows straight into them
            self._host_ple = {i: view(self._host, i)[0].view(torch.uint8).numpy() for i in cfg.ple}
        else:  # the rows are written by the step's gathers, from the histories the host writes
            ple = {i: self._stored_row_form(i).to(dev) for i in cfg.ple}
            self._hist = {i: view(self._packed, i) for i in cfg.ple}
            self._host_ple = {i: view(self._host, i).numpy() for i in cfg.ple}
        self.inputs = StepInputs(ids=self._ints[0:1], positions=self._ints[1:2],
                                 n_keys=capacity, ple=ple)
        self.capture = dev.type == "cuda" if capture is None else capture
        if self.capture and dev.type != "cuda":
            raise StrataError("graph capture needs a CUDA device")
        # The graphs of one step per way of ending it: "logits" (logits and their argmax, for greedy decoding and
        # for host-side samplers) and "sampled" (a draw by `self.sampler` too), each with its own output buffers;
        # two graphs each (front, rest) where the step splits at the first PLE layer, else one.
        first_ple = min(cfg.ple, default=0)
        self.split: int | None = first_ple if split and first_ple > 0 and self.tables is None else None
        self.graphs: dict[str, tuple[torch.cuda.CUDAGraph, ...]] = {}
        self._carry: dict[str, Carry] = {}  # the front graph's outputs, which the rest reads
        # recorded after the last copy or replay that reads the page-locked buffer
        self._copied: torch.cuda.Event | None = None
        self._read_done: torch.cuda.Event | None = None  # the event `_host_read` records
        self.outs: dict[str, tuple[torch.Tensor, ...]] = {}
        self._sampler = None
        # Running ahead: the id a step chose, read by the next step's feed (the steps run ahead write it there),
        # and two host slots the chosen ids are copied into, each with its event, so the host reads one id while
        # the next is still being computed.
        self._chosen = torch.zeros((), dtype=torch.int64, device=dev)
        self._slots = torch.zeros(2, dtype=torch.int64, pin_memory=pin)
        self._slot_ids = self._slots.numpy()
        self._slot_done = [torch.cuda.Event() for _ in range(2)] if pin else None

    @property
    def can_run_ahead(self) -> bool:
        """Whether `ids_ahead` launches a step before the host reads the previous id: all of it where no PLE rows
        need the host (the model has no PLE layer, or the step gathers the rows itself), else the front of a
        split step (the layers before the first PLE layer; the rest waits for the host's rows)."""
        return self.split is not None or self.tables is not None or not self.model.cfg.ple

    def _device_tables(self, want: bool | None) -> dict[int, tuple[torch.Tensor, NgramTables]] | None:
        """Each PLE layer's table rows as one uint8 tensor the model's device reads (on it, or for a GPU in
        page-locked host memory) with its hashing geometry, where the step is to gather them itself (`want`, or by
        default wherever that is possible on a CUDA device)."""
        m = self.model
        if want is False or not m.cfg.ple or (want is None and m.device.type != "cuda"):
            return None
        out = {}
        for i in m.cfg.ple:
            table = m.w[f"L{i}.ple.table"]
            rows = raw_rows(table)
            if rows is not None and rows.is_contiguous() and rows.dim() == 2:
                rows = rows.view(torch.uint8)
            on_device = rows is not None and rows.device.type == m.device.type and (
                m.device.index is None or rows.device.index in (None, m.device.index))
            pinned = rows is not None and m.device.type == "cuda" and page_locked(rows)
            if not (on_device or pinned) or rows.dim() != 2 or not rows.is_contiguous():
                if want:
                    where = "not one contiguous tensor" if rows is None else f"on {rows.device}"
                    raise StrataError(f"{table.name}: a step that gathers its PLE rows on {m.device} needs the "
                                      f"table's rows in that device's memory or page-locked for it; they are "
                                      f"{where} (--ple-table device or pinned)")
                return None
            out[i] = (rows, NgramTables.of(m.cfg.ple[i], m.cfg, m.device))
        return out

    def _gather_rows(self) -> None:
        """The token's PLE rows gathered on the device from the histories the host staged."""
        for i, (rows, geo) in (self.tables or {}).items():
            out = self.inputs.ple[i]
            self.model.ops.ple_gather(self._hist[i], rows, geo, out.view(torch.uint8).view(out.shape[1], -1))

    def _stored_row_form(self, layer: int) -> torch.Tensor:
        """A (1, ngram_heads, width) tensor of the PLE table's stored row form (row 0 of every head): the
        shape and dtype of the step's static input for that layer."""
        heads = len(self.model.cfg.ple[layer].primes)
        return self.model.w[f"L{layer}.ple.table"].stored_rows(torch.zeros(1, heads, dtype=torch.int64))

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """Run a prompt (eagerly, any length) into the static state; returns its last logits (V,)."""
        if self.state.length + ids.numel() > self.capacity:
            raise StrataError(f"prompt of {ids.numel()} tokens does not fit the capacity {self.capacity}")
        return self.model.forward(ids.to(self.model.device), self.state, last_only=True)[-1]

    @property
    def sampler(self):  # noqa: ANN201 - strata.kernels.sample.DeviceSampler (imported lazily: needs Triton)
        """The device sampler of the "sampled" graph: its parameter buffers are read by the graph, so
        `configure` it between tokens to change the request's parameters."""
        if self._sampler is None:
            from strata.kernels.sample import DeviceSampler

            self._sampler = DeviceSampler(self.model.device)
        return self._sampler

    def _front(self) -> Carry:
        """The layers before the split (none when the step does not split), after the PLE gathers where the
        device does them."""
        m = self.model
        self._gather_rows()
        return m.run_layers(m.begin(self.inputs), self.inputs, self.state, 0, self.split or 0, static=True)

    def _rest(self, carry: Carry, kind: str, chosen: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """The layers after the split, the head and the choice (written into `chosen` where given)."""
        m = self.model
        carry = m.run_layers(carry, self.inputs, self.state, self.split or 0, m.cfg.num_hidden_layers, static=True)
        logits = m.logits(m.finish(carry))[0]
        if kind != "sampled":
            return logits, greedy_token(logits, chosen)
        token = self.sampler(logits)
        return logits, (token if chosen is None else chosen.copy_(token.view(chosen.shape)))

    def _compute(self, kind: str = "logits", ahead: bool = False) -> tuple[torch.Tensor, ...]:
        """The step; `ahead`: run ahead, its inputs advanced from `_chosen` first and its choice written there."""
        if not ahead:
            return self._rest(self._front(), kind)
        return self._rest(self._fed_front(), kind, self._chosen)

    def _fed_front(self) -> Carry:
        """`_front` of a step run ahead: its id, position and n-gram histories fed from `_chosen` first."""
        feed(self._ints, self._chosen, self._starts, self.model.cfg.ngram_size)
        return self._front()

    def _copy_rows(self) -> None:
        """The staged PLE rows copied from the page-locked buffer to the static inputs (not the id and position,
        which a split step run ahead fed itself)."""
        if self._packed.numel() > 16:
            self._packed[16:].copy_(self._host[16:], non_blocking=True)

    def _ready(self) -> None:
        """Before staging a token: room in the state, and the previous token's copies out of the page-locked
        buffer done (so it can be rewritten)."""
        if self.state.length >= self.capacity:
            raise StrataError(f"the sequence reached the decode capacity of {self.capacity} tokens")
        if self._copied is not None:
            self._copied.synchronize()

    def _stage_ple(self, token: int) -> int:
        """The token's host work into the page-locked buffer (its PLE rows, or where the device gathers them its
        n-gram histories), the state advanced; returns the token's position."""
        return self.model.stage_token(token, self.state, self._host_ple, history=self.tables is not None)

    def _copy(self) -> None:
        """The page-locked buffer copied to the static inputs asynchronously (the eager step and the first,
        capturing call; the graphs copy it themselves)."""
        self._packed.copy_(self._host, non_blocking=True)
        if self.model.device.type == "cuda":
            self._host_read()

    def _stage(self, token: int) -> None:
        """Host work for the token into the page-locked buffer, copied to the static inputs asynchronously (one
        copy)."""
        self._ready()
        self._host_ints[0] = token
        self._host_ints[1] = self._stage_ple(token)
        self._copy()

    def _run(self, token: int, kind: str, phases: dict[str, float] | None = None, record: bool = True,
             ) -> tuple[torch.Tensor, ...]:
        """The step's outputs for `token`; `phases` (benchmarks) accumulates the host seconds of each part of a
        replayed step. Without `record` the replays record no event for the next token's `_ready`: the caller
        reads an output before the next token (`next_token_id`), which waits for the whole step."""
        if not self.capture or kind not in self.graphs:
            self._stage(token)
            if not self.capture:
                return self._compute(kind)
            self._capture(kind)
            self.replay(kind)
            return self.outs[kind]
        # the graphs copy their inputs out of the page-locked buffer themselves (their first node), so a token's
        # host work is its hash and rows, written in place, and the replay calls
        graphs = self.graphs[kind]
        t = _lap(phases, "", 0.0)
        self._ready()
        t = _lap(phases, "ready", t)
        self._host_ints[0] = token
        if len(graphs) == 1:
            self._host_ints[1] = self._stage_ple(token)
            t = _lap(phases, "stage", t)
            graphs[0].replay()
            t = _lap(phases, "replay", t)
        else:  # split: the front replayed first; the PLE rows staged while it runs
            self._host_ints[1] = self.state.length
            graphs[0].replay()
            t = _lap(phases, "replay_front", t)
            self.model.stage_token(token, self.state, self._host_ple)
            t = _lap(phases, "stage", t)
            graphs[1].replay()
            t = _lap(phases, "replay", t)
        if record:
            self._host_read()
            _lap(phases, "event", t)
        else:
            self._copied = None  # the caller's read of the outputs is the wait
        return self.outs[kind]

    def _host_read(self) -> None:
        """After the copy or the replays that read the page-locked buffer: the event the next token's `_ready`
        waits on before it rewrites the buffer."""
        self._read_done = self._read_done or torch.cuda.Event()
        self._read_done.record()
        self._copied = self._read_done

    def replay(self, kind: str = "logits") -> None:
        """Replay the captured step's graphs on the inputs already staged (benchmarks: no host work)."""
        for g in self.graphs[kind]:
            g.replay()
        self._host_read()

    @torch.inference_mode()
    def step(self, token: int) -> torch.Tensor:
        """Logits (V,) of one token, continuing the state. Captures the graph on the first CUDA call."""
        return self._run(token, "logits")[0]

    @torch.inference_mode()
    def next_token(self, token: int, sampled: bool = False) -> torch.Tensor:
        """Run one token and choose the next on the device, inside the step: the argmax, or with `sampled` a
        draw by `self.sampler` (configure it first). A (1,)/() int64 device tensor; reading it is the step's
        only host synchronisation."""
        return self._run(token, "sampled" if sampled else "logits")[1]

    @torch.inference_mode()
    def next_token_id(self, token: int, sampled: bool = False) -> int:
        """`next_token` read on the host. Reading the id waits for the whole step, so the step records no event
        for the next token's staging to wait on (an API call that took 0.01-0.05 ms per token on the device
        box's hosts)."""
        return int(self._run(token, "sampled" if sampled else "logits", record=False)[1])

    @torch.inference_mode()
    def ids_ahead(self, token: int, sampled: bool = False) -> Iterator[int]:
        """The ids that follow `token`, each chosen on the device as `next_token_id` chooses it, with the step
        for each next id launched before the host reads the current one (where `can_run_ahead`; else one step
        per id read, as `next_token_id`). When the caller stops after an id (closing the generator, or just not
        asking again), the step that fed it to the state has already run: `state.tokens` ends with every id
        yielded. The ids end with the one chosen at the state's last position, which is not fed (no position is
        left for it), so a caller gets as many ids as from `next_token_id` until the state is full."""
        kind = "sampled" if sampled else "logits"
        if not self.can_run_ahead:
            while True:
                token = self.next_token_id(token, sampled)
                yield token
                if self.state.length >= self.capacity:
                    return
        # A split step launches the front ahead and the rest once the host has staged the id's rows; the front
        # of the step after is launched only when the caller asks for the next id, so a caller that stops leaves
        # no layer fed an id it was not given.
        split = self.split is not None
        self._chosen.copy_(self._run(token, kind, record=False)[1].reshape(()))
        slot = 0
        self._park(slot)
        carry = None
        while True:
            ahead = self.state.length < self.capacity
            if ahead:  # the step (split: its front) for the id not yet read
                carry = self._launch_ahead(kind, 0)
                if not split:
                    self._park(1 - slot)
            if self._slot_done is not None:
                self._slot_done[slot].synchronize()
            token = int(self._slot_ids[slot])
            if not ahead:  # chosen at the last position: nowhere to feed it
                yield token
                return
            if split:
                self.model.stage_token(token, self.state, self._host_ple)
                self._launch_ahead(kind, 1, carry)
                self._park(1 - slot)
                # the next staging of rows (here, or a step the caller runs next) waits for the rest's copy of them
                self._copied = self._slot_done[1 - slot] if self._slot_done is not None else None
            else:
                self.model.fed(token, self.state)
            yield token
            slot = 1 - slot

    def _launch_ahead(self, kind: str, part: int, carry: Carry | None = None) -> Carry | None:
        """Launch part 0 of a step run ahead (all of it, or a split step's front: returns the front's carry where
        the step runs eagerly) or part 1 (a split step's rest, on `carry`), capturing its graphs first."""
        name = f"{kind}+ahead"
        if self.capture:
            if name not in self.graphs:
                self._capture(kind, ahead=True)
            self.graphs[name][part].replay()
            return None
        if self.split is None:
            self._compute(kind, ahead=True)
            return None
        if part == 0:
            return self._fed_front()
        self._copy_rows()
        self._rest(carry, kind, self._chosen)
        return None

    def _park(self, slot: int) -> None:
        """The chosen id copied into a host slot, the slot's event recorded after the copy."""
        self._slots[slot:slot + 1].copy_(self._chosen.view(1), non_blocking=True)
        if self._slot_done is not None:
            self._slot_done[slot].record()

    def _capture(self, kind: str, ahead: bool = False) -> None:
        # The staged token is already in the input buffers (or, `ahead`, the previous choice in `_chosen`): warm
        # up on a side stream with a snapshot of the state (warm-up writes the caches and advances the sampler's
        # step; a step run ahead also its inputs), restore it, then capture; the replay that follows computes the
        # token.
        snapshot = self.state.clone()
        offset = self.sampler.offset.clone() if kind == "sampled" else None
        inputs = (self._packed.clone(), self._chosen.clone()) if ahead else None
        side = side_stream(self.model.device, CAPTURE_LANE)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._compute(kind, ahead)
                self._restore(snapshot, offset, inputs)
        torch.cuda.current_stream().wait_stream(side)
        # Each graph starts with the copy of its inputs out of the page-locked buffer (a memcpy node: the bytes are
        # read when the replay reaches it), so no copy call is left on the host per token; a step run ahead feeds
        # its id and position itself (a split one still copies its rows).
        name = f"{kind}+ahead" if ahead else kind
        chosen = self._chosen if ahead else None  # a step run ahead writes its choice where the next feed reads it
        if self.split is None:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=side):
                if not ahead:
                    self._packed.copy_(self._host, non_blocking=True)
                self.outs[name] = self._compute(kind, ahead)
            self.graphs[name] = (graph,)
        else:  # each graph has its own memory pool, so the rest's buffers never alias the front's outputs
            front, rest = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            with torch.cuda.graph(front, stream=side):
                if ahead:
                    self._carry[name] = self._fed_front()
                else:
                    self._packed[:16].copy_(self._host[:16], non_blocking=True)
                    self._carry[name] = self._front()
            with torch.cuda.graph(rest, stream=side):
                self._copy_rows()
                self.outs[name] = self._rest(self._carry[name], kind, chosen)
            self.graphs[name] = (front, rest)
        self._restore(snapshot, offset, inputs)

    def _restore(self, snapshot: SequenceState, offset: torch.Tensor | None = None,
                 inputs: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        if offset is not None:
            self.sampler.offset.copy_(offset)
        if inputs is not None:
            self._packed.copy_(inputs[0])
            self._chosen.copy_(inputs[1])
        for mine, saved in zip(self.state.layers, snapshot.layers, strict=True):
            for name, t in vars(saved).items():
                if isinstance(t, torch.Tensor):
                    getattr(mine, name).copy_(t)
        for i, saved in snapshot.ple.items():
            self.state.ple[i].conv.copy_(saved.conv)
