"""What one CUDA graph launch costs the host (GPU), by the graph's size and by what
the GPU is doing when the host launches it.

usage: python3 scripts/graph_launch_probe.py [--calls 200] [--nodes 1,4,16,64] [--rotation 1,10,100,1000]
       [--depth 3000]

For graphs of N tiny kernels, for one tiny kernel launched directly, and for the trim
op's stage (a small device-to-device copy, by ``copy_`` or by an elementwise kernel), host
time per launch (median of ``--calls``) in three states of the device:
  idle   the device has nothing queued (synchronised before each launch);
  busy   one long kernel runs (a ~2 ms spin), nothing else is queued;
  queued the spin and 2,000 tiny kernels are queued ahead of the launch.
A launch that costs more when the device is busy waits for the device inside the
launch: time the trim op spends so is not work of its own. Then graphs launched in
turn, M different ones, as a step launches its pieces' graphs. Last, the depth of the
launch queue: behind one long kernel, how many launches the host can queue before a
launch blocks until the device retires work (``--depth``).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

SPIN_CYCLES = 4_000_000  # about 2 ms at the H200's clock


def graph_of(nodes: int, x: torch.Tensor) -> torch.cuda.CUDAGraph:
    g = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        x.add_(1)  # warm-up outside the capture
        g.capture_begin()
        for _ in range(nodes):
            x.add_(1)
        g.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    g.replay()  # the first launch uploads the graph
    torch.cuda.synchronize()
    return g


def host_us(launch, state: str, calls: int, x: torch.Tensor) -> float:
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        if state != "idle":
            torch.cuda._sleep(SPIN_CYCLES)
        if state == "queued":
            for _ in range(2000):
                x.add_(1)
        t0 = time.perf_counter()
        launch()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--nodes", default="1,4,16,64")
    ap.add_argument("--rotation", default="1,10,100,1000", help="numbers of graphs launched in turn")
    ap.add_argument("--depth", type=int, default=3000, help="launches queued behind a long kernel")
    args = ap.parse_args()
    args.rotation = [int(v) for v in args.rotation.split(",")]
    x = torch.zeros(4, device="cuda")
    y = torch.zeros(4, device="cuda")
    launches = {"kernel (no graph)": lambda: y.add_(1)}
    # The trim op's stage: 129 int64 (a count and 128 rows) from the step's metadata
    # into the gather graph's fixed index buffer, by the driver's copy or by a kernel.
    meta = torch.zeros(4096, dtype=torch.int64, device="cuda")
    src, dst = meta[64:193], torch.zeros(4097, dtype=torch.int64, device="cuda")[:129]
    launches["stage: copy_ (memcpy)"] = lambda: dst.copy_(src)
    launches["stage: mul(out=)"] = lambda: torch.mul(src, 1, out=dst)
    launches["stage: add(out=)"] = lambda: torch.add(src, 0, out=dst)
    for n in (int(v) for v in args.nodes.split(",")):
        launches[f"graph of {n} kernels"] = graph_of(n, y).replay
    states = ("idle", "busy", "queued")
    print(f"host us per launch, median of {args.calls} ({torch.cuda.get_device_name()}, torch {torch.__version__})")
    print(f"{'launch':<22}" + "".join(f"{s:>10}" for s in states))
    for name, launch in launches.items():
        print(f"{name:<22}" + "".join(f"{host_us(launch, s, args.calls, x):10.1f}" for s in states))
    # A step launches many different graphs, each once: does a launch cost more when
    # other graphs were launched since this one last ran?
    print("\nidle device, graphs of 16 kernels launched in turn (host us per launch, median)")
    pool = [graph_of(16, y) for _ in range(max(args.rotation))]
    for m in args.rotation:
        times = []
        for k in range(max(args.calls, 3 * m)):
            if k % m == 0:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            pool[k % m].replay()
            times.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
        print(f"  {m:>5} graphs in turn: {statistics.median(times):.1f}")
    # A launch blocks when the queue between host and device is full: then its host time
    # is the device's, however little the launch itself costs.
    print(f"\nlaunch queue depth: {args.depth} launches behind a ~50 ms spin")
    for name, launch in [("tiny kernels", lambda: y.add_(1)), ("graphs of 1 kernel", graph_of(1, y).replay),
                         ("graphs of 64 kernels", graph_of(64, y).replay)]:
        print(f"  {name}: {queue_depth(launch, args.depth)}")


def queue_depth(launch, n: int) -> str:
    """Host time of each of ``n`` launches queued behind a ~50 ms spin: where they start
    to block (waiting for the device to retire work) and for how long."""
    torch.cuda.synchronize()
    torch.cuda._sleep(25 * SPIN_CYCLES)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        launch()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    slow = [i for i, t in enumerate(times) if t > 500]
    if not slow:
        return f"no launch of {n} blocked (max {max(times):.0f} us)"
    return (f"launch {slow[0]} is the first to block ({times[slow[0]]:.0f} us; the {slow[0]} before it "
            f"median {statistics.median(times[:slow[0]] or [0]):.1f} us); {len(slow)} of {n} blocked")


if __name__ == "__main__":
    main()
