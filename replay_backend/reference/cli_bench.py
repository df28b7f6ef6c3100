"""``replay-backend bench`` and ``decode-bench``: their checks, before any model is
built, and their runs (bench/run.py, bench/decode.py), on one rank or several."""
from __future__ import annotations

import copy
import functools
import json
import os
import sys
import time
from dataclasses import replace

import torch

from ..bench import decode as decode_bench
from ..bench.decode_report import render as render_decode
from ..bench import modes as bench_modes
from ..bench import own_process
from ..bench import ranks as bench_ranks
from ..bench import run as bench
from ..config import MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS
from ..kv_cache import MAX_MODEL_LEN
from . import cli_args
from .cli_options import model_config


def add_decode_arguments(p) -> None:
    """The arguments of ``replay-backend decode-bench``."""
    length = cli_args.int_list(1, MAX_MODEL_LEN - 2, why=cli_args.LEN_WHY)
    tokens = dict(hi=MAX_NUM_BATCHED_TOKENS, why="MAX_NUM_BATCHED_TOKENS")
    p.add_argument("--preset", default="mini-2k")
    p.add_argument("--model-option", action="append", metavar="KEY=VALUE")
    modes = list(decode_bench.DECODE_MODES)
    p.add_argument("--modes", type=cli_args.names(modes), default=modes)
    p.add_argument("--context", type=length, default=[1024, 8192],
                   help="cached tokens per request at the decode points")
    p.add_argument("--conc", type=cli_args.int_list(1, MAX_NUM_SEQS, why="MAX_NUM_SEQS"), default=[1, 8, 64],
                   help="requests per decode step")
    p.add_argument("--mixed", type=cli_args.int_list(2, **tokens), default=[512], help="tokens of the mixed steps")
    p.add_argument("--prefill-isl", type=length, default=[1024, 4096, 8192])
    p.add_argument("--steps", type=cli_args.int_arg(1), default=30, help="timed steps per point")
    p.add_argument("--runs", type=cli_args.int_arg(1), default=5, help="timed prompts per prefill point")
    p.add_argument("--warmup", type=cli_args.int_arg(1), default=3)
    p.add_argument("--max-num-batched-tokens", type=cli_args.int_arg(1, **tokens), default=8192)
    p.add_argument("--out", help="write the JSON report here")
    p.add_argument("--profile-out", help="append a profile of one decode step per mode at --profile-points here")
    p.add_argument("--host-profile-out", help="append where the host's time goes (cProfile) in --steps synchronised "
                   "decode steps per mode at --profile-points here")
    p.add_argument("--profile-points", type=cli_args.profile_points, default=[],
                   help="CONTEXT/CONC points to profile, e.g. 1024/8")
    p.add_argument("--trace-dir", metavar="DIR", help="keep each profiled step's Chrome trace here (gzipped)")


def cmd_decode_bench(args) -> int:
    """The decode bench (bench/decode.py); its table printed, its report to --out."""
    model_config(args.preset, args.model_option)  # a bad preset or option, before any model is built
    longest, seqs = decode_bench.cache_size(args)
    cli_args.check_layout(longest, seqs, f"--context {max(args.context)} --conc {max(args.conc)} --steps {args.steps} "
                          f"--warmup {args.warmup}{' --host-profile-out' if args.host_profile_out else ''} "
                          f"(caches of {longest} positions per sequence)")
    for flag, tokens in (("--mixed", max(args.mixed)), ("--conc", max(args.conc))):  # a decode step: a token each
        if tokens > args.max_num_batched_tokens:
            raise ValueError(f"{flag} {tokens}: more tokens than --max-num-batched-tokens="
                             f"{args.max_num_batched_tokens} in one step")
    _check_outputs((("--out", args.out), ("--profile-out", args.profile_out),
                    ("--host-profile-out", args.host_profile_out)))
    if args.host_profile_out and not args.profile_points:
        raise ValueError("--host-profile-out profiles the points of --profile-points, and none is given")
    measured = {f"{c}/{n}" for c, n in decode_bench.points(args)}
    unmeasured = [p for p in args.profile_points if p not in measured]
    if unmeasured and (args.profile_out or args.host_profile_out):
        raise ValueError(f"--profile-points {','.join(unmeasured)}: not a point of --context x --conc, so it would "
                         "not be profiled")
    _check_trace_dir(args, "steps", "--profile-out and --profile-points")
    report = decode_bench.run_decode_bench(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    print(render_decode(report))
    return 0 if all(not r["error"] for r in report["results"]) else 1


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


def _check_bench(args) -> None:
    """What the bench's arguments must satisfy, checked before any model is built: the
    preset and model options, every attention implementation, the backend options, the
    caches the runs allocate, the files they write, and the ranks it starts."""
    topo = bench_ranks.topology(args)
    if topo is not None:
        if "reduce-overhead" in args.modes:
            raise ValueError("--modes reduce-overhead: the stock torch.compile peer runs on one process, without "
                             "the ranks' groups; leave it out with --tp/--dp/--enable-expert-parallel")
        if args.compile_only:
            raise ValueError("--compile-only times one process's compile: leave out --tp/--dp/"
                             "--enable-expert-parallel")
        bench_ranks.check_launch(topo)
    cfg = model_config(args.preset, args.model_option)
    for impl in args.attention or []:
        model_config(args.preset, [*args.model_option, f"attention_impl={impl}"])
    for mode in args.modes:
        if mode in bench_modes.MODE_OPTIONS:
            for setting in args.settings:
                config = bench_modes.backend_config(mode, setting, args)
                if config.decoder_replay:  # as the first trace would, after minutes of building
                    config.check_window(cfg.window)
    longest = max(max(args.isl), cfg.window) + 2
    cli_args.check_layout(longest, max(args.conc), f"--isl {max(args.isl)} --conc {max(args.conc)} (caches of "
                  f"max(ISL, W) + 2 = {longest} positions per sequence)")
    _check_outputs((("--json", args.json), ("--out", args.out), ("--profile-out", args.profile_out)))
    _check_trace_dir(args, "points", "--profile-out")


def _check_outputs(outputs) -> None:
    """Each ``(flag, path)`` given can be written, and no two flags name one file: the
    later writer would overwrite or interleave the other's."""
    seen: dict[str, str] = {}
    for flag, path in outputs:
        if not path:
            continue
        cli_args.check_file(path, flag)
        other = seen.setdefault(os.path.realpath(path), flag)
        if other != flag:
            raise ValueError(f"{other} and {flag} name the same file {path!r}: give each its own")


def _check_trace_dir(args, what: str, flags: str) -> None:
    """``--trace-dir`` keeps the profiles' traces: refused without a profile (it would keep
    nothing) and where it cannot be written. ``what`` the command profiles; ``flags`` what
    asks for profiles (``--profile-points`` has a default in bench, none in decode-bench)."""
    if not args.trace_dir:
        return
    if not (args.profile_out and args.profile_points):
        raise ValueError(f"--trace-dir keeps the traces of the profiled {what}: give {flags}")
    cli_args.check_dir(args.trace_dir, "--trace-dir")


def cmd_bench(args) -> int:
    if args.preset is None:
        args.preset = "mini-2k" if torch.cuda.is_available() else "tiny"
    topo = bench_ranks.topology(args)
    if args.modes is None:
        args.modes = [m for m in bench.MODES if topo is None or m != "reduce-overhead"]
    _check_bench(args)
    if args.compile_only:
        print(json.dumps(bench.compile_only(args)))
        return 0
    if topo is not None:
        return bench_ranks.launch(bench_passes, args, topo)
    return bench_passes(args)


def bench_passes(args, ranks=None) -> int:
    """The bench's passes (one per --attention implementation), as one rank of several
    where ``ranks`` is given (only rank 0 writes the report). A pass after one whose
    profiler sessions traced CUDA runs in a process of its own (bench/own_process.py),
    where that slowdown cannot reach it; over several ranks, whose process groups
    stay in their processes, it runs in this one, its modes marked."""
    impls = args.attention or [None]
    lead = ranks is None or ranks.lead
    t0, done = time.perf_counter(), []
    fp32_results: dict = {}  # one set of fp32 copies for the passes of this process
    for impl in impls:
        run = copy.copy(args)
        if impl is not None:
            run.model_option = [*args.model_option, f"attention_impl={impl}"]
        # one budget for every pass
        place = bench.PassPlace.now(args.max_seconds - (time.perf_counter() - t0),
                                    after_profiler=any(rep["profiled"] for rep in done))
        checkpoint = functools.partial(_checkpoint, args, list(done)) if lead else None
        torch._dynamo.reset()  # each implementation traces its own model
        if place.after_profiler and ranks is None:
            bench_modes.release_memory()  # the earlier passes' caches, before the new process builds
            try:
                done.append(own_process.call(bench.run_bench, run, checkpoint, None, None,
                                             replace(place, after_profiler=False)))
            except own_process.OwnProcessFailed as e:  # the passes done still make their report
                print(f"the pass of attention_impl={impl} failed in its own process:\n{e}", file=sys.stderr,
                      flush=True)
                break
        else:
            done.append(bench.run_bench(run, checkpoint=checkpoint, fp32_results=fp32_results, ranks=ranks,
                                        place=place))
        if lead:  # each entry once, here: a peer or a pass run apart returns its entries
            for entry in done[-1]["results"]:
                print(json.dumps(entry), flush=True)
    if lead:
        print(_write_report(args, done))
    failed = len(done) < len(impls)
    return 0 if not failed and all(not r["error"] and not r.get("drifted")
                                   for rep in done for r in rep["results"]) else 1


def _checkpoint(args, done: list[dict], partial: dict) -> None:
    """The report so far, the passes ``done`` and this one's ``partial`` report: a run
    stopped by an outer time limit still leaves what it measured."""
    _write_report(args, [*done, partial])
