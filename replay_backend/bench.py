"""``replay-backend bench``: prefill-only step latency of every mode (SPEC §9).

All modes run in one process on the same model. A measurement is the TTFT of
``concurrency`` prompts of ``isl`` tokens with ``max_tokens=1``: every chunked-prefill
step (``max_num_batched_tokens`` per step) from the first to the last, synchronised;
the median of ``runs`` measurements after ``warmup`` ones.
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from . import torch_compat
from .backend import ReplayBackend
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
    compile_s: float = 0.0
    capture: dict = field(default_factory=dict)
    ms: dict = field(default_factory=dict)  # "isl/conc" -> median ms
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


def _runner(model, mode: str, setting: str, args, cache: PieceCache) -> tuple[StepRunner, ReplayBackend | None]:
    kw = dict(max_num_seqs=max(args.conc), max_model_len=max(max(args.isl), model.cfg.window) + 2,
              max_num_batched_tokens=args.max_num_batched_tokens)
    if mode == "eager":
        return StepRunner(model, **kw), None
    if mode == "reduce-overhead":
        return StepRunner(model, forward=_Dynamic(torch.compile(model, mode="reduce-overhead")), **kw), None
    opts = dict(MODE_OPTIONS[mode], max_num_batched_tokens=args.max_num_batched_tokens)
    if setting == "wide" and opts.get("cudagraph_mode") != "none":
        opts.update(max_cudagraph_capture_size=args.max_num_batched_tokens,
                    cudagraph_capture_sizes=[s for s in WIDE_SIZES if s <= args.max_num_batched_tokens])
    be = ReplayBackend(ReplayConfig.from_options(opts), piece_cache=cache)
    return StepRunner(model, backend=be, **kw), be


def _ttft(runner: StepRunner, isl: int, conc: int, tag: str, eager_replay: str) -> float:
    prompts = {f"{tag}-{i}": isl for i in range(conc)}
    _sync()
    t0 = time.perf_counter()
    runner.prefill(prompts, eager_replay=eager_replay)
    _sync()
    ms = (time.perf_counter() - t0) * 1e3
    for rid in prompts:
        runner.free(rid)
    return ms


def _kernel_floor_ms(runner: StepRunner, isl: int, conc: int) -> float:
    """Sum of GPU kernel times of one TTFT (the profile's device self time)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _ttft(runner, isl, conc, "floor", "off")
    total_us = sum(e.self_device_time_total for e in prof.key_averages())
    return total_us / 1e3


def run_bench(args) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = build_model(preset(args.preset), device, dtype)
    shapes = [(i, c) for i in args.isl for c in args.conc if not (i * c > args.max_tokens_per_point)]
    results: list[ModeRun] = []
    floors: dict = {}
    trim_host_us: list[float] = []
    deadline = time.perf_counter() + args.max_seconds
    cache = PieceCache()  # every mode's identical pieces compile once
    for setting in args.settings:
        for mode in args.modes:
            if setting == "wide" and mode in ("eager", "off", "parent", "reduce-overhead"):
                continue  # no graphs of this backend: the default setting already measured it
            run = ModeRun(mode, setting)
            results.append(run)
            try:
                runner, be = _runner(model, mode, setting, args, cache)
                eager_replay = "off"
                t0 = time.perf_counter()
                runner.run(runner.dummy_batch(model.cfg.window))  # trace + compile
                _sync()
                run.compile_s = time.perf_counter() - t0
                if be is not None and be.config.graphs_enabled:
                    run.capture = runner.capture()
                for isl, conc in shapes:
                    if time.perf_counter() > deadline:
                        run.error = "time budget spent"
                        break
                    for w in range(args.warmup):
                        _ttft(runner, isl, conc, f"w{w}", eager_replay)
                    times = [_ttft(runner, isl, conc, f"m{k}", eager_replay) for k in range(args.runs)]
                    run.ms[f"{isl}/{conc}"] = statistics.median(times)
                    if mode == "replay" and device == "cuda":
                        floors.setdefault(setting, {})[f"{isl}/{conc}"] = _kernel_floor_ms(runner, isl, conc)
                        if be is not None and be.model.replay is not None:
                            trim_host_us.extend(be.model.replay.host_us[-args.runs:])
                print(json.dumps(asdict(run)), flush=True)
            except Exception as e:  # report the failure of one mode, keep the others
                run.error = f"{type(e).__name__}: {e}"[:500]
                print(json.dumps(asdict(run)), flush=True)
            finally:
                runner = be = None
                torch._dynamo.reset()
                if device == "cuda":
                    torch.cuda.empty_cache()
    return {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "torch": torch.__version__, "preset": args.preset, "dtype": str(dtype),
            "runs": args.runs, "warmup": args.warmup, "max_num_batched_tokens": args.max_num_batched_tokens,
            "results": [asdict(r) for r in results], "floor_ms": floors,
            "trim_host_us_median": statistics.median(trim_host_us) if trim_host_us else None}


def _fmt(value, spec: str) -> str:
    return "-" if value is None else spec.format(value)


def render(report: dict) -> str:
    lines = [f"# {report['preset']} {report['dtype']} on {report['device']} (torch {report['torch']}), "
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
    lines.append("\ncompile (s) and capture per mode:")
    for r in report["results"]:
        cap = ", ".join(f"{k}: {v['graphs']} graphs {v['seconds']:.1f} s {v['gib']:.2f} GiB"
                        for k, v in (r["capture"] or {}).items())
        lines.append(f"- {r['setting']}/{r['mode']}: compile {r['compile_s']:.1f} s; {cap or 'no graphs'}"
                     + (f"; ERROR {r['error']}" if r["error"] else ""))
    if report.get("trim_host_us_median") is not None:
        lines.append(f"\ntrim op host time per trimming step: median {report['trim_host_us_median']:.0f} us")
    return "\n".join(lines)
