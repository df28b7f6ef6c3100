"""``replay-backend``: demo, verify, inspect and bench (SPEC §8)."""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

import torch

from .. import torch_compat
from ..bench import run as bench
from ..backend import ReplayBackend
from .batch_spec import parse_batch_spec
from .cli_options import parse_options
from .compare import default_tolerance, max_abs_err, max_abs_err_kv
from ..config import ReplayConfig
from . import PRESETS, build_model, preset
from ..plan import plan_of
from .runner import StepRunner
from .verify import verify_step

DEFAULT_BATCH = "d:1/300,p:250,p:60/260,k:140"


def _device_defaults(args) -> tuple[str, str, torch.dtype]:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    name = args.preset or ("mini-2k" if device.startswith("cuda") else "tiny")
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    return device, name, dtype


def _timed(fn):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, (time.perf_counter() - t0) * 1e3


def cmd_demo(args) -> int:
    device, name, dtype = _device_defaults(args)
    cfg = preset(name)
    print(f"model   : DSv4.1-mini preset {name!r}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
          f"window {cfg.window}, KV sources {list(cfg.kv_source_layer_ids)}, replay layers "
          f"{cfg.replay_layers.start}..{cfg.replay_layers.stop - 1}; {device}, {dtype}")
    reqs = parse_batch_spec(args.batch)
    opts = parse_options(args.option)
    if device == "cpu":
        # Keep the CPU demo quick: plain FX pieces (Inductor takes minutes on 40 layers)
        # and three main graph sizes, so the demo batch is a trimming PIECEWISE step.
        for key, val in (("compiler", "eager"), ("cudagraph_capture_sizes", [128, 256, 512]),
                         ("decoder_replay_trim_threshold", 256)):
            opts.setdefault(key, val)
    cfg_b = ReplayConfig.from_options(opts)
    check_step(reqs, cfg_b, cfg.window, args.max_model_len)
    model = build_model(cfg, device, dtype)
    kw = dict(max_num_seqs=len(reqs), max_model_len=args.max_model_len)
    runners = {"off": StepRunner(model, **kw), "parent": StepRunner(model, **kw),
               "replay": StepRunner(model, backend=ReplayBackend(cfg_b), **kw)}
    for r in runners.values():
        r.prefill_context(reqs, forward=model)
    batch = runners["off"].build_batch(reqs)
    print(f"batch   : {args.batch}  ({batch.num_tokens} tokens, {len(reqs)} requests, "
          f"{batch.replay.num_rows} replay rows, floors {list(batch.view.kv_start)})")
    _, ms = _timed(runners["replay"].capture)
    print(f"options : {opts}")
    print(f"capture : compiled ({cfg_b.compiler} pieces) and captured main + replay graphs in "
          f"{ms / 1e3:.1f} s ({'CUDA graphs' if device.startswith('cuda') else 'emulated graphs on CPU'})")
    outs = {}
    for m, r in runners.items():
        mode = m if m != "replay" else "off"
        outs[m], ms = _timed(lambda: r.step(reqs, eager_replay=mode))
        extra = ""
        if m == "replay":
            o = outs[m]
            extra = (f"  ({o.step.kind} step, {o.step.padded_tokens} padded tokens, trimmed="
                     f"{o.trim.trimmed}, replay rows {o.trim.rows} -> graph size {o.trim.padded})")
        print(f"mode    : {'eager ' + m if m != 'replay' else 'compiled replay':<16s}{ms:8.1f} ms{extra}")
    tol = default_tolerance(dtype)
    ok = True
    for m in ("parent", "replay"):
        err = max_abs_err(outs["off"].logits, outs[m].logits)
        kv_err = max_abs_err_kv(runners["off"].kv, runners[m].kv, batch)
        good = err <= tol and kv_err <= tol
        ok &= good
        print(f"agree   : off vs {m:<7s}: logits max|d| {err:.2e}, replay KV max|d| {kv_err:.2e} "
              f"(tolerance {tol:.0e}) -> {'OK' if good else 'MISMATCH'}")
    return 0 if ok else 1


def _model_for(args):
    device, name, dtype = _device_defaults(args)
    return build_model(preset(name), device, dtype), device, name


def check_step(reqs, cfg: ReplayConfig, window: int, max_model_len: int) -> None:
    """What the step and the options must satisfy, checked before a model is built."""
    if cfg.decoder_replay:
        cfg.check_window(window)
    tokens = sum(r.query_len for r in reqs)
    if tokens > cfg.max_num_batched_tokens:
        raise ValueError(f"--batch: the step has {tokens} tokens, more than max_num_batched_tokens="
                         f"{cfg.max_num_batched_tokens}")
    longest = max(r.seq_len for r in reqs)
    if longest > max_model_len:
        raise ValueError(f"--batch: sequence length {longest} exceeds --max-model-len={max_model_len}")


def cmd_verify(args) -> int:
    reqs = parse_batch_spec(args.batch)
    cfg = ReplayConfig.from_options(parse_options(args.option))
    check_step(reqs, cfg, preset(_device_defaults(args)[1]).window, args.max_model_len)
    model, device, name = _model_for(args)
    res = verify_step(model, reqs, cfg, capture=args.capture_all, tolerance=args.tolerance)
    if args.json:
        print(json.dumps({**res.as_dict(), "preset": name, "device": device, "batch": args.batch}))
    else:
        print(f"{args.batch}: {res.step_kind} step, {res.num_tokens} tokens (padded {res.padded_tokens}), "
              f"trimmed={res.trimmed}, replay rows {res.replay_rows} -> "
              f"{res.replay_padded if res.replay_padded is not None else 'eager'}"
              f"{' (graph)' if res.replay_graph else ''}")
        print(f"max|d| logits {res.max_abs_err_logits:.3e}, replay KV {res.max_abs_err_kv:.3e}, "
              f"tolerance {res.tolerance:.0e}: {'OK' if res.ok else 'MISMATCH'}")
    return 0 if res.ok else 1


def cmd_inspect(args) -> int:
    opts = parse_options(args.option)
    opts.setdefault("compiler", "eager")  # the split plan does not depend on the piece compiler
    if args.dump:
        # Dump while compiling: the graph before the split only exists then.
        opts["debug_dump_path"] = args.dump
    cfg = ReplayConfig.from_options(opts)
    model, _, _ = _model_for(args)
    if cfg.decoder_replay:  # before the trace, whose failure would be wrapped by Dynamo
        cfg.check_window(model.cfg.window)
    backend = ReplayBackend(cfg)
    runner = StepRunner(model, backend=backend, max_num_seqs=1, max_model_len=2 * model.cfg.window)
    runner.run(runner.dummy_batch(model.cfg.window))  # one trace, no capture
    plan = plan_of(backend)
    print(plan.to_json() if args.json else plan.render())
    if args.dump and not args.json:
        print(f"dump: {backend.model.dump_dir}/index.md")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="replay-backend", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="run the main job on the embedded default model")
    d.add_argument("--preset", choices=sorted(PRESETS))
    d.add_argument("--device")
    d.add_argument("--batch", default=DEFAULT_BATCH)
    d.add_argument("--max-model-len", type=int, default=1024)
    d.add_argument("--option", action="append", metavar="KEY=VALUE")
    d.set_defaults(fn=cmd_demo)

    v = sub.add_parser("verify", help="one step through the backend vs the eager oracle")
    v.add_argument("--batch", required=True, help="e.g. 'd:1/700,p:250,p:60/260,k:140'")
    v.add_argument("--preset", choices=sorted(PRESETS))
    v.add_argument("--device")
    v.add_argument("--option", action="append", metavar="KEY=VALUE")
    v.add_argument("--json", action="store_true")
    v.add_argument("--tolerance", type=float)
    v.add_argument("--max-model-len", type=int, default=131072,
                   help="the longest sequence a --batch request may reach (its caches are allocated)")
    v.add_argument("--capture-all", action="store_true",
                   help="capture every graph size first (default: capture the sizes used, on first use)")
    v.set_defaults(fn=cmd_verify)

    i = sub.add_parser("inspect", help="the split plan")
    i.add_argument("--preset", choices=sorted(PRESETS))
    i.add_argument("--device")
    i.add_argument("--option", action="append", metavar="KEY=VALUE")
    i.add_argument("--json", action="store_true")
    i.add_argument("--dump", metavar="DIR", help="write a navigable dump under DIR (index.md, the graph "
                   "before and after the split, every piece's readable code, config, plan)")
    i.set_defaults(fn=cmd_inspect)

    b = sub.add_parser("bench", help="prefill-only TTFT of every mode (SPEC §9; GPU)")
    b.add_argument("--preset", help="default: mini-2k on CUDA, tiny on CPU")
    b.add_argument("--isl", type=_int_list, default=[1024, 4096, 8192, 32768])
    b.add_argument("--conc", type=_int_list, default=[1, 8])
    b.add_argument("--modes", type=lambda s: s.split(","), default=list(bench.MODES))
    b.add_argument("--settings", type=lambda s: s.split(","), default=["default", "wide"],
                   help="capture settings of the graphed modes (default, wide); modes without "
                        "this backend's graphs run once, at the default setting")
    b.add_argument("--runs", type=int, default=10)
    b.add_argument("--warmup", type=int, default=2)
    b.add_argument("--max-num-batched-tokens", type=int, default=16384)
    b.add_argument("--max-tokens-per-point", type=int, default=65536,
                   help="skip ISL x concurrency points above this many prompt tokens")
    b.add_argument("--max-seconds", type=float, default=1e9,
                   help="from the bench's start: no new point, nor the stock peer's compile, after this")
    b.add_argument("--json", metavar="PATH", help="write the raw report here")
    b.add_argument("--out", metavar="PATH", help="write the markdown table here")
    b.add_argument("--profile-out", metavar="FILE", help="append a profiler summary per mode and profiled point")
    b.add_argument("--profile-points", type=lambda s: s.split(","), default=["1024/1", "8192/1"],
                   metavar="ISL/CONC,...")
    b.add_argument("--trace-dir", metavar="DIR", help="keep each profiled point's Chrome trace here (gzipped)")
    b.add_argument("--model-option", action="append", metavar="KEY=VALUE", default=[],
                   help="override a model config field, e.g. sinkhorn_impl=fused")
    b.add_argument("--attention", type=lambda s: s.split(","), metavar="IMPL,...",
                   help="run the whole bench once per attention implementation (e.g. triton,flashinfer), "
                        "in this process, one after the other (a later pass can read slower on the same "
                        "host: docs/benchmarks.md); default: the model's own")
    b.add_argument("--compile-only", action="store_true",
                   help="only trace and build the replay mode, print the seconds (cold/warm compile)")
    b.set_defaults(fn=cmd_bench)
    return p


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _write_report(args, reports: list[dict]) -> str:
    """The tables of ``reports`` (one per attention implementation), written to --out
    and the reports to --json when given (one report as itself, several as
    ``{"reports": [...]}``): after every point, so a run an outer limit stops keeps
    what it measured."""
    text = "\n\n".join(bench.render(r) for r in reports)
    raw = reports[0] if len(reports) == 1 else {"reports": reports}
    for path, body in ((args.json, lambda: json.dumps(raw, indent=2)), (args.out, lambda: text + "\n")):
        if path:  # whole or not at all: a limit may stop the run while it writes
            with open(f"{path}.part", "w") as f:
                f.write(body())
            os.replace(f"{path}.part", path)
    return text


def cmd_bench(args) -> int:
    if args.preset is None:
        args.preset = "mini-2k" if torch.cuda.is_available() else "tiny"
    unknown = sorted(set(args.modes) - set(bench.MODES))
    if unknown:
        raise ValueError(f"unknown bench mode(s) {unknown}; choose from {list(bench.MODES)}")
    bad = sorted(set(args.settings) - {"default", "wide"})
    if bad:
        raise ValueError(f"unknown capture setting(s) {bad}; choose default and/or wide")
    impls = args.attention or [None]
    for impl in impls:  # a bad name fails here, before any model is built
        if impl is not None:
            preset(args.preset, attention_impl=impl)
    if args.compile_only:
        print(json.dumps(bench.compile_only(args)))
        return 0
    t0, done = time.perf_counter(), []
    fp32_results: dict = {}  # one set of fp32 copies for every implementation's pass
    for impl in impls:
        run = copy.copy(args)
        if impl is not None:
            run.model_option = [*args.model_option, f"attention_impl={impl}"]
        run.max_seconds = args.max_seconds - (time.perf_counter() - t0)  # one budget for every run
        torch._dynamo.reset()  # each implementation traces its own model
        done.append(bench.run_bench(run, checkpoint=lambda partial: _write_report(args, [*done, partial]),
                                    fp32_results=fp32_results))
    print(_write_report(args, done))
    return 0 if all(not r["error"] and not r.get("drifted") for rep in done for r in rep["results"]) else 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except Exception as e:  # noqa: BLE001 - a user's error, however wrapped, is one line
        err = torch_compat.user_error(e)
        if err is None:
            raise
        print(f"replay-backend: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
