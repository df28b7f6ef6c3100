"""The one piece of module-global state: the context of the step being run.

Attention ops and the trim op are opaque to Dynamo and read per-step metadata from
here instead of from their arguments, so the traced graph stays the same for every
step and only the token count is dynamic. The runner sets a context around each
model call; the compiled backend adds its plan for the step (dispatch/decide.py), which
its pieces and the trim op execute.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator

if TYPE_CHECKING:  # pragma: no cover
    from .batch import AttnView, StepBatch


@dataclass
class ForwardContext:
    batch: "StepBatch"
    kv: Any  # the model's own caches, opaque to the backend; its attention ops read them
    # Behaviour of the replay markers when the model runs *uncompiled*: "off" runs the
    # replay layers on the whole batch, "parent" on the replay batch.
    eager_replay: str = "off"
    # Metadata the attention ops read now: the whole batch, or the replay batch while
    # the replay region runs on it.
    active: "AttnView" = None  # type: ignore[assignment]
    # The whole batch as the replay layers read it when they run on every row: the
    # batch's ``region_view``, or in a step run within the batch's graph layout its
    # twin with the graph fields (``use_views``).
    region_view: "AttnView" = None  # type: ignore[assignment]
    # False: the compiled backend runs this step with no graph (no padding, no capture,
    # the replay region directly): the first step, before capture, and memory probes.
    use_graphs: bool = True
    # Set by the compiled backend when its model starts the step: the step's one
    # decision (dispatch.decide.StepPlan), which its pieces and the trim op execute, and
    # the replay-region runtime the trim op dispatches to.
    plan: Any = None
    replay_runtime: Any = None
    # The replay-region runtimes of the graphs that ran this step so far (a model with
    # graph breaks runs several), each with whether it trimmed: a later graph that reads
    # rows together turns their trimming off (pipeline.py).
    regions_run: list = field(default_factory=list)
    # True while a compiled model runs this context's step: the boundary markers are the
    # identity there (the backend runs the region), and point attention at the replay
    # layers' view only where the model runs uncompiled, in this context too afterwards.
    compiled_step: bool = False
    # ``prepare_view(view, graph_size)``: the model's host-side planning for a view that
    # attention is about to read (e.g. FlashInfer's ``plan()``), outside any graph. The
    # runner plans the whole batch before the model; :meth:`activate` calls this for the
    # view the replay region runs on, with the size of the graph that reads it (the
    # replay graph's, or in a FULL step the step's graph's; None without one), before
    # the region runs or replays. Those calls are the replay layers' only ones, so the
    # runner's own may leave out what only they read. A FULL step calls it for both
    # of its views at its size before its graph replays: inside, no host code runs.
    prepare_view: Callable[["AttnView", "int | None"], None] | None = None

    def __post_init__(self) -> None:
        if self.eager_replay not in ("off", "parent"):
            raise ValueError(f"eager_replay must be 'off' or 'parent', got {self.eager_replay!r}")
        if self.active is None:
            self.active = self.batch.view
        if self.region_view is None:
            self.region_view = self.batch.region_view

    @property
    def result(self):
        """What the compiled model did in this context's step (a ``StepResult``), or
        None before it ran (or when the model ran uncompiled)."""
        return self.plan.result if self.plan is not None else None

    def use_views(self, view: "AttnView", region_view: "AttnView") -> None:
        """The whole batch's views for this step: what attention reads before and after
        the replay region, and what the replay layers read when they run on every row."""
        self.active, self.region_view = view, region_view

    def point_at(self, view: "AttnView", graph_size: int | None = None) -> "AttnView":
        """Point attention at ``view`` (planned first, see ``prepare_view``); returns the
        view it pointed at before."""
        if self.prepare_view is not None:
            self.prepare_view(view, graph_size)
        saved, self.active = self.active, view
        return saved

    def activate(self, view: "AttnView", graph_size: int | None = None) -> "_Activated":
        """Point attention at ``view`` for the duration of a ``with`` (the replay region,
        run as a graph of ``graph_size`` rows, or directly for None)."""
        return _Activated(self, view, graph_size)


class _Activated:
    """The context manager of :meth:`ForwardContext.activate`: a plain class, because
    the trim op enters one on every step, where a generator-based one costs several
    times as much host time."""

    __slots__ = ("ctx", "view", "size", "saved")

    def __init__(self, ctx: ForwardContext, view: "AttnView", size: int | None) -> None:
        self.ctx, self.view, self.size = ctx, view, size

    def __enter__(self) -> None:
        self.saved = self.ctx.point_at(self.view, self.size)

    def __exit__(self, *exc) -> None:
        self.ctx.active = self.saved


_current: ForwardContext | None = None


@contextlib.contextmanager
def set_forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _current
    saved, _current = _current, ctx
    try:
        yield ctx
    finally:
        _current = saved


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError(
            "no forward context is set: attention ops and the replay markers read the step from it, so run "
            "each step inside replay_backend.set_forward_context(setup.context(batch)) (a StepSetup's, or "
            "ForwardContext(batch, kv))")
    return _current


def has_forward_context() -> bool:
    return _current is not None
