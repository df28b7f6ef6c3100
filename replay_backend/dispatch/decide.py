"""One decision per step: how a step runs, decided once, before it runs.

The step kind and padded size, whether the replay region trims, the replay graph size,
whether the trim op's gathers and scatter replay as graphs: all follow from the step's
token count and replay rows and from the sizes captured. :func:`plan_step` computes them
as one frozen :class:`StepPlan` on the host before the model runs; the compiled model,
its pieces and the trim op only execute it, and what a step did is that record.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

from ..config import padded_size
from .agree import Agreement


class StepKind(str, enum.Enum):
    FULL = "full"  # the whole step, attention included, in one graph at a padded size
    PIECEWISE = "piecewise"  # main layers in graph pieces at a padded size, attention between them
    EAGER = "eager"  # main layers without graphs: above the largest size, or graphs off


@dataclass(frozen=True)
class StepResult:
    """What one step of a compiled model did: its plan, decided before it ran.

    ``kind`` says how the main layers ran: in one FULL graph or in PIECEWISE graphs at
    ``padded_tokens``, or eagerly (``padded_tokens == num_tokens``). In a FULL step the
    replay layers ran inside that graph, on every row. The replay fields describe the replay
    layers where the model has a replay region in use (``has_region``): ``trimmed``
    when they ran on the replay rows only, ``replay_rows`` the rows they ran on before
    padding (the step's tokens when not trimmed), ``replay_padded`` the graph size they
    ran at (None: without a graph), ``io_graphs`` whether the trim op's gathers and
    scatter replayed as graphs too."""

    kind: StepKind
    num_tokens: int
    padded_tokens: int
    has_region: bool
    trimmed: bool
    replay_rows: int
    replay_padded: int | None
    io_graphs: bool

    @property
    def replay_graph(self) -> bool:
        """The replay layers ran in graphs (their own, or the main graphs' when untrimmed)."""
        return self.replay_padded is not None

    @property
    def step_info(self) -> "StepInfo":
        """The main layers' part (kind, tokens, padded tokens)."""
        return StepInfo(self.kind.value, self.num_tokens, self.padded_tokens)

    @property
    def trim_record(self) -> "TrimRecord | None":
        """The replay region's part, None without a region."""
        if not self.has_region:
            return None
        return TrimRecord(self.trimmed, self.replay_rows, self.replay_padded, self.replay_graph, self.io_graphs)

    def as_dict(self) -> dict:
        return {"kind": self.kind.value, "num_tokens": self.num_tokens, "padded_tokens": self.padded_tokens,
                "has_region": self.has_region, "trimmed": self.trimmed, "replay_rows": self.replay_rows,
                "replay_padded": self.replay_padded, "replay_graph": self.replay_graph,
                "io_graphs": self.io_graphs}


class StepInfo(NamedTuple):
    """The main layers' part of a plan (``StepOutput.step``)."""

    kind: str  # "full" | "piecewise" | "eager"
    num_tokens: int
    padded_tokens: int


class TrimRecord(NamedTuple):
    """The replay region's part of a plan (``StepOutput.trim``, ``verify --json``)."""

    trimmed: bool
    rows: int  # replay rows when trimmed, else the step's tokens (both before padding)
    padded: int | None  # replay graph size, None when the region ran without graphs
    graph: bool
    io_graphs: bool = False  # the gathers and scatter ran as graphs too (trim_io.py)


@dataclass(frozen=True)
class Sizes:
    """What a decision reads besides the step: the captured sizes, ascending."""

    main: tuple[int, ...] = ()  # main graph sizes (empty: no main graphs)
    replay: tuple[int, ...] = ()  # sizes a trimmed region pads to
    region: frozenset[int] = frozenset()  # every size the region's pieces have graphs at
    trim_threshold: int | None = None  # graphed steps padded to this or more trim; None: never
    io_pairs: frozenset[tuple[int, int]] = frozenset()  # (main, replay) sizes with gather/scatter graphs
    has_region: bool = False  # a replay region exists (the trim op is in the graph)
    full: tuple[int, ...] = ()  # sizes with a FULL graph captured (none of them trims)


@dataclass(frozen=True)
class StepPlan:
    kind: StepKind
    num_tokens: int
    padded_tokens: int  # the main layers' size: the graph size, or the token count
    trim: bool  # the region runs on the replay rows (else on every row)
    region_rows: int  # rows the region gets before padding: replay rows, or the padded tokens
    replay_padded: int | None  # the region's graph size; None: it runs without graphs
    io_graphs: bool  # the trim op's gathers and scatter replay as graphs
    has_region: bool
    # Rows the region runs on, padding included: its graph size, or without a graph the
    # data-parallel ranks' largest replay rows (this rank's own rows where none agreed).
    region_padded: int = 0

    @property
    def result(self) -> StepResult:
        """The plan as the public record of what the step did."""
        rows = self.region_rows if self.trim else self.num_tokens
        # In a FULL step the region runs directly inside the step's one graph.
        replay = self.region_read_by
        return StepResult(self.kind, self.num_tokens, self.padded_tokens, self.has_region, self.trim, rows,
                          replay if self.has_region else None, self.io_graphs)

    @property
    def region_read_by(self) -> int | None:
        """The size of the graph that reads the replay layers' view (for the model's
        host plans, ``prepare_view``): the step's FULL graph, or the region's replay
        graph; None where the replay layers run without one."""
        return self.padded_tokens if self.kind is StepKind.FULL else self.replay_padded

    @property
    def graphed(self) -> bool:
        """The main layers run at a padded size (FULL or PIECEWISE)."""
        return self.kind is not StepKind.EAGER

    @property
    def runs_graphs(self) -> bool:
        """Some graph runs in the step: the main layers' or the replay region's."""
        return self.graphed or self.replay_padded is not None

    @property
    def step(self) -> StepInfo:
        return self.result.step_info

    @property
    def record(self) -> TrimRecord | None:
        """What the trim op did, or None for a model without a replay region."""
        return self.result.trim_record


def main_size(sizes: Sizes, num_tokens: int, use_graphs: bool = True) -> int | None:
    """The main graph size a step of ``num_tokens`` pads to, or None: without graphs."""
    return padded_size(sizes.main, num_tokens) if use_graphs and sizes.main else None


def wants_trim(sizes: Sizes, padded: int | None, trimmable: bool) -> bool:
    """A graphed step trims from the threshold on (whether or not anything is
    trimmable: then every row is a replay row); a step without main graphs trims when a
    prefill is longer than the window."""
    if padded is not None:
        return sizes.trim_threshold is not None and padded >= sizes.trim_threshold
    return trimmable


def plan_step(sizes: Sizes, num_tokens: int, replay_rows: int, trimmable: bool, *, use_graphs: bool = True,
              region_graphs: bool = True, agreement: Agreement | None = None, full: bool = False) -> StepPlan:
    """How a step of ``num_tokens`` with ``replay_rows`` replay rows runs.

    ``use_graphs`` false: no graph at all (warm-up and memory probes). ``region_graphs``
    false: the region runs without graphs (while the main graphs are captured).
    ``agreement``: what the data-parallel ranks agreed (agree.py): every rank pads to
    the largest rank's tokens and replay rows, and trims where the agreed step trims.
    ``full``: the step's batch may run as one FULL graph (laid out for it, and a batch
    its attention takes inside one); it does where a FULL size fits."""
    rows_max = replay_rows
    if agreement is not None:
        use_graphs, trimmable = use_graphs and agreement.graphs, agreement.trimmable
        rows_max = max(replay_rows, agreement.replay_rows)
        full = full and agreement.full
    tokens = num_tokens if agreement is None else max(num_tokens, agreement.tokens)
    if full and use_graphs and sizes.full:
        padded = padded_size(sizes.full, tokens)
        if padded is not None:  # FULL sizes never trim: the region runs on every row
            return StepPlan(StepKind.FULL, num_tokens, padded, trim=False, region_rows=padded, replay_padded=None,
                            io_graphs=False, has_region=sizes.has_region, region_padded=padded)
    padded = main_size(sizes, tokens, use_graphs)
    trim = wants_trim(sizes, padded, trimmable) if sizes.has_region else False
    kind = StepKind.PIECEWISE if padded is not None else StepKind.EAGER
    padded = padded if padded is not None else tokens  # eager: the largest rank's count
    rows = replay_rows if trim else padded
    replay = None
    if sizes.has_region and use_graphs and region_graphs and sizes.region:
        if trim:
            replay = padded_size(sizes.replay, rows_max)
        elif kind is StepKind.PIECEWISE and padded in sizes.region:
            replay = padded
    io = kind is StepKind.PIECEWISE and trim and replay is not None and (padded, replay) in sizes.io_pairs
    region_padded = replay if replay is not None else (rows_max if trim else padded)
    return StepPlan(kind, num_tokens, padded, trim, rows, replay, io, sizes.has_region, region_padded)
