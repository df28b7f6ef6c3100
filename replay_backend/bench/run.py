"""``replay-backend bench``: prefill-only step latency of every mode.

This backend's modes run in one process on the same model (over several ranks, in
every rank's process on its share of it: bench/ranks.py). A measurement is the TTFT of
``concurrency`` prompts of ``isl`` tokens with ``max_tokens=1``: every chunked-prefill
step (``max_num_batched_tokens`` per step) from the first to the last, synchronised;
the median of ``runs`` measurements after ``warmup`` ones. This backend's modes are
all built and captured first, then timed in turns (run k of every mode before run
k + 1 of any), so a slow phase of the host or the GPU hits every mode alike; then
their floors. The stock ``reduce-overhead`` peer runs after them on its own, in a
process of its own where their floors traced CUDA.
"""
from __future__ import annotations

import functools
import pickle
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from ..backend import ReplayBackend
from ..compiling.piece_cache import PieceCache
from ..reference.accuracy import CHECK, yardstick
from ..reference.compare import max_abs_err
from ..reference.runner import StepRunner
from . import own_process
from .flops import measured_peak, point_flops
from .modes import (MODE_OPTIONS, SharedTrace, backend_config, bench_model, build_shared_mode, mode_failed, plan_modes,
                    prepare_mode, release_memory)
from .report import MODES, render  # noqa: F401  (bench.MODES, bench.render: the CLI's and tests')
from .timing import ModeRun, TimedMode, floor_points, time_points
from .watch import Deadline, host_probe
from .ranks import Ranks, agreement_us

# The check prompt (every mode against the plain model and an fp32 copy) is the
# shortest ISL up to this many tokens: long enough to trim, while 128K-token check
# prompts (eager plain model, fp32 copy, every mode) kept the GPU bench from reaching
# its first measurement within ten minutes.
CHECK_MAX_TOKENS = 4096


def check_tokens(shapes) -> int:
    """The check prompt's length for the bench's (isl, conc) points."""
    return min(min(isl for isl, _ in shapes), CHECK_MAX_TOKENS)


@dataclass(frozen=True)
class PassPlace:
    """Where one pass of the bench runs: its share of ``--max-seconds`` and what ran
    before it in its process."""

    seconds: float  # of --max-seconds left at ``as_of``
    as_of: float  # time.time() then: a pass started in a process of its own counts its start-up
    after_profiler: bool = False  # an earlier pass of this process traced CUDA (its modes are marked)
    peer_process: bool | None = None  # the stock peer in a process of its own; None: where floors traced CUDA

    @classmethod
    def now(cls, seconds: float, **kw) -> "PassPlace":
        return cls(seconds, time.time(), **kw)

    def deadline_at(self) -> float:
        """The deadline on this process's ``time.perf_counter`` clock."""
        return time.perf_counter() + self.seconds - max(0.0, time.time() - self.as_of)


def run_bench(args, checkpoint=None, fp32_results: dict | None = None, ranks: Ranks | None = None,
              place: PassPlace | None = None) -> dict:
    """Every mode at every point; returns the report. ``checkpoint(report)``, when given,
    gets the report so far once this backend's modes are ready, after each timed point
    and after the stock peer's compile (in the peer's own process, where the checkpoint
    pickles), so that a run stopped by an outer time limit still leaves what it
    measured. ``fp32_results``: the accuracy gate's fp32 results, shared by the passes
    of one process (reference/accuracy.yardstick). ``ranks``: this
    rank's place over several ranks (bench/ranks.py); each rank runs every point on
    its own prompts, and the report holds every rank's floors. ``place``: this pass's
    budget and what ran before it (by default all of ``--max-seconds`` from now, in a
    fresh process); the report's ``profiled`` says whether its floors traced CUDA.
    Where they did, the stock peer runs in a process of its own (bench/own_process.py),
    untouched by them."""
    shapes = [(i, c) for i in args.isl for c in args.conc if not (i * c > args.max_tokens_per_point)]
    if not shapes:
        raise ValueError(f"every ISL x concurrency point is above --max-tokens-per-point "
                         f"{args.max_tokens_per_point} prompt tokens: nothing to measure")
    # --max-seconds counts from here, the check prompt included: it is meant to fit the
    # bench inside an outer time limit.
    place = place if place is not None else PassPlace.now(args.max_seconds)
    deadline = Deadline(place.deadline_at(), ranks.world_group if ranks else None)
    if ranks is not None:
        args = ranks.own_paths(args)
    model, device = bench_model(args, ranks)
    dtype = next(model.parameters()).dtype
    kw = dict(max_num_seqs=max(args.conc), max_model_len=max(max(args.isl), model.cfg.window) + 2,
              max_num_batched_tokens=args.max_num_batched_tokens)
    plan = plan_modes(args)
    check_len = check_tokens(shapes)
    t0 = time.perf_counter()
    reference = StepRunner(model, **kw).prefill({CHECK: check_len})[CHECK]
    gate = yardstick(model, reference, check_len, args.max_num_batched_tokens, fp32_results)
    print(f"check prompt: {check_len} tokens, plain model and fp32 copies in {time.perf_counter() - t0:.1f} s; "
          f"rel L2 to the fp32 copy: plain {gate.plain_err:.3g}, rounding noise {gate.noise_err:.3g}, "
          f"a mode drifts above {gate.limit:.3g}", flush=True)
    # Model FLOPs per point and the machine's measured dense rate: each mode's MFU
    peak = measured_peak(device, dtype)
    gflop = {f"{i}/{c}": point_flops(model.cfg, i, c, args.max_num_batched_tokens) / 1e9 for i, c in shapes}
    print(f"measured dense {str(dtype).replace('torch.', '')} matmul rate: {peak / 1e12:.1f} TFLOP/s", flush=True)
    cache = PieceCache()  # identical pieces compile once
    groups = ranks.backend_groups if ranks is not None else {}
    shared = SharedTrace({f"{m}/{s}": ReplayBackend(backend_config(m, s, args), piece_cache=cache, **groups)
                          for m, s in plan if m in MODE_OPTIONS})
    shared_fwd = torch.compile(model, backend=shared, fullgraph=True)
    results: list[ModeRun] = []
    floors: dict = {}
    trim_host_us: list[float] = []
    trace_s = None
    probes: dict = {}
    over_ranks: dict = {}
    profiled = False

    def report() -> dict:
        out = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
               "torch": torch.__version__, "preset": args.preset, "dtype": str(dtype),
               "model_options": list(args.model_option or []),
               "runs": args.runs, "warmup": args.warmup, "max_num_batched_tokens": args.max_num_batched_tokens,
               "trace_s": trace_s, "results": [asdict(r) for r in results], "floor_ms": floors,
               "peak_tflops": peak / 1e12, "point_gflop": gflop,
               "host_probe": probes, "check_tokens": check_len, "plain_err_vs_fp32": gate.plain_err,
               "noise_err_vs_fp32": gate.noise_err, "drift_limit": gate.limit,
               "trim_host_us_median": statistics.median(trim_host_us) if trim_host_us else None,
               "profiled": profiled}
        if ranks is not None:
            out.update(topology=ranks.topo.as_dict(), floor_ms_by_rank=over_ranks.get("floors"),
                       agree_us_median=over_ranks.get("agree_us"))
        return out

    def save() -> None:
        if checkpoint is not None:
            checkpoint(report())

    def prepare(mode: str, setting: str) -> TimedMode | None:
        nonlocal trace_s
        run = ModeRun(mode, setting, after_profiler=place.after_profiler)
        results.append(run)
        try:
            runner, traced = prepare_mode(run, model, kw, shared, shared_fwd, device)
            trace_s = trace_s if traced is None else traced
            # Same answer as the plain model on one prompt: a fast wrong mode is no result.
            got = runner.prefill({CHECK: check_len})[CHECK]
            runner.free(CHECK)
            run.max_abs_err_vs_eager = max_abs_err(got, reference)
            run.rel_err_vs_fp32 = gate.error(got)
            run.drifted = gate.drifted(run.rel_err_vs_fp32)
        except Exception as e:  # report the failure of one mode, keep the others
            if ranks is not None:
                # Over several ranks the others may be inside this mode's collectives,
                # which the failed rank left: nothing to agree on after it, so the run
                # ends here, the rank named (ranks.launch).
                raise
            run.error = mode_failed(f"{mode}/{setting}", e)
            print(f"{mode}/{setting}: failed: {run.error}", flush=True)
            return None
        print(f"{mode}/{setting}: ready, check prompt max|d| {run.max_abs_err_vs_eager:.3g} vs the plain model, "
              f"rel L2 {run.rel_err_vs_fp32:.3g} vs the fp32 copy" + (" (DRIFT)" if run.drifted else ""), flush=True)
        return TimedMode(run, runner, shared if mode in MODE_OPTIONS else None)

    # This backend's modes (and eager) built and captured first, then timed in turns,
    # then their floors and profiles: a profiler session slows the process's later
    # launches (CudaTracing), so nothing of theirs is timed after one.
    ours = [m for m in (prepare(*ms) for ms in plan if ms[0] != "reduce-overhead") if m is not None]
    probes["start"] = host_probe()
    print(f"host speed at start: {probes['start']}", flush=True)
    save()
    fail_fast = ranks is not None  # as in prepare: a failure ends the run
    timed = time_points(ours, shapes, deadline, args, trim_host_us, done=save, fail_fast=fail_fast)
    probes["end"] = host_probe()
    if ranks is not None and ranks.backend_groups["dp_group"] is not None:  # else no step agrees: TP alone
        over_ranks["agree_us"] = agreement_us(ranks)
        print(f"per-step agreement of the data-parallel ranks: median {over_ranks['agree_us']:.1f} us", flush=True)
    profiled = floor_points(timed, deadline, args, device, floors, done=save, fail_fast=fail_fast)
    if ranks is not None:
        over_ranks["floors"] = ranks.gather(floors)
    ours.clear()
    timed.modes.clear()
    shared.backends.clear()  # their graphs and buffers go before the peer compiles
    release_memory()
    for ms in plan:
        if ms[0] == "reduce-overhead":  # it resets Dynamo, so it comes last and alone
            if deadline.passed():  # its compile alone takes minutes
                results.append(ModeRun(*ms, error="time budget spent (--max-seconds) before its compile"))
                continue
            if (profiled or place.after_profiler) if place.peer_process is None else place.peer_process:
                torch._dynamo.reset()  # this backend's pieces and graphs go before the peer's process builds
                model = shared_fwd = None  # that process builds its own
                release_memory()
                peer_cp = (_picklable(functools.partial(_with_peer, checkpoint, report()))
                           if checkpoint is not None else None)
                entry = own_process.one_mode(run_bench, args, ms[0], peer_cp, None, None,
                                             PassPlace.now(deadline.left(), peer_process=False))
                results.append(ModeRun(**{"mode": ms[0], "setting": ms[1], **entry}))
                save()
                continue
            peer = prepare(*ms)
            save()
            if peer is not None:
                # Its own profiles follow its timing; this backend's floors came before.
                peer.run.after_profiler = place.after_profiler or profiled
                timed = time_points([peer], shapes, deadline, args, trim_host_us, done=save)
                profiled |= floor_points(timed, deadline, args, device, floors, done=save)
                timed.modes.clear()
            peer = None
            release_memory()
    return report()


def _with_peer(checkpoint, base: dict, peer: dict) -> None:
    """``checkpoint`` of the report ``base`` with the entries of the peer's report so far."""
    checkpoint({**base, "results": [*base["results"], *peer["results"]]})


def _picklable(fn):
    """``fn`` where it can go to another process, else None (a checkpoint made here of a
    closure stays here: that process's points then reach the report when it returns)."""
    try:
        pickle.dumps(fn)
    except (pickle.PicklingError, AttributeError, TypeError):
        return None
    return fn


def compile_only(args) -> dict:
    """Trace and build the default ``replay`` mode once: run it twice in fresh processes
    for cold and warm (Inductor's on-disk caches filled) compile times."""
    model, _ = bench_model(args)
    shared = SharedTrace({"replay": ReplayBackend(backend_config("replay", "default", args))})
    kw = dict(max_num_seqs=max(args.conc), max_model_len=2 * model.cfg.window,
              max_num_batched_tokens=args.max_num_batched_tokens)
    _, total = build_shared_mode("replay", model, kw, shared, torch.compile(model, backend=shared, fullgraph=True))
    build = shared.build_s["replay"]
    return {"preset": args.preset, "compile_s": total, "build_s": build, "trace_s": total - build}
