"""Whether a process's host launches get their speed back after a profiler session.

A profiler session attaches CUDA tracing, which slows the host's CUDA launches; this
shows whether they recover once the session has ended, torn down or not (they did
not, on an H100: so the benchmarks take every floor after their last timed step).
Each scenario of --scenarios runs in a fresh process and prints the host's time to
launch a CUDA graph of --nodes small kernels and one eager kernel, from an idle GPU,
before any profiler session and after each of its phases:

* ``attached``: a session of the bench's ``CudaTracing``, its tracing left attached;
* ``plain``: a plain ``torch.profiler.profile`` session, torn down at its end (Kineto's
  own way), and again half a second later.

    python3 scripts/tracing_probe.py [--nodes 2000] [--reps 30] [--scenarios attached,plain] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from graph_launch_probe import capture, positive_int  # noqa: E402

SCENARIOS = ("attached", "plain")


def launch_us(graph, x: torch.Tensor, reps: int) -> dict:
    """Medians in us of the host's time in one ``replay()`` and one eager add, each
    from a synchronised, idle GPU."""
    graph_us, eager_us = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        graph_us.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        x.add_(1.0)
        eager_us.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return {"graph_launch_us": statistics.median(graph_us), "eager_launch_us": statistics.median(eager_us)}


def run_scenario(name: str, nodes: int, reps: int) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    from replay_backend.bench.cuda_tracing import CudaTracing

    x = torch.zeros(4096, device="cuda")
    (graph,) = capture(nodes, 1, x)
    phases = [{"phase": "before any session", **launch_us(graph, x, reps)}]
    if name == "attached":
        with CudaTracing().session([ProfilerActivity.CUDA]):
            graph.replay()
            torch.cuda.synchronize()
        phases.append({"phase": "after a CudaTracing session", **launch_us(graph, x, reps)})
    else:
        with profile(activities=[ProfilerActivity.CUDA]):
            graph.replay()
            torch.cuda.synchronize()
        phases.append({"phase": "after a plain session", **launch_us(graph, x, reps)})
        time.sleep(0.5)
        phases.append({"phase": "0.5 s later", **launch_us(graph, x, reps)})
    return phases


def _scenarios(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"no scenario named in {text!r} (the scenarios: {', '.join(SCENARIOS)})")
    bad = [n for n in names if n not in SCENARIOS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown {', '.join(map(repr, bad))} (the scenarios: {', '.join(SCENARIOS)})")
    return names


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=positive_int, default=2000)
    ap.add_argument("--reps", type=positive_int, default=30)
    ap.add_argument("--scenarios", type=_scenarios, default=list(SCENARIOS))
    ap.add_argument("--json", default=None)
    ap.add_argument("--one", choices=SCENARIOS, help=argparse.SUPPRESS)  # a child's scenario
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("tracing_probe.py: needs CUDA", file=sys.stderr)
        return 2
    if args.one:
        print(json.dumps(run_scenario(args.one, args.nodes, args.reps)))
        return 0
    rows = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; a graph of {args.nodes} kernels")
    print("| scenario | phase | graph launch us | eager launch us |\n|---|---|---|---|")
    for name in args.scenarios:
        child = subprocess.run([sys.executable, __file__, "--one", name, "--nodes", str(args.nodes),
                                "--reps", str(args.reps)], capture_output=True, text=True)
        if child.returncode:
            print(f"| {name} | failed: {child.stderr.strip().splitlines()[-1:]} | | |", flush=True)
            continue
        for p in json.loads(child.stdout.strip().splitlines()[-1]):
            rows.append({"scenario": name, **p})
            print(f"| {name} | {p['phase']} | {p['graph_launch_us']:.0f} | {p['eager_launch_us']:.1f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
