"""How long the host takes to launch one CUDA graph of N kernels, and how long an idle
GPU waits for that launch before its first kernel: what a FULL step adds to a
synchronised step over its queued time, whatever the model.

A FULL decode step of the reference model is one graph of about 2,000 kernels, and
under the profiler its first kernel started when ``cudaGraphLaunch`` returned. For each
N of --nodes this builds a graph of N small kernels (an in-place add on --width
elements, a few microseconds each, like a decode step's), and for each K of --chunks
the same N kernels as K graphs launched back to back. Medians over --reps of:

* ``launch_us``: the host's time in the K ``replay()`` calls;
* ``exec_us``: GPU time of the kernels, launched while the GPU is still busy with
  earlier work (the launch fully hidden): events around the replays;
* ``idle_us``: the same events from an idle GPU (synchronised first), so the launch
  happens while the GPU waits: ``idle_us - exec_us`` is the GPU's wait for the launch.

If the wait grows with N like ``launch_us`` does, a FULL step's synchronised time pays
its whole launch on top of its kernels; if K chunks cut the wait to about a K-th, a
FULL step in a few graphs would start its GPU work that much sooner.

    python3 scripts/graph_launch_probe.py [--nodes 250,500,1000,2000,4000] [--chunks 1,4,16]
        [--width 4096] [--reps 30] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def positive_int(text: str) -> int:
    """An argparse type: one positive integer (tracing_probe.py's too)."""
    if not text.isdecimal() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=_ints, default=[250, 500, 1000, 2000, 4000], help="kernels per step")
    ap.add_argument("--chunks", type=_ints, default=[1, 4, 16], help="graphs the kernels are split into")
    ap.add_argument("--width", type=positive_int, default=4096, help="elements each kernel adds to")
    ap.add_argument("--reps", type=positive_int, default=30)
    ap.add_argument("--json", default=None, help="write the rows here too")
    args = ap.parse_args(argv)
    for n in args.nodes:
        bad = [k for k in args.chunks if k > n]
        if bad:
            ap.error(f"--chunks {bad[0]} exceeds --nodes {n}: a graph needs a kernel")
    return args


def capture(n: int, k: int, x: torch.Tensor) -> list[torch.cuda.CUDAGraph]:
    """``n`` in-place adds on ``x`` as ``k`` graphs of (nearly) equal length."""
    graphs = []
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        x.add_(1.0)  # anything lazily set up, outside the captures
    torch.cuda.current_stream().wait_stream(stream)
    for i in range(k):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(n * (i + 1) // k - n * i // k):
                x.add_(1.0)
        graphs.append(g)
    for g in graphs:  # the first launch uploads the graph
        g.replay()
    torch.cuda.synchronize()
    return graphs


def time_graphs(graphs: list, busy, reps: int) -> dict:
    """Medians in us of the host's launch, the GPU's time behind busy work, and from idle."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    launch, exec_, idle, covered = [], [], [], 0
    for _ in range(reps):
        torch.cuda.synchronize()
        busy()  # the GPU is meant to be still on this when the launches below are done
        start.record()
        t0 = time.perf_counter()
        for g in graphs:
            g.replay()
        launch.append((time.perf_counter() - t0) * 1e6)
        end.record()
        covered += not start.query()  # the GPU had not reached the replays yet: no wait in exec
        end.synchronize()
        exec_.append(start.elapsed_time(end) * 1e3)
        torch.cuda.synchronize()
        start.record()  # an idle GPU reaches this at once, then waits for the launches
        for g in graphs:
            g.replay()
        end.record()
        end.synchronize()
        idle.append(start.elapsed_time(end) * 1e3)
    med = statistics.median
    return {"launch_us": med(launch), "exec_us": med(exec_), "idle_us": med(idle),
            "wait_us": med(i - e for i, e in zip(idle, exec_)), "covered_reps": covered}


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("graph_launch_probe.py: needs CUDA (it times CUDA graph launches)", file=sys.stderr)
        return 2
    x = torch.zeros(args.width, device="cuda")
    big = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

    def busy():  # work the GPU is still on when the launches are done (checked below)
        for _ in range(max(1, max(args.nodes) // 50)):
            big @ big

    busy()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    busy()
    end.record()
    end.synchronize()
    busy_us = start.elapsed_time(end) * 1e3
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}; "
          f"busy work {busy_us:.0f} us")
    print("| kernels | graphs | launch us | exec us | idle us | GPU wait us |\n|---|---|---|---|---|---|")
    rows = []
    for n in args.nodes:
        for k in args.chunks:
            graphs = capture(n, k, x)
            row = {"nodes": n, "graphs": k, **time_graphs(graphs, busy, args.reps)}
            rows.append(row)
            # exec_us holds no wait only in reps whose busy work outlasted the launches
            uncovered = args.reps - row["covered_reps"]
            note = f" ({uncovered} reps uncovered)" if uncovered else ""
            print(f"| {n} | {k} | {row['launch_us']:.0f} | {row['exec_us']:.0f}{note} | {row['idle_us']:.0f} "
                  f"| {row['wait_us']:.0f} |", flush=True)
            del graphs
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "busy_us": busy_us,
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
