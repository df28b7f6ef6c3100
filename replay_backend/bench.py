"""``replay-backend bench``: prefill-only step latency of every mode (SPEC §9).

All modes run in one process on the same model. A measurement is the TTFT of
``concurrency`` prompts of ``isl`` tokens with ``max_tokens=1``: every chunked-prefill
step (``max_num_batched_tokens`` per step) from the first to the last, synchronised;
the median of ``runs`` measurements after ``warmup`` ones.
"""
from __future__ import annotations

import copy
import gc
import json
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from . import torch_compat
from .backend import ReplayBackend
from .compare import max_abs_err
from .config import ReplayConfig
from .models import build_model, preset
from .piece_cache import PieceCache
from .runner import StepRunner

MODES = ("eager", "off", "parent", "piecewise", "replay", "reduce-overhead")
MODE_OPTIONS = {
    "off": {"cudagraph_mode": "none", "decoder_replay": False},
    "parent": {"cudagraph_mode": "none", "cudagraph_decoder_replay": False},
    "piecewise": {"cudagraph_decoder_replay": False},
    "replay": {},
}
WIDE_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


@dataclass
class ModeRun:
    mode: str
    setting: str
    compile_s: float = 0.0  # this mode's backend build (the shared trace is reported once)
    capture: dict = field(default_factory=dict)
    memory_estimate_gib: float | None = None
    ms: dict = field(default_factory=dict)  # "isl/conc" -> median ms
    trim_host_us: dict = field(default_factory=dict)  # "isl/conc" -> median per trimming step
    max_abs_err_vs_eager: float | None = None  # last-row logits of one prompt vs the plain model
    error: str | None = None


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class _Dynamic:
    """A stock torch.compile'd model called like the runner calls ours (one trace)."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def __call__(self, ids, pos):
        with torch_compat.dynamic_tokens(ids, pos):
            return self.fn(ids, pos)


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
    overrides = {}
    for item in getattr(args, "model_option", None) or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--model-option wants KEY=VALUE, got {item!r}")
        overrides[key] = int(value) if value.isdigit() else value
    try:
        return preset(args.preset, **overrides)
    except TypeError as e:
        raise ValueError(f"--model-option: {e}") from None


def _backend_config(mode: str, setting: str, args) -> ReplayConfig:
    opts = dict(MODE_OPTIONS[mode], max_num_batched_tokens=args.max_num_batched_tokens)
    if setting == "wide" and opts.get("cudagraph_mode") != "none":
        opts.update(max_cudagraph_capture_size=args.max_num_batched_tokens,
                    cudagraph_capture_sizes=[s for s in WIDE_SIZES if s <= args.max_num_batched_tokens])
    return ReplayConfig.from_options(opts)


def _plan(args) -> list[tuple[str, str]]:
    """(mode, setting) in the order given, the stock peer last. Modes without graphs of
    this backend run at the default setting only."""
    order = []
    for mode in args.modes:
        for setting in args.settings:
            if setting == "wide" and mode in ("eager", "off", "parent", "reduce-overhead"):
                continue
            order.append((mode, setting))
    # The stock peer last: it resets Dynamo, which drops the shared trace.
    return sorted(order, key=lambda ms: ms[0] == "reduce-overhead")


def _ttft(runner: StepRunner, isl: int, conc: int, tag: str) -> float:
    prompts = {f"{tag}-{i}": isl for i in range(conc)}
    _sync()
    t0 = time.perf_counter()
    runner.prefill(prompts)
    _sync()
    ms = (time.perf_counter() - t0) * 1e3
    for rid in prompts:
        runner.free(rid)
    return ms


def _kernels(events) -> list:
    """Device-side events only: a CPU op's "self CUDA" time is its kernels' time again."""
    return [e for e in events if e.device_type != torch.autograd.DeviceType.CPU and e.self_device_time_total > 0]


def _kernel_floor_ms(runner: StepRunner, isl: int, conc: int) -> float:
    """Sum of GPU kernel times of one TTFT (the profile's device self time)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _ttft(runner, isl, conc, "floor")
    return sum(e.self_device_time_total for e in _kernels(prof.key_averages())) / 1e3


def _profile(runner: StepRunner, isl: int, conc: int, path: str, title: str) -> None:
    """Where one TTFT's time goes: host wall time, GPU kernel time, top ops and kernels."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        wall = _ttft(runner, isl, conc, "prof")
    events = prof.key_averages()
    kernels = _kernels(events)
    gpu_ms = sum(e.self_device_time_total for e in kernels) / 1e3
    launches = sum(e.count for e in kernels)
    with open(path, "a") as f:  # one file: every profile of the run, each under its title
        f.write(f"\n\n######## {title}\n")
        f.write(f"wall {wall:.2f} ms (profiled), GPU kernel time {gpu_ms:.2f} ms, {launches} kernels\n\n")
        f.write(events.table(sort_by="self_device_time_total" if kernels else "self_cpu_time_total",
                             row_limit=40, max_name_column_width=70))
        f.write("\n\nby host time\n")
        f.write(events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70))


def _release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_bench(args) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = build_model(_model_config(args), device, dtype)
    shapes = [(i, c) for i in args.isl for c in args.conc if not (i * c > args.max_tokens_per_point)]
    kw = dict(max_num_seqs=max(args.conc), max_model_len=max(max(args.isl), model.cfg.window) + 2,
              max_num_batched_tokens=args.max_num_batched_tokens)
    plan = _plan(args)
    ref_runner = StepRunner(model, **kw)
    reference = ref_runner.prefill({"check": shapes[0][0]})["check"]
    ref_runner = None
    cache = PieceCache()  # identical pieces compile once
    shared = SharedTrace({f"{m}/{s}": ReplayBackend(_backend_config(m, s, args), piece_cache=cache)
                          for m, s in plan if m in MODE_OPTIONS})
    shared_fwd = torch.compile(model, backend=shared, fullgraph=True)
    results: list[ModeRun] = []
    floors: dict = {}
    trim_host_us: list[float] = []
    trace_s = None
    deadline = time.perf_counter() + args.max_seconds
    for mode, setting in plan:
        run = ModeRun(mode, setting)
        results.append(run)
        key = f"{mode}/{setting}"
        runner = None
        try:
            if mode == "eager":
                runner = StepRunner(model, **kw)
            elif mode == "reduce-overhead":
                torch._dynamo.reset()  # our modes are done; the peer traces on its own
                peer = torch.compile(model, options=torch_compat.reduce_overhead_options())
                runner = StepRunner(model, forward=_Dynamic(peer), **kw)
                t0 = time.perf_counter()
                runner.run(runner.dummy_batch(model.cfg.window))
                _sync()
                run.compile_s = time.perf_counter() - t0
            else:
                be = shared.backends[key]
                shared.current = key
                runner = StepRunner(model, forward=shared_fwd, backend=be, **kw)
                t0 = time.perf_counter()
                runner.run(runner.dummy_batch(model.cfg.window), use_graphs=False)
                _sync()
                if trace_s is None:  # the first call traced and built every mode
                    trace_s = time.perf_counter() - t0 - sum(shared.build_s.values())
                run.compile_s = shared.build_s[key]
                if be.config.graphs_enabled:
                    if device == "cuda":
                        run.memory_estimate_gib = runner.estimate_graph_memory().total_gib
                    run.capture = runner.capture()
                    for level, c in run.capture.items():
                        print(f"{key}: captured {level} graphs: {c['graphs']} graphs over {c['sizes']} sizes, "
                              f"{c['seconds']:.1f} s, {c['gib']:.2f} GiB", flush=True)
            # Same answer as the plain model on one prompt: a fast wrong mode is no result.
            got = runner.prefill({"check": shapes[0][0]})["check"]
            runner.free("check")
            run.max_abs_err_vs_eager = max_abs_err(got, reference)
            for isl, conc in shapes:
                if time.perf_counter() > deadline:
                    run.error = "time budget spent"
                    break
                for w in range(args.warmup):
                    _ttft(runner, isl, conc, f"w{w}")
                rep = runner.backend.model.replay if mode == "replay" else None
                if rep is not None:
                    rep.host_us.clear()  # the trimming steps of the timed runs only
                times = [_ttft(runner, isl, conc, f"m{k}") for k in range(args.runs)]
                run.ms[f"{isl}/{conc}"] = statistics.median(times)
                if rep is not None and rep.host_us:
                    trim_host_us.extend(rep.host_us)
                    run.trim_host_us[f"{isl}/{conc}"] = statistics.median(rep.host_us)
                if args.profile_out and f"{isl}/{conc}" in args.profile_points:
                    _profile(runner, isl, conc, args.profile_out, f"{mode}/{setting} {isl}/{conc}")
                if mode == "replay":
                    if device == "cuda":
                        floors.setdefault(setting, {})[f"{isl}/{conc}"] = _kernel_floor_ms(runner, isl, conc)
        except Exception as e:  # report the failure of one mode, keep the others
            run.error = f"{type(e).__name__}: {e}"[:500]
        print(json.dumps(asdict(run)), flush=True)
        runner = None
        shared.backends.pop(key, None)  # this mode's graphs and buffers go
        _release()
    return {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "torch": torch.__version__, "preset": args.preset, "dtype": str(dtype),
            "model_options": list(args.model_option or []),
            "runs": args.runs, "warmup": args.warmup, "max_num_batched_tokens": args.max_num_batched_tokens,
            "trace_s": trace_s, "results": [asdict(r) for r in results], "floor_ms": floors,
            "trim_host_us_median": statistics.median(trim_host_us) if trim_host_us else None}


def _fmt(value, spec: str) -> str:
    return "-" if value is None else spec.format(value)


def render(report: dict) -> str:
    opts = " ".join(report.get("model_options") or [])
    lines = [f"# {report['preset']}{' (' + opts + ')' if opts else ''} {report['dtype']} on {report['device']} (torch {report['torch']}), "
             f"median of {report['runs']} after {report['warmup']} warm-up, "
             f"max_num_batched_tokens {report['max_num_batched_tokens']}"]
    by = {(r["setting"], r["mode"]): r for r in report["results"]}
    for setting in ("default", "wide"):
        rows = {k for (s, _), r in by.items() if s == setting for k in r["ms"]}
        if not rows:
            continue
        modes = [m for m in MODES if (setting, m) in by or (setting == "wide" and ("default", m) in by)]
        lines.append(f"\n## capture setting: {setting}\n")
        head = "| ISL/conc | " + " | ".join(f"{m} ms" for m in modes) + " | floor ms | " + \
            " | ".join(f"replay speed-up vs {m}" for m in modes if m != "replay") + " | replay / floor |"
        lines += [head, "|" + "---|" * (head.count("|") - 1)]
        for key in sorted(rows, key=lambda k: tuple(int(x) for x in k.split("/"))):
            def ms(m):
                r = by.get((setting, m)) or by.get(("default", m))
                return r["ms"].get(key) if r else None

            rep = ms("replay")
            floor = report["floor_ms"].get(setting, {}).get(key)
            cells = [_fmt(ms(m), "{:.1f}") for m in modes] + [_fmt(floor, "{:.1f}")]
            cells += [_fmt(ms(m) / rep if ms(m) and rep else None, "{:.2f}x") for m in modes if m != "replay"]
            cells.append(_fmt(rep / floor if rep and floor else None, "{:.2f}"))
            lines.append(f"| {key} | " + " | ".join(cells) + " |")
    if report.get("trace_s") is not None:
        lines.append(f"\nDynamo trace, once for every mode of this backend: {report['trace_s']:.1f} s")
    lines.append("\nbuild (split + compile pieces; the first built compiles, the others reuse "
                 "identical pieces) and capture per mode:")
    for r in report["results"]:
        cap = ", ".join(f"{k}: {v['graphs']} graphs over {v['sizes']} sizes, {v['seconds']:.1f} s, "
                        f"{v['gib']:.2f} GiB" for k, v in (r["capture"] or {}).items())
        est = r.get("memory_estimate_gib")
        err = r.get("max_abs_err_vs_eager")
        what = "trace + compile" if r["mode"] == "reduce-overhead" else "build"
        lines.append(f"- {r['setting']}/{r['mode']}: {what} {r['compile_s']:.1f} s; {cap or 'no graphs'}"
                     + (f"; logits vs eager max|d| {err:.3g}" if err is not None else "")
                     + (f"; estimated graph memory {est:.2f} GiB" if est is not None else "")
                     + (f"; ERROR {r['error']}" if r["error"] else ""))
    if report.get("trim_host_us_median") is not None:
        lines.append(f"\ntrim op host time per trimming step: median {report['trim_host_us_median']:.0f} us")
        for r in report["results"]:
            if r.get("trim_host_us"):
                lines.append(f"- {r['setting']}/{r['mode']}: " + ", ".join(
                    f"{k}: {v:.0f} us" for k, v in r["trim_host_us"].items()))
    return "\n".join(lines)


def compile_only(args) -> dict:
    """Trace and build the default ``replay`` mode once: run it twice in fresh processes
    for cold and warm (Inductor's on-disk caches filled) compile times."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_model(_model_config(args), device, torch.bfloat16 if device == "cuda" else torch.float32)
    be = ReplayBackend(_backend_config("replay", "default", args))
    shared = SharedTrace({"replay": be})
    shared.current = "replay"
    runner = StepRunner(model, forward=torch.compile(model, backend=shared, fullgraph=True), backend=be,
                        max_num_seqs=max(args.conc), max_model_len=2 * model.cfg.window,
                        max_num_batched_tokens=args.max_num_batched_tokens)
    t0 = time.perf_counter()
    runner.run(runner.dummy_batch(model.cfg.window), use_graphs=False)
    _sync()
    total = time.perf_counter() - t0
    return {"preset": args.preset, "compile_s": total, "build_s": shared.build_s["replay"],
            "trace_s": total - shared.build_s["replay"]}
