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
the medians (taken before it) as times. Between the two, the median wall time per step
inside each of a few named functions (:data:`COMPONENTS`: the batch build and plan,
graph pieces, the trim op and its region, the attention op and its parts), with its
calls per step: timed by a clock read around each call only, so these are times, each
including the components called inside it. No floors: step_phases.py takes them. On a
CPU it runs as a dry run.

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

from replay_backend.bench.watch import host_probe  # noqa: E402
from replay_backend.capture.graphs import PieceRunner  # noqa: E402
from replay_backend.dispatch.trim_op import ReplayRuntime  # noqa: E402
from replay_backend.reference import (attention_flashinfer, attention_ops, attention_triton,  # noqa: E402
                                      cache_triton, flashinfer_compat, flashinfer_run, flashinfer_staging)
from replay_backend.reference.runner import StepRunner  # noqa: E402

# (owner, attribute, label): the functions whose wall time a step spends inside, found
# on their owner at each call (a class's method, a module's function called through it).
COMPONENTS = (
    (StepRunner, "build_batch", "build"),
    (StepRunner, "plan_batch", "plan"),
    (PieceRunner, "forward", "graph piece"),
    (ReplayRuntime, "__call__", "trim op"),
    (ReplayRuntime, "run_region", "trim op's region"),
    (attention_ops, "_run_attention", "attention op"),
    (cache_triton, "write", "cache write"),
    (attention_triton, "attend", "Triton attend"),
    (flashinfer_run, "attend", "FlashInfer attend"),
    (flashinfer_run, "_run", "FlashInfer part"),
    (flashinfer_compat.DirectCalls, "__call__", "FlashInfer call"),
    (flashinfer_run, "merge", "state merge"),
    (attention_flashinfer.FlashInferAttention, "_prepare", "FlashInfer planning"),
    (flashinfer_staging.Wrapper, "plan", "FlashInfer plan()"),
)


class Components:
    """While entered, the wall time and calls inside each of :data:`COMPONENTS`, summed
    until :meth:`take`."""

    def __init__(self) -> None:
        self.sums: dict = {}
        self._saved: list = []

    def __enter__(self) -> "Components":
        try:
            for owner, name, label in COMPONENTS:
                original = owner.__dict__[name]  # a function: a class's method or a module's
                self._saved.append((owner, name, original))
                setattr(owner, name, self._timed(original, label))
        except BaseException:
            self.__exit__()  # nothing left wrapped by a table that names a missing function
            raise
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()

    def _timed(self, fn, label: str):
        sums, clock = self.sums, time.perf_counter

        def timed(*args, **kw):
            t0 = clock()
            try:
                return fn(*args, **kw)
            finally:
                entry = sums.setdefault(label, [0.0, 0])
                entry[0] += clock() - t0
                entry[1] += 1
        return timed

    def take(self) -> dict:
        """``label -> (seconds, calls)`` since the last take."""
        got = {label: tuple(v) for label, v in self.sums.items()}
        self.sums.clear()  # in place: the timed functions hold this dict
        return got


def _medians(ph: Phases, runs: int) -> dict:
    samples: dict = {}
    for k in range(runs + WARMUP):
        got = ph.all(f"{ph.conc}-{k}")
        if k >= WARMUP:
            add_samples(samples, got)
    return {key: round(statistics.median(v), 3) for key, v in samples.items()}


def _components(ph: Phases, runs: int) -> str:
    """Per component, the median ms per step inside it and its calls per step."""
    ms: dict = {}
    with Components() as comp:
        for k in range(runs + WARMUP):
            ph.full(f"cm{ph.conc}-{k}")
            got = comp.take()
            if k >= WARMUP:
                for label, (s, n) in got.items():
                    ms.setdefault(label, []).append((s * 1e3, n))
    return ", ".join(f"{label} {statistics.median(t for t, _ in v):.3f} ms / {statistics.median(n for _, n in v):g}"
                     for label, v in ms.items())


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
            print(f"{impl} {args.isl}/{conc} inside (ms per step / calls): {_components(ph, args.runs)}", flush=True)
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
