"""Graph memory estimate before capture, so the cost is known before it is paid.

All graphs share one pool and keep non-owning outputs (``capture/graphs.py``), so the
pool settles at about one step's activations at the largest main size, plus the
outputs that stay owned because they are alive across the trim op (one set per main
size), plus whatever the replay graphs need beyond the memory the main step freed.
The estimate measures the peaks by running one step at the largest main size and
the region at the largest replay size without graphs, on the caching allocator the pool
uses, and scales the owned outputs linearly in the token count. FULL graphs are
captured first, into the same pool: the largest one's step is run too, as its graph
will hold it (attention reading the graph layout, whose scratch may be sized for the
longest sequence the cache holds rather than the step's), and the pool covers the
largest of those peaks.

On top of that every captured graph costs device memory of its own (the instantiated
graph and the pool's segment rounding). That part is not measurable without
capturing, so it is a per-graph constant, ``PER_GRAPH_BYTES``, fitted on an H200
(CUDA 13), which keeps the estimate an upper bound (docs/benchmarks.md).
"""
from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass
from typing import Callable, Iterator

import torch

from ..lifecycle import Phase

GIB = 2 ** 30
PER_GRAPH_BYTES = 3 * 2 ** 18  # 0.75 MiB


@dataclass(frozen=True)
class GraphMemoryEstimate:
    main_peak_bytes: int  # activations of one step at the largest main size
    kept_bytes: int  # outputs alive across the trim op, summed over the main sizes
    replay_peak_bytes: int  # the region at the largest replay size
    graphs: int  # graphs capture() will take (sizes x graph pieces, both levels)
    per_graph_bytes: int
    total_bytes: int
    full_graphs: int = 0  # FULL graphs capture() will take, one per FULL size
    full_output_bytes: int = 0  # their outputs, which each keeps (summed over the FULL sizes)
    full_peak_bytes: int = 0  # activations of the largest FULL step, as its graph holds it

    @property
    def total_gib(self) -> float:
        return self.total_bytes / GIB

    def as_dict(self) -> dict:
        return {**asdict(self), "total_gib": self.total_gib}


@contextlib.contextmanager
def _peak() -> Iterator[list[int]]:
    """Yields a one-item list that holds the peak allocated bytes above the start."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = [0]
    try:
        yield result
    finally:
        torch.cuda.synchronize()
        result[0] = max(0, torch.cuda.max_memory_allocated() - base)


def estimate_graph_memory(model, run_step_without_graphs: Callable[[int], object],
                          replay_view_for: Callable[[int], object],
                          per_graph_bytes: int = PER_GRAPH_BYTES,
                          run_full_step: Callable[[int], object] | None = None) -> GraphMemoryEstimate:
    """``model`` is a CompiledReplayModel before capture; see its method of this name."""
    if not model.res.use_cuda:
        raise RuntimeError("estimate_graph_memory needs CUDA graphs: this model runs on "
                           f"{'CPU' if not torch.cuda.is_available() else 'inputs not on CUDA'} "
                           "or with cudagraph_mode='none'")
    if model.serving or model.captured_sizes("main") or model.captured_sizes("replay") or model.full.graphs:
        raise RuntimeError("estimate_graph_memory must run before any graph is captured")
    main_sizes = sorted(model.main_level.sizes)
    full_sizes = list(model.full_policy.sizes) if model.full_policy is not None else []
    kept_runners = [r for r in model.runners("main") if r.keep_outputs]
    main_peak = kept_at_max = replay_peak = out_row_bytes = full_peak = 0
    measured = max(main_sizes[-1:] + full_sizes[-1:], default=0)
    if measured:
        with _measuring(model):
            with _peak() as p:
                run_step_without_graphs(measured)
        main_peak = p[0]
        kept_at_max = sum(r.kept_bytes for r in kept_runners)
        out_row_bytes = model.output_row_bytes
    if full_sizes and run_full_step is not None:
        with _measuring(model), _peak() as p:
            run_full_step(full_sizes[-1])
        full_peak = p[0]
    rep = model.replay
    if rep is not None and rep.replay_sizes and rep.consts is not None:
        n = max(rep.level.sizes)
        with _peak() as p:
            rep.run_direct(n, replay_view_for(n))
        replay_peak = p[0]
    top = main_sizes[-1] if main_sizes else 1
    kept = sum(kept_at_max * s // top for s in main_sizes)
    # The largest step's owned outputs are inside its peak; the other sizes add theirs
    # (without main graphs nothing stays owned, and the peak is all there is).
    after_main = main_peak + kept - kept_at_max if main_sizes else main_peak
    # The largest FULL step's outputs are inside its peak and stay with its graph:
    # they are counted with the other FULL graphs' outputs, below.
    full_work = max(0, full_peak - out_row_bytes * full_sizes[-1]) if full_peak else 0
    pools = max(after_main, kept + replay_peak, full_work)
    graphs = len(main_sizes) * len(model.runners("main"))
    if rep is not None:
        graphs += len(rep.level.sizes) * len(model.runners("replay"))
        graphs += 2 * len(rep.trim_main_sizes) * len(rep.replay_sizes)  # trim_io.py
    # A FULL graph holds every piece's kernels and keeps its outputs; its activations
    # reuse the pool's memory like any other graph's.
    full_out = out_row_bytes * sum(full_sizes)
    pieces = len(model.runners("main")) + (len(model.runners("replay")) if rep is not None else 0)
    full_graph_bytes = len(full_sizes) * max(1, pieces) * per_graph_bytes
    return GraphMemoryEstimate(main_peak, kept, replay_peak, graphs, per_graph_bytes,
                               pools + graphs * per_graph_bytes + full_out + full_graph_bytes,
                               len(full_sizes), full_out, full_peak)


@contextlib.contextmanager
def _measuring(model) -> Iterator[None]:
    """Steps run without graphs, as the estimate's (a FULL step runs its graph's work),
    leaving no trace in what inspection reports of the model's steps."""
    life = model.res.lifecycle
    kept = model.last_plan, life.last_plan, {k: c.copy() for k, c in model.dispatch.items()}
    life.advance(Phase.MEASURING)
    try:
        yield
    finally:
        life.advance(Phase.WARMING)
        model.last_plan, life.last_plan, model.dispatch = kept
