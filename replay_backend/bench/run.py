"""``replay-backend bench``: prefill-only step latency of every mode.

All modes run in one process on the same model (over several ranks, in every rank's
process on its share of it: bench/ranks.py). A measurement is the TTFT of
``concurrency`` prompts of ``isl`` tokens with ``max_tokens=1``: every chunked-prefill
step (``max_num_batched_tokens`` per step) from the first to the last, synchronised;
the median of ``runs`` measurements after ``warmup`` ones. This backend's modes are
all built and captured first, then timed in turns (run k of every mode before run
k + 1 of any), so a slow phase of the host or the GPU hits every mode alike; the
stock ``reduce-overhead`` peer runs after them on its own.
"""
from __future__ import annotations

import copy
import gc
import json
import statistics
import time
from dataclasses import asdict

import torch

from ..compat import inductor as compat_inductor
from ..backend import ReplayBackend
from ..reference.accuracy import CHECK, yardstick
from .report import MODES, UNGRAPHED, render  # noqa: F401  (bench.render: the CLI's and tests')
from ..tracing.dynamic import call_dynamic
from .flops import measured_peak, point_flops
from .timing import Deadline, ModeRun, TimedMode, host_probe, sync, time_points
from ..reference.cli_options import model_config, parse_options
from ..reference.compare import max_abs_err
from ..config import ReplayConfig
from ..reference import build_model
from ..compiling.piece_cache import PieceCache
from ..reference.parallel import shard
from ..reference.runner import StepRunner
from .ranks import Ranks, agreement_us

MODE_OPTIONS = {
    "off": {"cudagraph_mode": "none", "decoder_replay": False},
    "parent": {"cudagraph_mode": "none", "cudagraph_decoder_replay": False},
    "piecewise": {"cudagraph_decoder_replay": False},
    "replay": {},
}
WIDE_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
# The check prompt (every mode against the plain model and an fp32 copy) is the
# shortest ISL up to this many tokens: long enough to trim, while 128K-token check
# prompts (eager plain model, fp32 copy, every mode) kept the GPU bench from reaching
# its first measurement within ten minutes.
CHECK_MAX_TOKENS = 4096


class _Dynamic:
    """A stock torch.compile'd model called like the runner calls ours (one trace)."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def __call__(self, ids, pos):
        return call_dynamic(self.fn, (ids, pos), False, ids, pos)


class SharedTrace:
    """One Dynamo trace for every backend mode: the trace (the slow part of compiling a
    40-layer model) hands its graph to each mode's backend, and calls run the model of
    the mode selected now. Only the bench needs this; a server runs one mode."""

    def __init__(self, backends: dict[str, ReplayBackend]) -> None:
        self.backends = backends
        self.current: str | None = None
        self.build_s: dict[str, float] = {}

    def __call__(self, gm, example_inputs):
        for key, be in self.backends.items():
            t0 = time.perf_counter()
            be(copy.deepcopy(gm), example_inputs)
            self.build_s[key] = time.perf_counter() - t0
        return self.step

    def step(self, *args):
        return self.backends[self.current].model(*args)


def _model_config(args):
    return model_config(args.preset, getattr(args, "model_option", None))


# What each mode and the wide setting decide; --option may not set these.
_MODE_KEYS = {k for opts in MODE_OPTIONS.values() for k in opts} | {
    "max_num_batched_tokens", "max_cudagraph_capture_size", "cudagraph_capture_sizes"}


def _backend_config(mode: str, setting: str, args) -> ReplayConfig:
    opts = parse_options(getattr(args, "option", None))
    clash = sorted(set(opts) & _MODE_KEYS)
    if clash:
        raise ValueError(f"--option {clash[0]}: set by the bench's modes and capture settings, not an option")
    opts.update(MODE_OPTIONS[mode], max_num_batched_tokens=args.max_num_batched_tokens)
    if setting == "wide" and opts.get("cudagraph_mode") != "none":
        opts.update(max_cudagraph_capture_size=args.max_num_batched_tokens,
                    cudagraph_capture_sizes=[s for s in WIDE_SIZES if s <= args.max_num_batched_tokens])
    return ReplayConfig.from_options(opts)


def _plan(args) -> list[tuple[str, str]]:
    """(mode, setting) in the order given, the stock peer last. Modes without graphs of
    this backend run once, at the default setting, whichever settings were asked for."""
    order = []
    for mode in args.modes:
        for setting in ["default"] if mode in UNGRAPHED else args.settings:
            order.append((mode, setting))
    # The stock peer last: it resets Dynamo, which drops the shared trace.
    return sorted(order, key=lambda ms: ms[0] == "reduce-overhead")


def _release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _build(key: str, model, kw: dict, shared: SharedTrace, shared_fwd) -> tuple[StepRunner, float]:
    """A runner for this backend's mode ``key``, its model built: the shared forward's
    first call traces once and builds every mode. Returns it and the seconds of its
    first step (the trace and builds, when it was the first)."""
    shared.current = key
    runner = StepRunner(model, forward=shared_fwd, backend=shared.backends[key], **kw)
    t0 = time.perf_counter()
    runner.run(runner.dummy_batch(model.cfg.window), use_graphs=False)
    sync()
    return runner, time.perf_counter() - t0


def _prepare(run: ModeRun, model, kw: dict, shared: SharedTrace, shared_fwd, device: str):
    """A runner for ``run``'s mode, compiled and captured. Returns it and, for the first
    of this backend's modes, the seconds of the shared Dynamo trace (else None)."""
    key = f"{run.mode}/{run.setting}"
    if run.mode == "eager":
        return StepRunner(model, **kw), None
    if run.mode == "reduce-overhead":
        torch._dynamo.reset()  # our modes are done; the peer traces on its own
        peer = torch.compile(model, options=compat_inductor.reduce_overhead_options())
        runner = StepRunner(model, forward=_Dynamic(peer), **kw)
        t0 = time.perf_counter()
        runner.run(runner.dummy_batch(model.cfg.window))
        sync()
        run.compile_s = time.perf_counter() - t0
        return runner, None
    first = not shared.build_s
    runner, secs = _build(key, model, kw, shared, shared_fwd)
    traced = secs - sum(shared.build_s.values()) if first else None
    run.compile_s = shared.build_s[key]
    be = runner.backend
    if not be.config.graphs_enabled:
        runner.start_serving()  # nothing to capture: served steps as in the graphed modes
        return runner, traced
    if device == "cuda":
        run.memory_estimate_gib = runner.estimate_graph_memory().total_gib
    run.capture = runner.capture()
    run.split_warmup_s = runner.split_warmup_s
    for level, c in run.capture.items():
        print(f"{key}: captured {level} graphs: {c['graphs']} graphs over {c['sizes']} sizes, "
              f"{c['seconds']:.1f} s, {c['gib']:.2f} GiB", flush=True)
    return runner, traced


def check_tokens(shapes) -> int:
    """The check prompt's length for the bench's (isl, conc) points."""
    return min(min(isl for isl, _ in shapes), CHECK_MAX_TOKENS)


def bench_model(args, ranks=None):
    """The benchmark model: bf16 on CUDA, float32 on the CPU, this rank's share of it
    over several ranks; returns it and its device."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_model(_model_config(args), device, torch.bfloat16 if device == "cuda" else torch.float32)
    if ranks is not None:  # every rank builds the same model (same seed), then keeps its share
        shard(model, ranks.parallel)
    return model, device


def run_bench(args, checkpoint=None, fp32_results: dict | None = None, ranks: Ranks | None = None) -> dict:
    """Every mode at every point; returns the report. ``checkpoint(report)``, when given,
    gets the report so far once this backend's modes are ready, after each timed point
    and after the stock peer's compile, so that a run stopped by an outer time limit
    still leaves what it measured. ``fp32_results``: the accuracy gate's fp32 results,
    shared by the passes of one command (reference/accuracy.yardstick). ``ranks``: this
    rank's place over several ranks (bench/ranks.py); each rank runs every point on
    its own prompts, and the report holds every rank's floors."""
    shapes = [(i, c) for i in args.isl for c in args.conc if not (i * c > args.max_tokens_per_point)]
    if not shapes:
        raise ValueError(f"every ISL x concurrency point is above --max-tokens-per-point "
                         f"{args.max_tokens_per_point} prompt tokens: nothing to measure")
    # --max-seconds counts from here, the check prompt included: it is meant to fit the
    # bench inside an outer time limit.
    deadline = Deadline(time.perf_counter() + args.max_seconds, ranks.world_group if ranks else None)
    if ranks is not None:
        args = ranks.own_paths(args)
    model, device = bench_model(args, ranks)
    dtype = next(model.parameters()).dtype
    kw = dict(max_num_seqs=max(args.conc), max_model_len=max(max(args.isl), model.cfg.window) + 2,
              max_num_batched_tokens=args.max_num_batched_tokens)
    plan = _plan(args)
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
    shared = SharedTrace({f"{m}/{s}": ReplayBackend(_backend_config(m, s, args), piece_cache=cache, **groups)
                          for m, s in plan if m in MODE_OPTIONS})
    shared_fwd = torch.compile(model, backend=shared, fullgraph=True)
    results: list[ModeRun] = []
    floors: dict = {}
    trim_host_us: list[float] = []
    trace_s = None
    probes: dict = {}
    over_ranks: dict = {}

    def report() -> dict:
        out = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
               "torch": torch.__version__, "preset": args.preset, "dtype": str(dtype),
               "model_options": list(args.model_option or []),
               "runs": args.runs, "warmup": args.warmup, "max_num_batched_tokens": args.max_num_batched_tokens,
               "trace_s": trace_s, "results": [asdict(r) for r in results], "floor_ms": floors,
               "peak_tflops": peak / 1e12, "point_gflop": gflop,
               "host_probe": probes, "check_tokens": check_len, "plain_err_vs_fp32": gate.plain_err,
               "noise_err_vs_fp32": gate.noise_err, "drift_limit": gate.limit,
               "trim_host_us_median": statistics.median(trim_host_us) if trim_host_us else None}
        if ranks is not None:
            out.update(topology=ranks.topo.as_dict(), floor_ms_by_rank=over_ranks.get("floors"),
                       agree_us_median=over_ranks.get("agree_us"))
        return out

    def save() -> None:
        if checkpoint is not None:
            checkpoint(report())

    def prepare(mode: str, setting: str) -> TimedMode | None:
        nonlocal trace_s
        run = ModeRun(mode, setting)
        results.append(run)
        try:
            runner, traced = _prepare(run, model, kw, shared, shared_fwd, device)
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
            run.error = f"{type(e).__name__}: {e}"[:500]
            print(f"{mode}/{setting}: failed: {run.error}", flush=True)
            return None
        print(f"{mode}/{setting}: ready, check prompt max|d| {run.max_abs_err_vs_eager:.3g} vs the plain model, "
              f"rel L2 {run.rel_err_vs_fp32:.3g} vs the fp32 copy" + (" (DRIFT)" if run.drifted else ""), flush=True)
        return TimedMode(run, runner, shared if mode in MODE_OPTIONS else None)

    # This backend's modes (and eager) built and captured first, then timed in turns.
    ours = [m for m in (prepare(*ms) for ms in plan if ms[0] != "reduce-overhead") if m is not None]
    probes["start"] = host_probe()
    print(f"host speed at start: {probes['start']}", flush=True)
    save()
    time_points(ours, shapes, deadline, args, device, floors, trim_host_us, done=save,
                fail_fast=ranks is not None)  # as in prepare: a failure ends the run
    probes["end"] = host_probe()
    if ranks is not None:
        over_ranks["floors"] = ranks.gather(floors)
        if ranks.backend_groups["dp_group"] is not None:  # else no step agrees: tensor parallel alone
            over_ranks["agree_us"] = agreement_us(ranks)
            print(f"per-step agreement of the data-parallel ranks: median {over_ranks['agree_us']:.1f} us",
                  flush=True)
    ours.clear()
    shared.backends.clear()  # their graphs and buffers go before the peer compiles
    _release()
    for ms in plan:
        if ms[0] == "reduce-overhead":  # it resets Dynamo, so it comes last and alone
            if deadline.passed():  # its compile alone takes minutes
                results.append(ModeRun(*ms, error="time budget spent (--max-seconds) before its compile"))
                continue
            peer = prepare(*ms)
            save()
            if peer is not None:
                time_points([peer], shapes, deadline, args, device, floors, trim_host_us, done=save)
            peer = None
            _release()
    for run in results:
        print(json.dumps(asdict(run)), flush=True)
    return report()


def compile_only(args) -> dict:
    """Trace and build the default ``replay`` mode once: run it twice in fresh processes
    for cold and warm (Inductor's on-disk caches filled) compile times."""
    model, _ = bench_model(args)
    shared = SharedTrace({"replay": ReplayBackend(_backend_config("replay", "default", args))})
    kw = dict(max_num_seqs=max(args.conc), max_model_len=2 * model.cfg.window,
              max_num_batched_tokens=args.max_num_batched_tokens)
    _, total = _build("replay", model, kw, shared, torch.compile(model, backend=shared, fullgraph=True))
    build = shared.build_s["replay"]
    return {"preset": args.preset, "compile_s": total, "build_s": build, "trace_s": total - build}
