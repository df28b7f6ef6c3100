"""The benchmark's timing: TTFT of one prompt set, every mode of a point in turns.

Modes are timed in turns (run k of every mode before run k + 1 of any), so that a
slow phase of the host or the GPU falls on every mode alike instead of on whichever
mode was being timed then: the host-bound modes moved by up to 1.6x between
positions in a sequential order (docs/benchmarks.md).
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .profile import NoKernelsRecorded, kernel_floor_ms, profile_to
from .cuda_tracing import CudaTracing
from ..counters import counters
from ..reference.runner import StepRunner
from .watch import Deadline, GcWatch, sync

if TYPE_CHECKING:  # pragma: no cover
    from .modes import SharedTrace

# Counters a served step should never move: each one is a slow path taken inside a
# timed run (``ModeRun.events``, the report's EVENTS section).
SERVED_EVENTS = ("fallbacks", "captures", "recompiles", "graphs_seen", "trim_index_copies")


@dataclass
class ModeRun:
    """One mode at one capture setting: its report entry, filled while it is built,
    checked and timed."""

    mode: str
    setting: str
    compile_s: float = 0.0  # this mode's backend build (the shared trace is reported once)
    capture: dict = field(default_factory=dict)
    memory_estimate_gib: float | None = None
    split_warmup_s: float | None = None  # capture's step that builds the attention's split variants
    ms: dict = field(default_factory=dict)  # "isl/conc" -> median ms
    # "isl/conc" -> median host time of the trim op per trimming step of the timed runs,
    # without the region it runs (wall time: it holds any wait inside its CUDA calls)
    trim_host_us: dict = field(default_factory=dict)
    # "isl/conc" -> that time by the step's place among a run's trimming steps (points
    # with more than one; trims_by_step)
    trim_host_us_by_step: dict = field(default_factory=dict)
    first_ms: dict = field(default_factory=dict)  # "isl/conc" -> the point's first (warm-up) run
    # "isl/conc" -> why the point has no floor though its floor session ran (profile.NoKernelsRecorded)
    floor_errors: dict = field(default_factory=dict)
    # "isl/conc" -> counters of SERVED_EVENTS that moved in this mode's timed
    # runs (a fallback, a capture, a copy of the trim rows): none is expected
    events: dict = field(default_factory=dict)
    max_abs_err_vs_eager: float | None = None  # last-row logits of one prompt vs the plain model
    rel_err_vs_fp32: float | None = None  # their relative L2 distance to the fp32 copy's
    drifted: bool = False  # beyond the rounding-noise band of the fp32 copy (reference/accuracy.py)
    # timed after a profiler session of this process, which slowed its launches on the
    # host (CudaTracing): a later --attention pass over several ranks, or a stock peer
    # kept in the process of this backend's floors (run_bench's peer_process)
    after_profiler: bool = False
    error: str | None = None


def ttft(runner: StepRunner, isl: int, conc: int, tag: str) -> float:
    prompts = {f"{tag}-{i}": isl for i in range(conc)}
    sync()
    t0 = time.perf_counter()
    runner.prefill(prompts)
    sync()
    ms = (time.perf_counter() - t0) * 1e3
    for rid in prompts:
        runner.free(rid)
    return ms


class ModeFailed(Exception):
    def __init__(self, mode: "TimedMode", cause: Exception) -> None:
        super().__init__(str(cause))
        self.mode, self.cause = mode, cause


@dataclass
class TimedMode:
    """A prepared mode: its report entry and runner. This backend's modes share one
    compiled forward (``shared``), which runs the model of the mode selected last."""

    run: ModeRun
    runner: StepRunner
    shared: "SharedTrace | None" = None

    def ttft(self, isl: int, conc: int, tag: str) -> float:
        if self.shared is not None:
            self.shared.current = f"{self.run.mode}/{self.run.setting}"
        try:
            return ttft(self.runner, isl, conc, tag)
        except Exception as e:  # noqa: BLE001 - one failing mode must not end the others
            raise ModeFailed(self, e) from e


def measure_point(modes: list[TimedMode], isl: int, conc: int, args, trim_host_us: list) -> None:
    """Median TTFT of every mode at one point, timed in turns, and ``replay``'s trim op
    host time."""
    point = f"{isl}/{conc}"
    last_warm = {}
    for m in modes:
        for w in range(args.warmup):
            last_warm[id(m)] = m.ttft(isl, conc, f"w{w}")
            if w == 0:  # the first run of the point: what a one-time cost inside it shows in
                m.run.first_ms[point] = last_warm[id(m)]
    if last_warm:  # a run cut short inside a long point still says how long a run takes
        print(f"{point} warm-up: " + ", ".join(f"{m.run.mode}/{m.run.setting} {last_warm[id(m)]:.1f} ms"
                                               for m in modes), flush=True)
    reps = {id(m): m.runner.backend.model.replay for m in modes
            if m.run.mode == "replay" and m.runner.backend.model.replay is not None}
    for rep in reps.values():
        rep.host_us.clear()  # the trimming steps of the timed runs only
    times: dict[int, list[float]] = {id(m): [] for m in modes}
    trims: dict[int, list[list[float]]] = {key: [] for key in reps}  # each timed run's, in order
    with GcWatch() as gcw:
        for k in range(args.runs):
            for m in modes:
                before = counters.state()  # outside ttft's timed span
                times[id(m)].append(m.ttft(isl, conc, f"m{k}"))
                _add_events(m.run.events.setdefault(point, {}), counters.moved_since(before))
                rep = reps.get(id(m))
                if rep is not None:
                    trims[id(m)].append(list(rep.host_us))
                    rep.host_us.clear()
    for m in modes:
        m.run.ms[point] = statistics.median(times[id(m)])
        if not m.run.events[point]:
            del m.run.events[point]
        every = [us for run in trims.get(id(m), ()) for us in run]
        if every:
            trim_host_us.extend(every)
            m.run.trim_host_us[point] = statistics.median(every)
            steps = trims_by_step(trims[id(m)])
            if len(steps) > 1:
                m.run.trim_host_us_by_step[point] = steps
    # progress, and what a run cut short by a timeout still leaves in its log
    print(f"{point}: " + ", ".join(f"{m.run.mode}/{m.run.setting} {m.run.ms[point]:.1f} ms" for m in modes)
          + f"; gc while timing: {gcw.count} collections ({gcw.gen2} gen-2), {gcw.seconds * 1e3:.1f} ms",
          flush=True)


def profile_mode(m: TimedMode, isl: int, conc: int, args, device: str, floors: dict,
                 tracing: CudaTracing) -> bool:
    """One mode's profile at one point, where asked for, and ``replay``'s kernel floor,
    in sessions of ``tracing``; whether it did either."""
    point = f"{isl}/{conc}"
    profiled = bool(args.profile_out) and point in args.profile_points
    if profiled:
        profile_to(args.profile_out, f"{m.run.mode}/{m.run.setting} {point}",
                   lambda: m.ttft(isl, conc, "prof"), getattr(args, "trace_dir", None), tracing)
    if m.run.mode == "replay" and device == "cuda":
        try:
            floors.setdefault(m.run.setting, {})[point] = kernel_floor_ms(lambda: m.ttft(isl, conc, "floor"),
                                                                          tracing)
        except NoKernelsRecorded as e:
            m.run.floor_errors[point] = str(e)
            print(f"{m.run.mode}/{m.run.setting} {point}: no floor: {e}", flush=True)
        profiled = True
    return profiled


def trims_by_step(runs: list[list[float]]) -> list[float]:
    """The trim op's median time of each run's first, second, ... trimming step. A time
    that grows with the step's place in the run is the host waiting for the device (the
    host runs further ahead with each step until the launch queue is full), not the op's
    own work."""
    most = max((len(r) for r in runs), default=0)
    return [statistics.median(r[k] for r in runs if len(r) > k) for k in range(most)]


def _add_events(into: dict, moved: dict) -> None:
    for name in SERVED_EVENTS:
        delta = moved.get(name)
        if isinstance(delta, dict):
            sub = into.setdefault(name, {})
            for k, v in delta.items():
                sub[str(k)] = sub.get(str(k), 0) + v
        elif delta:
            into[name] = into.get(name, 0) + delta


@dataclass
class Timed:
    """What a timing phase leaves for its floors: the modes still in the rotation (a
    mode that failed left it) and the points they were timed at."""

    modes: list[TimedMode]
    points: list[tuple[int, int]]


def time_points(modes: list[TimedMode], shapes, deadline: "Deadline | float", args, trim_host_us: list,
                done: Callable[[], None] | None = None, fail_fast: bool = False) -> Timed:
    """Every point for every mode, timed, and no profiler session: their floors and
    profiles come after the process's last timed step (:func:`floor_points`;
    CudaTracing says why). A mode that fails leaves the rotation with its error;
    nothing new starts after ``deadline``. ``done()`` runs after each point.
    ``fail_fast``: a mode that fails ends the run (its error raised) instead of leaving
    the rotation."""
    if not isinstance(deadline, Deadline):
        deadline = Deadline(deadline)
    timed = []
    for isl, conc in shapes:
        if deadline.passed():
            for m in modes:
                m.run.error = m.run.error or f"time budget spent (--max-seconds) before {isl}/{conc}"
            break
        while modes:
            try:
                measure_point(modes, isl, conc, args, trim_host_us)
                timed.append((isl, conc))
                break
            except ModeFailed as f:  # the point again without it
                modes = _drop(modes, f, fail_fast)
        if done is not None:
            done()
    return Timed(modes, timed)


def floor_points(timed: Timed, deadline: "Deadline | float", args, device: str, floors: dict,
                 done: Callable[[], None] | None = None, fail_fast: bool = False) -> bool:
    """The floors and profiles of the points of ``timed``, one session after another
    (CudaTracing keeps the tracing attached between them); nothing new starts after
    ``deadline``. ``done()`` runs after each point that profiled anything. Returns
    whether any session traced CUDA, which slows what the process times after it."""
    if not isinstance(deadline, Deadline):
        deadline = Deadline(deadline)
    tracing = CudaTracing()
    modes, any_session = timed.modes, False
    for isl, conc in timed.points:
        if deadline.passed():
            print(f"time budget spent (--max-seconds): no floors or profiles from {isl}/{conc} on", flush=True)
            break
        profiled = False
        for m in list(modes):
            try:
                profiled |= profile_mode(m, isl, conc, args, device, floors, tracing)
            except ModeFailed as f:  # inside a profiler session: profile_mode runs steps only there
                profiled = True
                modes = _drop(modes, f, fail_fast)
        any_session |= profiled and device == "cuda"
        if done is not None and profiled:
            done()
    return any_session


def _drop(modes: list[TimedMode], failed: ModeFailed, fail_fast: bool = False) -> list[TimedMode]:
    if fail_fast:
        raise failed.cause
    failed.mode.run.error = f"{type(failed.cause).__name__}: {failed.cause}"[:500]
    return [m for m in modes if m is not failed.mode]
