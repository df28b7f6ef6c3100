"""Where a graphed prefill step's host time goes, by Python function, per attention
implementation.

One implementation at a time (its runner built and captured, measured, then let go):
a ``replay`` runner of --preset at the bench's wide capture sizes up to --max-tokens,
and for each --conc the medians of step_phases.py's timed variants of one step of
--isl x conc prompt tokens (``full``, ``prebuilt``, ``preplanned``, ``build``, ``plan``,
``to_launch``, ``ret``, ``ret_pp``; see there), then Python's cProfile of
--profile-steps steps' host work (the runner's ``prefill``, the synchronisation after
it left out), written to ``DIR/cprof_<impl>_<conc>.txt`` sorted by own time and by
cumulative time. cProfile slows every Python call, so read its figures as shares, and
the medians (taken before it) as times. No floors: step_phases.py takes them. On a CPU
it runs as a dry run.

    python3 scripts/host_profile.py --attention flashinfer,triton --isl 1024 --conc 1,8 --out DIR
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_phases import WARMUP, Phases, add_samples, build_runner, sync  # noqa: E402

from replay_backend.bench.timing import host_probe  # noqa: E402


def _medians(ph: Phases, runs: int) -> dict:
    samples: dict = {}
    for k in range(runs + WARMUP):
        got = ph.all(f"{ph.conc}-{k}")
        if k >= WARMUP:
            add_samples(samples, got)
    return {key: round(statistics.median(v), 3) for key, v in samples.items()}


def _cprofile(ph: Phases, steps: int) -> str:
    prof, runner = cProfile.Profile(), ph.runner
    for k in range(steps):
        ids = [f"cp{ph.conc}-{k}-{j}" for j in range(ph.conc)]
        sync()
        prof.enable()
        runner.prefill({rid: ph.isl for rid in ids})
        prof.disable()
        sync()
        for rid in ids:
            runner.free(rid)
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumulative").print_stats(60)
    return text.getvalue()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--attention", type=lambda s: s.split(","), default=["flashinfer", "triton"])
    p.add_argument("--preset", default="mini-2k")
    p.add_argument("--isl", type=int, default=1024)
    p.add_argument("--conc", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--out", required=True, help="folder for the cProfile listings")
    args = p.parse_args()
    if args.isl * max(args.conc) > args.max_tokens:
        p.error(f"--isl {args.isl} x --conc {max(args.conc)} is over --max-tokens {args.max_tokens}: "
                "the step would be chunked")
    os.makedirs(args.out, exist_ok=True)
    print(f"host at the start: {host_probe()}", flush=True)
    for impl in args.attention:
        t0 = time.perf_counter()
        ph = Phases(build_runner(impl, argparse.Namespace(preset=args.preset, max_tokens=args.max_tokens,
                                                          isl=args.isl, conc=max(args.conc))),
                    args.isl, args.conc[0])
        print(f"{impl}: runner built and captured in {time.perf_counter() - t0:.1f} s", flush=True)
        for conc in args.conc:
            ph.conc = conc
            print(f"{impl} {args.isl}/{conc}: {_medians(ph, args.runs)}", flush=True)
            with open(os.path.join(args.out, f"cprof_{impl}_{conc}.txt"), "w") as f:
                f.write(_cprofile(ph, args.profile_steps))
        del ph
        torch._dynamo.reset()  # Dynamo's caches hold the compiled model, and so its graphs
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print(f"host at the end: {host_probe()}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
