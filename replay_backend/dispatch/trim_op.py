"""The trim-and-redispatch op and the replay-region runtime behind it (SPEC §4-§6).

The op sits in the main graph where the replay region was. Per step it decides
whether to trim (SPEC §5), gathers the replay rows into static buffers, pads them to a
replay capture size, runs the region (its pieces in replay graphs, attention eager on
the replay batch), and writes the results into ``outs``, which the preceding piece
allocated so the next piece reads a stable address.
"""
from __future__ import annotations

import time
from collections import deque
from typing import NamedTuple

import torch
from torch import nn

from .. import torch_compat
from ..config import ReplayConfig, padded_size
from ..counters import counters
from ..forward_context import get_forward_context
from ..oplib import define_op, no_output
from ..capture.graphs import GraphLevel, GraphResources
from .row_moves import RowMoves
from .trim_io import TrimIO


class TrimRecord(NamedTuple):
    """What the trim op did in one step (``StepOutput.trim``, ``verify --json``). A named
    tuple: the op makes one per step, and a frozen dataclass costs several times as much
    host time to build."""

    trimmed: bool
    rows: int  # replay rows when trimmed, else the step's tokens (both before padding)
    padded: int | None  # replay graph size, None when the region ran without graphs
    graph: bool
    io_graphs: bool = False  # the gathers and scatter ran as graphs too (trim_io.py)


def _trim_and_redispatch(rows: list[torch.Tensor], consts: list[torch.Tensor],
                         outs: list[torch.Tensor], region: int) -> None:
    runtime = get_forward_context().replay_runtime
    if runtime is None:
        raise RuntimeError("trim_and_redispatch ran outside a dsv41_replay compiled model")
    runtime(rows, consts, outs)


trim_and_redispatch = define_op(
    "dsv41_replay::trim_and_redispatch",
    "(Tensor[] rows, Tensor[] consts, Tensor(a!)[] outs, int region) -> ()",
    _trim_and_redispatch, no_output, torch_compat.step_dependent_tags())


def dp_agree(needs: bool, rows: int, group) -> tuple[bool, int]:
    """All-reduce (max) of ``[needs, rows]`` over the data-parallel group."""
    import torch.distributed as dist

    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    t = torch.tensor([int(needs), rows], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    needs_any, rows_max = t.tolist()
    return bool(needs_any), int(rows_max)


class ReplayRuntime:
    def __init__(self, region: nn.Module, cfg: ReplayConfig, window: int, level: GraphLevel,
                 replay_sizes: list[int], res: GraphResources, dp_group=None,
                 main_sizes: list[int] | None = None) -> None:
        self.region, self.cfg, self.window = region, cfg, window
        self.dp_group = dp_group  # data-parallel ranks that must replay together (SPEC §6)
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
        self.metadata = None  # the serving runner's MetadataBuffer (use_metadata_buffer)
        # What served trims look up (start_serving; empty before it and with data-parallel
        # agreement): replay rows -> replay size, as a list (empty: the served path is
        # off); the graphed trims by (main size, replay size), and those main sizes.
        self._served_pad: list[int] = []
        self._served: dict[tuple[int, int], tuple] = {}
        self._served_sizes: frozenset[int] = frozenset()
        self.capture_phase = False  # main graphs are being captured: run the region directly
        # Host time of the op itself (decision, gather, pad, scatter), without the region.
        self.host_us: deque[float] = deque(maxlen=4096)
        self._region_s = 0.0

    def _static_inputs(self, rows: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.buffers is None:
            n = max(self.level.sizes)
            self.buffers = [torch.zeros((n, *x.shape[1:]), dtype=x.dtype, device=x.device) for x in rows]
            if self.trim_main_sizes:
                self.io = TrimIO(n, max(self.trim_main_sizes), rows[0].device, self.res)
                if self.metadata is not None:
                    self.io.adopt(self.metadata)
        return self.buffers

    def use_metadata_buffer(self, metadata) -> None:
        """Served steps' replay count and rows will be at the head of ``metadata`` (a
        runner's MetadataBuffer): the gather graphs, captured later, read them there."""
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
        self.level.size = size
        t0 = time.perf_counter()
        try:
            return self.region(inputs[0].shape[0], *inputs, *consts)
        finally:
            self.level.size = None
            self._region_s += time.perf_counter() - t0

    def __call__(self, rows: list[torch.Tensor], consts: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        t0 = time.perf_counter()
        ctx = get_forward_context()
        step = ctx.step
        if self._served_pad and step is not None and ctx.use_graphs \
                and (step.padded_tokens in self._served_sizes or step.kind == "eager") \
                and self._served_trim(ctx, step, rows, consts, outs, t0):
            return
        self._dispatch(ctx, step, rows, consts, outs, t0)

    def _served_trim(self, ctx, step, rows, consts, outs, t0: float) -> bool:
        """A served step that trims into a replay graph (the common case) on a path of
        its own; False, having done nothing, for any other step. The op runs right after
        the step's main layers with the host's caches cold, where every line of the
        general path below costs microseconds: this path halves the op's Python.
        Its effect, counters and record are those of the general
        path's branch for the same step (tests/test_backend.py runs steps through both)."""
        batch = ctx.batch
        rep = batch.replay
        n = len(rep.rows)
        if n >= len(self._served_pad):
            return False  # more replay rows than the largest replay graph
        size = self._served_pad[n]
        if step.kind == "piecewise":  # gathers and scatter as graphs (trim_io.py)
            plan = self._served.get((step.padded_tokens, size))
            if plan is None:
                return False
            gather, scatter, bufs, gtail, stail = plan
            if rep.count_rows.data_ptr() != self.io.index_ptr:  # not built in place
                self.io.stage(rep.count_rows)
        elif n < batch.view.num_tokens:  # main layers without graphs: one launch each way
            gather = None
            bufs = self._views[size]
        else:
            return False  # an eager step trims only a prefill longer than W (SPEC §5)
        self._region_s = 0.0
        saved, ctx.active = ctx.active, rep.view  # ctx.activate(), without its three frames
        try:
            if gather is not None:
                gather.replay((*rows, *bufs, *gtail))
                scatter.replay((*self.run_region(bufs, consts, size), *outs, *stail))
            else:
                self.moves.gather(rows, bufs, rep.rows_t)
                res = self.run_region(bufs, consts, size)
        finally:
            ctx.active = saved
        if gather is None:
            self.moves.scatter(res, outs, rep.rows_t)
        counters.trims += 1
        counters.replay_dispatch[size] += 1
        # tuple.__new__: the named tuple's own __new__ is a Python frame, about 10 us here
        ctx.last_trim = tuple.__new__(TrimRecord, (True, n, size, True, gather is not None))
        self.host_us.append((time.perf_counter() - t0 - self._region_s) * 1e6)
        return True

    def _dispatch(self, ctx, step, rows, consts, outs, t0: float) -> None:
        """Every step: decide (SPEC §5), gather, run the region, scatter."""
        self._region_s = 0.0
        batch = ctx.batch
        self.consts = consts
        if self.level.sizes:
            self._static_inputs(rows)
        piecewise = step is not None and step.kind == "piecewise"
        if piecewise:
            trim = self.cfg.cudagraph_decoder_replay and step.padded_tokens >= self.cfg.decoder_replay_trim_threshold
        else:
            trim = batch.has_trimmable_rows
        rep = batch.replay
        rows_max = rep.num_rows if trim else 0
        if self.dp_group is not None and not self.capture_phase:
            # Every rank replays if any does (a rank with nothing to trim runs all its rows
            # as replay rows), and all pad to the size that fits the largest rank.
            trim, rows_max = dp_agree(trim, rows_max, self.dp_group)
        n = rep.num_rows if trim else rows[0].shape[0]
        if self.capture_phase or not self.level.sizes or not ctx.use_graphs:
            size = None
        elif trim:
            size = padded_size(self.replay_sizes, max(n, rows_max))
        else:
            size = n if piecewise and n in self.level.sizes else None
        view = rep.view if trim else batch.view
        io_pair = (step.padded_tokens, size) if piecewise and trim and size is not None else None
        if self.capture_phase and piecewise and self.io is not None:
            self.io.remember(step.padded_tokens, rows, outs)
        with ctx.activate(view):
            if io_pair is not None and self.io is not None and io_pair in self.io.graphs:
                bufs = self._sliced(rows, size)
                if rep.count_rows.data_ptr() != self.io.index_ptr:  # not built in place
                    self.io.stage(rep.count_rows)
                self.io.run(*io_pair, rows, bufs, lambda: self.run_region(bufs, consts, size), outs)
                res = None
            elif size is None:
                inputs = [x.index_select(0, rep.rows_t) for x in rows] if trim else rows
                res = self.run_region(inputs, consts, None)
            else:
                bufs = self._sliced(rows, size)
                if trim:
                    self.moves.gather(rows, bufs, rep.rows_t)
                else:
                    for b, x in zip(bufs, rows):
                        b.copy_(x[:size])
                res = self.run_region(bufs, consts, size)
        if res is not None and trim:
            self.moves.scatter(res, outs, rep.rows_t)
        elif res is not None:
            for o, r in zip(outs, res):
                o.copy_(r[:o.shape[0]])
        counters.trims += int(trim)
        counters.untrimmed += int(not trim)
        counters.replay_dispatch[size if size is not None else "eager"] += 1
        ctx.last_trim = TrimRecord(trim, n if trim else batch.num_tokens, size, size is not None,
                                   io_graphs=res is None)
        if trim:
            self.host_us.append((time.perf_counter() - t0 - self._region_s) * 1e6)

    def start_serving(self) -> None:
        """No capture from now on. Served steps that trim into replay graphs take
        :meth:`_served_trim`, with what it looks up kept here (not with data-parallel
        ranks, which agree first, nor before any step ran)."""
        self.level.may_capture = False
        if self.dp_group is not None or not self.replay_sizes or self.buffers is None:
            return
        self._served_pad = [padded_size(self.replay_sizes, n) for n in range(self.replay_sizes[-1] + 1)]
        for size in self.replay_sizes:  # the region's buffers at every replay size, in _views
            self._sliced(self.buffers, size)
        if self.io is not None:
            self._served = {pair: (gather, scatter, self._views[pair[1]], *self.io.tails(*pair))
                            for pair, (gather, scatter) in self.io.graphs.items()}
            self._served_sizes = frozenset(size for size, _ in self._served)

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
        return self.io.capture(size, self._sliced(self.buffers, size), list(res), self.trim_main_sizes)

    def run_direct(self, size: int, view) -> None:
        """Run the region without graphs on a dummy replay batch of ``size`` rows."""
        self._run_dummy(size, view, graphs=False)

    def _run_dummy(self, size: int, view, graphs: bool):
        if self.consts is None or self.buffers is None:
            raise RuntimeError("run one step through the compiled model before capturing replay graphs")
        bufs = self._sliced(self.buffers, size)
        with get_forward_context().activate(view):
            return self.run_region(bufs, self.consts, size if graphs else None)
