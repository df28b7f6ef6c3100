"""``replay-backend``: demo, verify, inspect and bench."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from ..compat import dynamo as compat_dynamo
from ..bench import run as bench
from ..backend import ReplayBackend
from . import cli_args
from .batch_spec import GRAMMAR, parse_batch_spec
from .cli_bench import add_decode_arguments, cmd_bench, cmd_decode_bench
from .cli_bench import _write_report  # noqa: F401  (the tests')
from .cli_options import backend_options
from .compare import default_tolerance, max_abs_err, max_abs_err_kv
from ..config import MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS, ReplayConfig
from ..kv_cache import MAX_MODEL_LEN
from . import PRESETS, build_model, preset
from ..plan import plan_of
from .runner import StepRunner
from .verify import runner_sizes, verify_step

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


def _demo_options(opts: dict, device: str) -> dict:
    """The CPU demo's defaults, where the given options leave room for them: plain FX
    pieces (Inductor takes minutes on 40 layers) and three main graph sizes with a
    threshold that makes the demo batch a trimming PIECEWISE step."""
    if device != "cpu":
        return opts
    opts = dict(opts)
    opts.setdefault("compiler", "eager")
    graphs = opts.get("cudagraph_mode", "piecewise") != "none"
    if graphs and "cudagraph_capture_sizes" not in opts and "max_cudagraph_capture_size" not in opts:
        top = opts.get("max_num_batched_tokens", 16384)
        sizes = [s for s in (128, 256, 512) if isinstance(top, int) and s <= top]
        if sizes:
            opts["cudagraph_capture_sizes"] = sizes
    if graphs and opts.get("decoder_replay", True) is True and opts.get("cudagraph_decoder_replay", True) is True:
        opts.setdefault("decoder_replay_trim_threshold", 256)
    return opts


def cmd_demo(args) -> int:
    device, name, dtype = _device_defaults(args)
    cfg = preset(name)
    reqs = parse_batch_spec(args.batch)
    opts = _demo_options(backend_options(args.option), device)
    cfg_b = ReplayConfig.from_options(opts)
    check_step(reqs, cfg_b, cfg.window, args.max_model_len)
    cli_args.check_layout(args.max_model_len, len(reqs), f"--max-model-len {args.max_model_len} with {len(reqs)} requests")
    print(f"model   : DSv4.1-mini preset {name!r}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
          f"window {cfg.window}, KV sources {list(cfg.kv_source_layer_ids)}, replay layers "
          f"{cfg.replay_layers.start}..{cfg.replay_layers.stop - 1}; {device}, {dtype}")
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
    cfg = ReplayConfig.from_options(backend_options(args.option))
    window = preset(_device_defaults(args)[1]).window
    check_step(reqs, cfg, window, args.max_model_len)
    kw = runner_sizes(reqs, window, cfg)
    cli_args.check_layout(kw["max_model_len"], kw["max_num_seqs"],
                  f"--batch: {len(reqs)} requests of up to {kw['max_model_len']} positions each")
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
    opts = backend_options(args.option)
    opts.setdefault("compiler", "eager")  # the split plan does not depend on the piece compiler
    if args.dump:
        cli_args.check_dir(args.dump, "--dump")  # before the compile, whose dump failure is only logged
        # Dump while compiling: the graph before the split only exists then.
        opts["debug_dump_path"] = args.dump
    cfg = ReplayConfig.from_options(opts)
    model, _, _ = _model_for(args)
    if cfg.decoder_replay:  # before the trace, whose failure would be wrapped by Dynamo
        cfg.check_window(model.cfg.window)
    backend = ReplayBackend(cfg)
    runner = StepRunner(model, backend=backend, max_num_seqs=1, max_model_len=2 * model.cfg.window)
    runner.run(runner.dummy_batch(model.cfg.window))  # one trace, no capture
    if args.dump and not os.path.isfile(os.path.join(backend.model.dump_dir, "index.md")):
        raise ValueError(f"--dump {args.dump}: the dump could not be written (the warning above says why)")
    plan = plan_of(backend)
    print(plan.to_json() if args.json else plan.render())
    if args.dump and not args.json:
        print(f"dump: {backend.model.dump_dir}/index.md")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = cli_args.Parser(prog="replay-backend", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    grammar = dict(epilog=GRAMMAR, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = sub.add_parser("demo", help="run the main job on the embedded default model", **grammar)
    d.add_argument("--preset", choices=sorted(PRESETS))
    d.add_argument("--device", type=cli_args.device, help="cpu, cuda or cuda:N (default: cuda where available)")
    d.add_argument("--batch", default=DEFAULT_BATCH,
                   help=f"the step's requests (grammar below; default {DEFAULT_BATCH!r})")
    d.add_argument("--max-model-len", type=cli_args.int_arg(2, MAX_MODEL_LEN, even=True, why=cli_args.LEN_WHY), default=1024,
                   help="the cache length of each request (even; its caches are allocated)")
    d.add_argument("--option", action="append", metavar="KEY=VALUE", help="a backend option (docs/configuration.md)")
    d.set_defaults(fn=cmd_demo)

    v = sub.add_parser("verify", help="one step through the backend vs the eager oracle", **grammar)
    v.add_argument("--batch", required=True, help="the step's requests (grammar below), e.g. 'd:1/700,p:250,k:140'")
    v.add_argument("--preset", choices=sorted(PRESETS))
    v.add_argument("--device", type=cli_args.device, help="cpu, cuda or cuda:N (default: cuda where available)")
    v.add_argument("--option", action="append", metavar="KEY=VALUE", help="a backend option (docs/configuration.md)")
    v.add_argument("--json", action="store_true")
    v.add_argument("--tolerance", type=cli_args.number(0.0),
                   help="the largest max |d| that agrees, a finite number >= 0 (default: by dtype)")
    v.add_argument("--max-model-len", type=cli_args.int_arg(1, MAX_MODEL_LEN, why=cli_args.LEN_WHY), default=131072,
                   help="the longest sequence a --batch request may reach (its caches are allocated)")
    v.add_argument("--capture-all", action="store_true",
                   help="capture every graph size first (default: capture the sizes used, on first use)")
    v.set_defaults(fn=cmd_verify)

    i = sub.add_parser("inspect", help="the split plan")
    i.add_argument("--preset", choices=sorted(PRESETS))
    i.add_argument("--device", type=cli_args.device, help="cpu, cuda or cuda:N (default: cuda where available)")
    i.add_argument("--option", action="append", metavar="KEY=VALUE", help="a backend option (docs/configuration.md)")
    i.add_argument("--json", action="store_true")
    i.add_argument("--dump", metavar="DIR", help="write a navigable dump under DIR (index.md, the graph "
                   "before and after the split, every piece's readable code, config, plan)")
    i.set_defaults(fn=cmd_inspect)

    b = sub.add_parser("bench", help="prefill-only TTFT of every mode (GPU)")
    b.add_argument("--preset", help="default: mini-2k on CUDA, tiny on CPU")
    b.add_argument("--isl", type=cli_args.int_list(1, MAX_MODEL_LEN - 2, why=cli_args.LEN_WHY), default=[1024, 4096, 8192, 32768])
    b.add_argument("--conc", type=cli_args.int_list(1, MAX_NUM_SEQS, why="MAX_NUM_SEQS"), default=[1, 8])
    b.add_argument("--modes", type=cli_args.names(list(bench.MODES)),
                   help="default: every mode; with --tp/--dp/--enable-expert-parallel every mode but "
                        "reduce-overhead, which runs on one process only and is refused there")
    b.add_argument("--settings", type=cli_args.names(["default", "wide"]), default=["default", "wide"],
                   help="capture settings of the graphed modes (default, wide); modes without "
                        "this backend's graphs run once, at the default setting")
    b.add_argument("--runs", type=cli_args.int_arg(1), default=10)
    b.add_argument("--warmup", type=cli_args.int_arg(0), default=2)
    b.add_argument("--max-num-batched-tokens", type=cli_args.int_arg(1, MAX_NUM_BATCHED_TOKENS, why="MAX_NUM_BATCHED_TOKENS"),
                   default=16384)
    b.add_argument("--max-tokens-per-point", type=cli_args.int_arg(1), default=65536,
                   help="skip ISL x concurrency points above this many prompt tokens")
    b.add_argument("--max-seconds", type=cli_args.number(0.0, above=True), default=1e9,
                   help="from the bench's start: no new point, nor the stock peer's compile, after this")
    b.add_argument("--json", metavar="PATH", help="write the raw report here")
    b.add_argument("--out", metavar="PATH", help="write the markdown table here")
    b.add_argument("--profile-out", metavar="FILE", help="append a profiler summary per mode and profiled point")
    b.add_argument("--profile-points", type=cli_args.profile_points, default=["1024/1", "8192/1"],
                   metavar="ISL/CONC,...")
    b.add_argument("--trace-dir", metavar="DIR", help="keep each profiled point's Chrome trace here (gzipped)")
    b.add_argument("--model-option", action="append", metavar="KEY=VALUE", default=[],
                   help="override a model config field, e.g. sinkhorn_impl=fused")
    b.add_argument("--option", action="append", metavar="KEY=VALUE", default=[],
                   help="a backend option for every mode of this backend, e.g. compiler=eager "
                        "(not the keys the modes and capture settings decide)")
    b.add_argument("--attention", type=cli_args.names(), metavar="IMPL,...",
                   help="run the whole bench once per attention implementation (e.g. triton,flashinfer), "
                        "one after the other, a pass after one whose floors traced CUDA in a process of its "
                        "own (docs/benchmarks.md); default: the model's own")
    b.add_argument("--tp", type=cli_args.int_arg(1), metavar="N",
                   help="tensor-parallel ranks: one process per rank (tp x dp ranks, one GPU each; gloo on the "
                        "CPU), spawned here or started by torchrun; rank 0 prints and writes the report "
                        "(docs/benchmarks.md, Several GPUs)")
    b.add_argument("--dp", type=cli_args.int_arg(1), metavar="N",
                   help="data-parallel ranks (each runs every point's prompts of its own)")
    b.add_argument("--enable-expert-parallel", action="store_true",
                   help="with --dp: data-parallel attention, the MoE's experts split over every rank (DEP)")
    b.add_argument("--compile-only", action="store_true",
                   help="only trace and build the replay mode, print the seconds (cold/warm compile)")
    b.set_defaults(fn=cmd_bench)
    d = sub.add_parser("decode-bench", help="time per decode step (TPOT) of each graph mode (GPU)")
    add_decode_arguments(d)
    d.set_defaults(fn=cmd_decode_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    """The console script: 0 (or 1 where a comparison failed) on success; 2 with one
    line ``replay-backend: error: ...`` on stderr for a usage error, from the parser
    or from the commands' own checks (a ValueError, however wrapped). Anything else
    is a bug and keeps its traceback."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help (0), or a usage error already printed (2)
        return e.code if isinstance(e.code, int) else 2
    try:
        return args.fn(args)
    except Exception as e:  # noqa: BLE001 - a user's error, however wrapped, is one line
        err = compat_dynamo.user_error(e)
        if err is None:
            raise
        print(f"replay-backend: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
