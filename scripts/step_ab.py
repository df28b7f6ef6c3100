"""Host-path variants compared in one process, on one captured runner.

Two runs of the bench on two machines of one kind differ by more than most host-path
changes gain (docs/benchmarks.md), and two processes on one machine by a slower host
phase. This script builds and captures one ``replay`` runner (step_phases.py) and times
its steps under each variant in turns, the order reversed every other round, so a slow
phase of the host falls on every variant alike; then each variant's kernel-time floor.

A variant is ``NAME`` (the code as it is) or ``NAME=FILE``: a Python file defining
``apply(runner)``, which changes what it compares (a module's function, an attribute
of the runner's attention) and returns a callable that undoes the change.

    python3 scripts/step_ab.py --attention flashinfer --points 1024/1,8192/1 \
        --variant now --variant other=scratch/other.py

Per point and variant: the median step in ms as the bench times it, its quartiles,
the floor and their ratio, and when ``run()`` returned in a step whose batch was built
untimed (a step whose host returns near its end was host-bound). On a CPU it runs as a dry run (fp32, eager pieces, no floor).
"""
from __future__ import annotations

import argparse
import json
import runpy
import statistics
import time
from dataclasses import dataclass
from typing import Callable

from replay_backend.bench.watch import host_probe
from replay_backend.bench.cuda_tracing import CudaTracing
from step_phases import WARMUP, Phases, add_samples, build_runner, floor_ms, floor_step


@dataclass(frozen=True)
class Variant:
    name: str
    apply: Callable | None  # apply(runner) -> undo; None: the code as it is

    @staticmethod
    def parse(spec: str) -> "Variant":
        name, _, path = spec.partition("=")
        if not path:
            return Variant(name, None)
        found = runpy.run_path(path).get("apply")
        if not callable(found):
            raise SystemExit(f"variant {name}: {path} defines no apply(runner)")
        return Variant(name, found)

    def __call__(self, runner) -> Callable[[], None]:
        if self.apply is None:
            return lambda: None
        undo = self.apply(runner)
        if not callable(undo):  # the change is made and cannot be taken back: stop here
            raise SystemExit(f"variant {self.name}: apply(runner) returned {undo!r}, not a callable that undoes it")
        return undo


def _points(text: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in p.split("/")) for p in text.split(",")]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--attention", default="flashinfer")
    p.add_argument("--preset", default="mini-2k")
    p.add_argument("--points", type=_points, default=_points("1024/1"), help="ISL/concurrency, comma-separated")
    p.add_argument("--variant", action="append", required=True, help="NAME or NAME=FILE (see above)")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--per", type=int, default=2, help="steps per point, variant and round")
    p.add_argument("--max-seconds", type=float, default=120, help="stop the rounds after this long")
    p.add_argument("--json", help="write every sample (ms) and floor here")
    args = p.parse_args()
    variants = [Variant.parse(v) for v in args.variant]
    if len({v.name for v in variants}) != len(variants):
        raise SystemExit("variant names must differ")
    # build_runner sizes the runner for the largest point
    args.isl = max(i for i, _ in args.points)
    args.conc = max(c for _, c in args.points)
    args.max_tokens = max(i * c for i, c in args.points)
    print(f"host at start: {host_probe()}", flush=True)
    t0 = time.perf_counter()
    runner = build_runner(args.attention, args)
    print(f"runner built and captured in {time.perf_counter() - t0:.1f} s", flush=True)
    phases = Phases(runner, args.isl, 1)

    def under(v: Variant, fn):
        undo = v(runner)
        try:
            return fn()
        finally:
            undo()

    def one_point(isl: int, conc: int, tag: str) -> dict:
        phases.isl, phases.conc = isl, conc
        return {**phases.full(f"f{tag}"), **phases.prebuilt(f"b{tag}", False)}

    samples: dict = {}
    start = time.perf_counter()
    for k in range(args.rounds + WARMUP):
        order = variants if k % 2 == 0 else variants[::-1]
        for v in order:
            def round_of(v=v):
                return [(pt, one_point(*pt, f"{k}{v.name}{pt}{j}")) for pt in args.points for j in range(args.per)]
            for (isl, conc), got in under(v, round_of):
                if k >= WARMUP:
                    add_samples(samples.setdefault(f"{v.name} {isl}/{conc}", {}),
                                {key: got[key] for key in ("full", "ret")})
        if time.perf_counter() - start > args.max_seconds:
            print(f"stopped after round {k + 1} of {args.rounds + WARMUP}", flush=True)
            break
    print(f"host at end: {host_probe()}", flush=True)
    tracing = CudaTracing()
    floors: dict = {}
    for v in variants:
        for isl, conc in args.points:
            key = f"{v.name} {isl}/{conc}"
            floors[key] = under(v, lambda: floor_ms(lambda: floor_step(phases, isl, conc), tracing, key))
    print("| point | variant | median ms | q1 / q3 | n | floor ms | / floor | run() returned at |")
    print("|---|---|---|---|---|---|---|---|")
    for isl, conc in args.points:
        for v in variants:
            key = f"{v.name} {isl}/{conc}"
            s = samples.get(key, {}).get("full", [])
            if len(s) < 2:
                continue
            q = statistics.quantiles(s, n=4, method="inclusive")
            med, floor = statistics.median(s), floors.get(key)
            ratio = f"{med / floor:.3f}" if floor else "-"
            print(f"| {isl}/{conc} | {v.name} | {med:.3f} | {q[0]:.3f} / {q[2]:.3f} | {len(s)} | "
                  f"{floor if floor is None else round(floor, 3)} | {ratio} | "
                  f"{statistics.median(samples[key]['ret']):.3f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"samples": samples, "floors": floors}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
