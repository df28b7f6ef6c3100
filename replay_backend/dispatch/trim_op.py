"""The replay-region runtime behind the trim-and-redispatch op (``replay_backend/ops.py``).

The op sits in the main graph where the replay region was. It executes the step's
plan (decide.py, made before the step ran): it gathers the replay rows into static
buffers padded to the plan's replay size, runs the region (its pieces in replay
graphs, attention eager on the replay batch), and writes the results into ``outs``,
which the preceding piece allocated so the next piece reads a stable address.
"""
from __future__ import annotations

import dataclasses
import time
from collections import deque

import torch
from torch import nn

from ..config import ReplayConfig
from ..counters import counters
from ..forward_context import get_forward_context
from ..capture.graphs import GraphLevel, GraphResources
from ..fallbacks import Fallback
from .decide import Sizes, StepKind, StepPlan, plan_step
from .row_moves import RowMoves
from .trim_io import TrimIO


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` with zero rows appended up to ``rows`` (token 0 at position 0, as graphs pad)."""
    out = x.new_zeros((rows, *x.shape[1:]))
    out[:x.shape[0]] = x
    return out


class ReplayRuntime:
    def __init__(self, region: nn.Module, cfg: ReplayConfig, window: int, level: GraphLevel,
                 replay_sizes: list[int], res: GraphResources, main_sizes: list[int] | None = None,
                 computed_consts: tuple[int, ...] = ()) -> None:
        self.region, self.cfg, self.window = region, cfg, window
        self.level, self.res = level, res
        self.replay_sizes = sorted(replay_sizes)  # sizes a trimmed step pads to (ascending)
        # Main sizes whose steps trim (PIECEWISE, at or above the threshold): their gathers
        # and scatter become graphs too (trim_io.py).
        self.trim_main_sizes = sorted(s for s in main_sizes or [] if s >= cfg.decoder_replay_trim_threshold) \
            if cfg.cudagraph_decoder_replay and cfg.trim_io_graphs and replay_sizes else []
        self.io: TrimIO | None = None
        self.moves = RowMoves(res.fallback)  # gathers and scatter without trim I/O graphs
        self._moves_warm = False
        self.buffers: list[torch.Tensor] | None = None
        self._views: dict[int, list[torch.Tensor]] = {}
        self.consts: list[torch.Tensor] | None = None
        # The constants the main layers compute each step, held where the region's graphs
        # read them: a new allocation or another graph's pool moves them between steps.
        self.computed_consts = computed_consts
        self._held: dict[int, torch.Tensor] | None = None
        self.metadata = None  # the serving backend's MetadataBuffer (use_metadata_buffer)
        self.trim_refused: str | None = None  # why no step trims any more (refuse_trim)
        threshold = cfg.decoder_replay_trim_threshold if cfg.cudagraph_decoder_replay else None
        # What each step's decision reads (decide.py); io_pairs grow as capture makes them.
        self.sizes = Sizes(tuple(sorted(main_sizes or [])), tuple(self.replay_sizes), frozenset(level.sizes),
                           threshold, frozenset(), has_region=True)
        # Host time of the op itself (gather, pad, scatter), without the region; the step's
        # decision is made before the step (decide.py), outside this time.
        self.host_us: deque[float] = deque(maxlen=4096)
        self._region_s = 0.0

    def _static_inputs(self, rows: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.buffers is None:
            n = max(self.level.sizes)
            # Made in the first step, read and written by every later one, in inference
            # mode or out of it: ordinary tensors either way.
            with torch.inference_mode(False):
                self.buffers = [torch.zeros((n, *x.shape[1:]), dtype=x.dtype, device=x.device) for x in rows]
                if self.trim_main_sizes:
                    self.io = TrimIO(n, max(self.trim_main_sizes), rows[0].device, self.res)
            if self.io is not None and self.metadata is not None:
                self.io.adopt(self.metadata)
        return self.buffers

    def _hold(self, consts: list[torch.Tensor]) -> list[torch.Tensor]:
        if not self.computed_consts:
            return consts
        if self._held is None:  # the traced strides, which the region's compiled pieces expect
            with torch.inference_mode(False):  # written by steps in and out of inference mode
                self._held = {i: torch.empty_strided(consts[i].shape, consts[i].stride(), dtype=consts[i].dtype,
                                                     device=consts[i].device) for i in self.computed_consts}
        for i, held in self._held.items():
            held.copy_(consts[i])
        return [self._held.get(i, c) for i, c in enumerate(consts)]

    def use_metadata_buffer(self, metadata) -> None:
        """Served steps' replay count and rows will be at the head of ``metadata`` (the
        backend's MetadataBuffer): the gather graphs, captured later, read them there."""
        self.metadata = metadata
        if self.io is not None:
            self.io.adopt(metadata)

    def _sliced(self, rows: list[torch.Tensor], size: int) -> list[torch.Tensor]:
        """The static buffers at ``size`` rows (kept: slicing is host time per step)."""
        views = self._views.get(size)
        if views is None:
            views = self._views[size] = [b[:size] for b in self._static_inputs(rows)]
        return views

    def run_region(self, inputs, consts, size: int | None):
        t0 = time.perf_counter()
        try:
            with self.level.at(size):
                return self.region(inputs[0].shape[0], *inputs, *consts)
        finally:
            self._region_s += time.perf_counter() - t0

    def trimmable(self, batch) -> bool:
        """Whether this step has rows to trim, as far as this region goes."""
        return batch.has_trimmable_rows and self.trim_refused is None

    def refuse_trim(self, why: str) -> None:
        """No step trims from now on (a counted fallback; an error under ``strict``):
        ``why``, a later graph of the step reads the region's rows together."""
        if self.trim_refused is None:
            self.res.fallback(Fallback.REPLAY_REGION_UNSUPPORTED, f"no step trims the replay region: a later graph "
                              f"of the step reads its rows together ({why}), and a trim leaves all but the kept rows "
                              "unwritten; keep what follows replay_end in the markers' graph (no graph break there)")
            self.trim_refused = why
            # A graphed step trims from the threshold on, trimmable rows or not (decide.py).
            self.sizes = dataclasses.replace(self.sizes, trim_threshold=None)

    def plan(self, batch, num_tokens: int, use_graphs: bool = True, agreement=None, full: bool = False) -> StepPlan:
        """The step's one decision (decide.py), with what the data-parallel ranks agreed."""
        capturing_main = self.res.lifecycle.capturing_main  # the region runs without graphs meanwhile
        return plan_step(self.sizes, num_tokens, batch.replay.num_rows, self.trimmable(batch),
                         use_graphs=use_graphs, region_graphs=not capturing_main, agreement=agreement, full=full)

    def __call__(self, rows: list[torch.Tensor], consts: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        """Execute the step's plan: gather, run the region, scatter."""
        t0 = time.perf_counter()
        self._region_s = 0.0
        ctx = get_forward_context()
        plan = ctx.plan
        batch = ctx.batch
        rep = batch.replay
        self.consts = consts = self._hold(consts)
        if self.buffers is None and self.sizes.region:
            self._static_inputs(rows)
        size = plan.replay_padded
        if self.io is not None and plan.kind is StepKind.PIECEWISE and self.res.lifecycle.capturing_main:
            self.io.remember(plan.padded_tokens, rows, outs)
        bufs = None if size is None else (self._views.get(size) or self._sliced(rows, size))
        # In a FULL step the region runs directly (``size`` None) inside the step's
        # graph, whose size its view was planned for before the graph ran.
        with ctx.activate(rep.view if plan.trim else ctx.region_view, plan.region_read_by):
            if plan.io_graphs:
                if rep.count_rows.data_ptr() != self.io.index_ptr:  # not built in place
                    self.io.stage(rep.count_rows)
                self.io.run(plan.padded_tokens, size, rows, bufs, lambda: self.run_region(bufs, consts, size), outs)
                res = None
            elif bufs is None:
                inputs = [x.index_select(0, rep.rows_t) for x in rows] if plan.trim else rows
                if plan.trim and plan.region_padded > rep.num_rows:  # to the largest rank's rows
                    inputs = [pad_rows(x, plan.region_padded) for x in inputs]
                res = self.run_region(inputs, consts, None)
            else:
                if plan.trim:
                    self.moves.gather(rows, bufs, rep.rows_t)
                else:
                    for b, x in zip(bufs, rows):
                        b.copy_(x[:size])
                res = self.run_region(bufs, consts, size)
        if res is not None and plan.trim:
            self.moves.scatter(res, outs, rep.rows_t)
        elif res is not None:
            for o, r in zip(outs, res):
                o.copy_(r[:o.shape[0]])
        if plan.kind is StepKind.FULL:  # captured in the step's graph: a replay runs none of this
            return
        if plan.trim:
            counters.trims += 1
            self.host_us.append((time.perf_counter() - t0 - self._region_s) * 1e6)
        else:
            counters.untrimmed += 1
        counters.replay_dispatch[size if size is not None else "eager"] += 1

    def start_serving(self) -> None:
        """No capture from now on; the region's buffers at every replay size are kept
        (``_views``), so no served step slices them."""
        if self.buffers is not None:
            for size in self.replay_sizes:
                self._sliced(self.buffers, size)

    def capture(self, size: int, view) -> int:
        """Capture the region's graphs for ``size`` on a dummy replay batch, then the
        trim op's gather and scatter graphs for every trimming main size and this replay
        size. Returns how many of the latter were captured."""
        res = self._run_dummy(size, view, graphs=True)
        if self.res.use_cuda and not self._moves_warm:
            self._moves_warm = True
            self.moves.warm(self.buffers, list(res))
        if self.io is None or size not in self.replay_sizes:
            return 0
        n = self.io.capture(size, self._sliced(self.buffers, size), list(res), self.trim_main_sizes)
        self.sizes = dataclasses.replace(self.sizes, io_pairs=frozenset(self.io.graphs))
        return n

    def run_direct(self, size: int, view) -> None:
        """Run the region without graphs on a dummy replay batch of ``size`` rows."""
        self._run_dummy(size, view, graphs=False)

    def _run_dummy(self, size: int, view, graphs: bool):
        if self.consts is None or self.buffers is None:
            raise RuntimeError("run one step through the compiled model before capturing replay graphs")
        bufs = self._sliced(self.buffers, size)
        size = size if graphs else None
        with get_forward_context().activate(view, size):
            return self.run_region(bufs, self.consts, size)
