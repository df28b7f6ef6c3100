"""Per-size graph runners for graph pieces.

A :class:`GraphLevel` is one dispatch level (the main graph, or the replay region): the
padded size it runs at now, or ``None`` for a step without graphs. Each compiled piece
is wrapped in a :class:`PieceRunner` that keeps one :class:`StaticGraph` per size.

On CUDA a StaticGraph is a ``torch.cuda.CUDAGraph`` captured on the shared stream and
pool. Without CUDA it is emulated faithfully: it keeps the inputs seen at capture and
on every replay recomputes from *those* tensors and copies into the *same* outputs, so
a protocol bug (an eager op that allocates, a moved input) shows up on CPU as stale
data exactly as it would on a GPU.

Graph memory. During :meth:`CompiledReplayModel.capture` a CUDA graph keeps only
non-owning aliases of its outputs, so the capturing step frees them where the step
frees them and later captures in the pool reuse that memory: the pool holds about one
step's activations instead of every output of every piece at every size. That is safe
because graphs replay in the order they were captured, one step at a time, with the
same lifetimes. The exception is a main piece whose outputs are alive across the trim
op (``PieceRunner.keep_outputs``): replay graphs, captured later, run while those are
alive, so those outputs stay owned and the pool never hands their memory out again.
Graphs captured outside ``capture()`` (lazily, in any order) keep their outputs.
"""
from __future__ import annotations

import gc
import logging
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ..fallbacks import Fallback
from ..compat import graphs as compat_graphs
from ..counters import counters
from ..fallbacks import process_fallback
from ..lifecycle import Lifecycle
from ..passes.split import GRAPH_INPUT

log = logging.getLogger("replay_backend")

# What keeps a graph input where its graphs read it.
STABLE_INPUTS = ("A graph input (a weight, a buffer, a tensor argument of the model) must be the same tensor in "
                 "every step: update it in place (copy_) rather than passing or assigning a new one")


@dataclass
class GraphResources:
    """What main and replay graphs share: one pool, one capture stream."""

    use_cuda: bool
    strict: bool = False
    check_every_replay: bool = False
    weak_outputs: bool = False  # graphs hold non-owning output aliases (set by capture())
    # The backend state's phase (lifecycle.py): lazy capture before serving only, kept
    # outputs' bytes recorded while the memory estimate measures.
    lifecycle: Lifecycle = field(default_factory=Lifecycle)
    pool: Any = None
    stream: Any = None
    _logged: set = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.use_cuda:
            self.pool = torch.cuda.graph_pool_handle()
            self.stream = torch.cuda.Stream()

    def fallback(self, reason: str, detail: str) -> None:
        """Count a fallback and log it once per reason, or raise when strict."""
        process_fallback(reason, detail, self.strict, self._logged)


@dataclass
class GraphLevel:
    name: str  # "main" | "replay"
    sizes: list[int]  # kept ascending (config.padded_size bisects them)
    # The padded size its pieces run at now (None: directly), set only for the extent of
    # one run by :meth:`at`, so no step leaves it behind for the next.
    size: int | None = None
    # Whether a piece of this run found no graph of its size while serving: the run's
    # fallback is counted once, not once per piece.
    missed: bool = False

    def __post_init__(self) -> None:
        self.sizes = sorted(set(self.sizes))

    def at(self, size: int | None) -> "_AtSize":
        """Run this level's pieces at ``size`` (their graph of that size; None: directly)
        inside a ``with``."""
        return _AtSize(self, size)


class _AtSize:
    """:meth:`GraphLevel.at`'s context manager: a plain class, entered on every step."""

    __slots__ = ("level", "size", "saved")

    def __init__(self, level: GraphLevel, size: int | None) -> None:
        self.level, self.size = level, size

    def __enter__(self) -> None:
        self.saved, self.level.size = self.level.size, self.size
        self.level.missed = False

    def __exit__(self, *exc) -> None:
        self.level.size = self.saved


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return []


def _map_tensors(fn: Callable, x):
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_map_tensors(fn, item) for item in x)
    return x


@contextmanager
def collection_paused():
    """Automatic garbage collection off for the duration of one capture.

    A collection can free a dropped runner's graphs (Python frees reference cycles only
    then). Destroying a CUDA graph is not permitted while a stream captures, so CUDA
    invalidates the capture in progress and the next launch in it fails. Unreachable
    graphs wait until the capture ends instead. ``torch.cuda.graph`` runs a full
    collection before each capture for the same reason; across thousands of piece graphs
    that would dominate capture time, while pausing costs nothing."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def addresses(args) -> list:
    """What a graph recorded of its arguments: each tensor's address, any other value."""
    return [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]


def capture_into(graph, res: GraphResources, fn: Callable):
    """``fn()`` captured into the CUDA graph ``graph`` on the shared stream and pool;
    returns its outputs (graph memory, written by each replay). capture_begin/end
    rather than ``torch.cuda.graph``: that context runs gc.collect() and
    empty_cache() per graph, which dominates capturing thousands of piece graphs."""
    res.stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(res.stream), collection_paused():
        graph.capture_begin(pool=res.pool)
        try:
            out = fn()
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(res.stream)
    return out


def copy_outputs(outputs, fresh) -> None:
    """An emulated replay's results into the outputs captured (the addresses later
    steps read)."""
    for dst, src in zip(_tensors(outputs), _tensors(fresh)):
        dst.copy_(src)


class StaticGraph:
    """One captured piece at one size. ``owned`` holds the capturing step's outputs until
    that step takes them (:meth:`take_owned`); ``outputs`` is what replays return."""

    def __init__(self, name: str, fn: Callable, args: tuple, res: GraphResources,
                 keep_outputs: bool = True, sources: tuple[str, ...] = ()) -> None:
        self.name, self.fn, self.res, self.sources = name, fn, res, sources
        self.addresses = addresses(args)
        self.replays = 0
        if res.use_cuda:
            self.inputs = None  # the addresses suffice; holding the tensors would pin memory
            self.graph = torch.cuda.CUDAGraph()
            self.owned = capture_into(self.graph, res, lambda: fn(*args))
            weak = res.weak_outputs and not keep_outputs
            self.outputs = _map_tensors(compat_graphs.non_owning_alias, self.owned) if weak else self.owned
        else:
            self.inputs = args  # the emulation recomputes from the captured inputs
            self.graph = None
            with collection_paused():  # as on CUDA, so the CPU tests see the same state
                self.owned = self.outputs = fn(*args)

    def take_owned(self):
        owned, self.owned = self.owned, None
        return owned

    def check_inputs(self, args: tuple) -> None:
        for i, (got, want) in enumerate(zip(addresses(args), self.addresses)):
            if got != want:
                source = self.sources[i] if i < len(self.sources) else ""
                fix = (STABLE_INPUTS if source.startswith(GRAPH_INPUT) else
                       "Every eager op between pieces must write into a buffer allocated by the preceding piece")
                raise RuntimeError(
                    f"{self.name}: input {i}{f' ({source})' if source else ''} changed since capture ({want!r} -> "
                    f"{got!r}); the graph would read stale memory. {fix} (see docs/design.md, Graph invariants).")

    def replay(self, args: tuple):
        if self.replays == 0 or self.res.check_every_replay:
            self.check_inputs(args)
        self.replays += 1
        if self.graph is not None:
            self.graph.replay()
        else:
            copy_outputs(self.outputs, self.fn(*self.inputs))
        return self.outputs


class PieceRunner(nn.Module):
    """A compiled piece, run directly or through its graph for the level's current size."""

    def __init__(self, name: str, fn: Callable, level: GraphLevel, res: GraphResources,
                 source: nn.Module | None = None, keep_outputs: bool = False) -> None:
        super().__init__()
        self.name, self.fn, self.level, self.res = name, fn, level, res
        self.__dict__["source"] = source  # the piece's FX graph, for dumps (not a child module)
        self.graphs: dict[int, StaticGraph] = {}
        self._warm = False
        self.keep_outputs = keep_outputs  # outputs alive across the trim op (passes.split.live_across)
        self.kept_bytes = 0  # their size in the last step run without graphs
        self.input_sources: tuple[str, ...] = ()  # where each input comes from (passes.split.input_sources)

    def forward(self, *args):
        size = self.level.size
        if size is None:
            out = self.fn(*args)
            if self.keep_outputs and self.res.lifecycle.measuring:  # for the graph memory estimate
                self.kept_bytes = sum(t.untyped_storage().nbytes() for t in _tensors(out))
            return out
        graph = self.graphs.get(size)
        if graph is None:
            if not self.res.lifecycle.may_capture:
                if not self.level.missed:
                    self.level.missed = True
                    self.res.fallback(Fallback.UNCAPTURED_SIZE, f"{self.level.name} graphs for size {size} were "
                                      "not captured before serving; running the pieces without graphs")
                return self.fn(*args)
            if self.res.use_cuda and not self._warm:
                # Warm-up before this piece's first capture: compilation, autotuning and
                # first kernel loads happen once per piece (its kernels take any size).
                self.fn(*args)
                self._warm = True
            graph = StaticGraph(f"{self.level.name}:{self.name}[{size}]", self.fn, args, self.res,
                                self.keep_outputs, self.input_sources)
            self.graphs[size] = graph
            counters.captures[self.level.name] += 1
            # Capturing records work without doing it: run it once for this step. This
            # is not the graph's first replay, whose input-address check must see the
            # next step's arguments (the emulated capture already computed the step).
            if graph.graph is not None:
                graph.graph.replay()
            return graph.take_owned()
        return graph.replay(args)

    def extra_repr(self) -> str:
        return f"name={self.name}, level={self.level.name}, captured={sorted(self.graphs)}"
