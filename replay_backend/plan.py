"""The split plan: what the backend built, as a typed record (``inspect``).

``plan_of(obj)`` gets it from anything that holds a compiled model (a ReplayBackend, a
StepRunner built with ``backend=``, a CompiledReplayModel, or a ``torch.compile``-d
function or module) without re-tracing; its ``runners`` then say what was captured
and how often each runner dispatched to each size.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .passes.split import PieceInfo


@dataclass
class RunnerStats:
    """One graph runner (``"main"``, ``"replay"``, or ``"full"``: whole steps, one graph
    each) when the plan was taken."""

    pieces: int  # graph pieces wrapped in per-size runners
    captured_sizes: list[int]  # sizes with a captured graph in at least one piece
    graphs: int  # captured graphs over all pieces and sizes
    # Steps per padded size since capture ("eager": ran without graphs). For "replay" a
    # step counts once per trim-op run, keyed like counters.replay_dispatch.
    dispatch: dict[Any, int] = field(default_factory=dict)
    capture_seconds: float | None = None  # None: not captured through capture()
    capture_gib: float | None = None

    def as_dict(self) -> dict:
        return {"pieces": self.pieces, "captured_sizes": self.captured_sizes, "graphs": self.graphs,
                # JSON keys are strings; sizes first in order, then "eager"
                "dispatch": {str(k): v for k, v in sorted(self.dispatch.items(), key=_size_key)},
                "capture_seconds": self.capture_seconds, "capture_gib": self.capture_gib}

    @classmethod
    def from_dict(cls, d: dict) -> "RunnerStats":
        disp = {(int(k) if str(k).isdigit() else k): v for k, v in d.get("dispatch", {}).items()}
        return cls(d["pieces"], list(d["captured_sizes"]), d["graphs"], disp,
                   d.get("capture_seconds"), d.get("capture_gib"))


def _size_key(item) -> tuple:
    k = item[0]
    return (0, k, "") if isinstance(k, int) else (1, 0, str(k))


@dataclass
class SplitPlan:
    window: int | None
    trim_threshold: int
    replay_layers: list[int] | None  # [first, last]
    capture_sizes: list[int]
    replay_capture_sizes: list[int]
    main_pieces: list[PieceInfo] = field(default_factory=list)
    replay_pieces: list[PieceInfo] = field(default_factory=list)
    replay_off_reason: str | None = None  # why the replay region is not in use
    config: dict = field(default_factory=dict)
    runners: dict[str, RunnerStats] = field(default_factory=dict)  # filled by plan_of()

    def pieces_by_kind(self, which: str = "main") -> dict[str, int]:
        out: dict[str, int] = {}
        for p in (self.main_pieces if which == "main" else self.replay_pieces):
            out[p.kind] = out.get(p.kind, 0) + 1
        return out

    def as_dict(self) -> dict:
        return {
            "window": self.window,
            "trim_threshold": self.trim_threshold,
            "replay_layers": self.replay_layers,
            "capture_sizes": self.capture_sizes,
            "replay_capture_sizes": self.replay_capture_sizes,
            "main_pieces": [p.as_dict() for p in self.main_pieces],
            "replay_pieces": [p.as_dict() for p in self.replay_pieces],
            "replay_off_reason": self.replay_off_reason,
            "config": self.config,
            "runners": {k: v.as_dict() for k, v in self.runners.items()},
        }

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2)

    @classmethod
    def from_dict(cls, d: dict) -> "SplitPlan":
        """The inverse of ``as_dict`` (``replay-backend inspect --json`` output)."""
        return cls(d["window"], d["trim_threshold"], d["replay_layers"], list(d["capture_sizes"]),
                   list(d["replay_capture_sizes"]), [PieceInfo(**p) for p in d["main_pieces"]],
                   [PieceInfo(**p) for p in d["replay_pieces"]], d.get("replay_off_reason"),
                   dict(d.get("config", {})),
                   {k: RunnerStats.from_dict(v) for k, v in d.get("runners", {}).items()})

    def render(self) -> str:
        def layers(p):
            if not p.layers:
                return ""
            return f" layers {p.layers[0]}" + (f"..{p.layers[-1]}" if len(p.layers) > 1 else "")

        lines = [
            f"window W={self.window}  trim threshold={self.trim_threshold}  replay layers="
            f"{self.replay_layers if self.replay_layers else 'none'}",
            f"main capture sizes ({len(self.capture_sizes)}): {self.capture_sizes}",
            f"replay capture sizes ({len(self.replay_capture_sizes)}): {self.replay_capture_sizes}",
        ]
        if self.replay_off_reason:
            lines.append(f"decoder replay OFF: {self.replay_off_reason}")
        for title, pieces in (("main graph", self.main_pieces), ("replay region", self.replay_pieces)):
            if not pieces and title == "replay region":
                continue
            kinds = ", ".join(f"{v} {k}" for k, v in self.pieces_by_kind(
                "main" if title == "main graph" else "replay").items())
            lines.append(f"{title}: {len(pieces)} pieces ({kinds})")
            for p in pieces:
                what = p.op if p.op else f"{p.num_ops} ops"
                lines.append(f"  {p.name:<12s} {p.kind:<9s}{layers(p):<16s} {what}")
        for name, r in self.runners.items():
            took = f", {r.capture_seconds:.2f} s" if r.capture_seconds is not None else ""
            disp = ", ".join(f"{k}: {v}" for k, v in sorted(r.dispatch.items(), key=_size_key)) or "none"
            what = "whole steps" if name == "full" else f"{r.pieces} graph pieces"
            lines.append(f"runner {name}: {what}, captured sizes {r.captured_sizes} "
                         f"({r.graphs} graphs{took}); steps dispatched by size: {disp}")
        return "\n".join(lines)


def runner_stats(compiled) -> dict[str, RunnerStats]:
    """Per-runner capture and dispatch state of a CompiledReplayModel."""
    out = {}
    for name in ("main", "replay"):
        runners = compiled.runners(name)
        if name == "replay" and compiled.replay is None:
            continue
        summary = compiled.capture_summary.get(name, {})
        out[name] = RunnerStats(len(runners), compiled.captured_sizes(name),
                                sum(len(r.graphs) for r in runners), dict(compiled.dispatch[name]),
                                summary.get("seconds"), summary.get("gib"))
    if compiled.full_policy is not None or compiled.full.graphs:
        summary = compiled.capture_summary.get("full", {})
        graphs = sorted(compiled.full.graphs)
        out["full"] = RunnerStats(1, graphs, len(graphs), dict(compiled.dispatch["full"]), summary.get("seconds"),
                                  summary.get("gib"))
    return out


def plan_of(obj) -> SplitPlan:
    """The split plan of the last graph compiled for ``obj``, with its runners' state.

    ``obj``: a SplitPlan, or anything :func:`compiled_model_of` takes. Never re-traces."""
    if isinstance(obj, SplitPlan):
        return obj
    return compiled_model_of(obj).plan_snapshot()


def compiled_model_of(obj):
    """The last graph compiled for ``obj`` (a ``CompiledReplayModel``): ``obj`` is one,
    a ReplayBackend, a StepRunner built with ``backend=``, what ``replay_backend.compile``
    returned, or what ``torch.compile(..., backend="dsv41_replay")`` returned (found
    through Dynamo's cache; run it once first)."""
    from .backend import ReplayBackend
    from .compat import dynamo as compat_dynamo
    from .dispatch.compiled import CompiledReplayModel

    if isinstance(obj, CompiledReplayModel):
        return obj
    if isinstance(obj, ReplayBackend):
        return obj.model
    backend = getattr(obj, "backend", None)
    if isinstance(backend, ReplayBackend):  # StepRunner(backend=...), ReplayCompiled
        return backend.model
    for fn in compat_dynamo.compiled_callables(obj):
        if isinstance(fn, CompiledReplayModel):
            return fn
    raise TypeError(
        f"no dsv41_replay compiled model found in {type(obj).__name__}: pass a ReplayBackend, a "
        "StepRunner built with backend=, a CompiledReplayModel, or a torch.compile(..., "
        "backend='dsv41_replay') result that has run at least once")
