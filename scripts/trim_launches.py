"""Where the trim op's time goes inside real steps (GPU; trim_probe.py runs this after
its own figures): does the op wait for the device, and at which launch?

* the op with the device busy through the whole step, and with it idle at the op's entry;
* the op's two graphs launched alone, in the device states of graph_launch_probe.py;
* one step's graphs (main, gather, region, scatter) launched back to back in the step's
  order, with nothing, a tiny kernel or some Python between launches;
* every graph launch of real steps timed where the step makes it, with the prompts back
  to back and with each waited for; then again with the device synchronised (untimed)
  before each: the launch alone, whether the device was still busy, and the op's time
  without those waits;
* the same with K tiny kernels queued at the op's entry: a launch queue that fills up
  makes the region's launches block instead (graph_launch_probe.py measures its depth);
* the scatter as one row-moves launch instead of its graph, at the same place;
* the launches a step queues, and the CUDA runtime calls of five steps, as the profiler
  sees them.
"""
from __future__ import annotations

import statistics
import time
from contextlib import contextmanager

import torch
from graph_launch_probe import SPIN_CYCLES, host_us

from replay_backend.batch import RequestChunk
from replay_backend.forward_context import get_forward_context
from replay_backend.capture import graphs
from replay_backend.dispatch import trim_io


@contextmanager
def patched(owner, name: str, value):
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


def _kind(graph) -> str:
    """main, replay, trim-gather or trim-scatter, from a StaticGraph's name."""
    return graph.name.split(":")[0].split("[")[0]


def timed_replay(launches: dict[str, list[float]]):
    """``StaticGraph.replay`` that adds each launch's host time (us) to ``launches`` by kind."""
    replay = graphs.StaticGraph.replay

    def timed(self, args):
        t0 = time.perf_counter()
        try:
            return replay(self, args)
        finally:
            launches.setdefault(_kind(self), []).append((time.perf_counter() - t0) * 1e6)
    return timed


def op_and_device(rep, prompts, steps: int) -> None:
    rep.host_us.clear()
    prompts("b", steps, spin=20 * SPIN_CYCLES)  # each prompt waited for: the spin covers one step
    busy = statistics.median(rep.host_us)
    call = type(rep).__call__

    def idle_entry(self, *a):  # the synchronisation is outside the op's own timer
        torch.cuda.synchronize()
        return call(self, *a)
    rep.host_us.clear()
    with patched(type(rep), "__call__", idle_entry):
        prompts("i", steps)
    print(f"trim op host us, median: device busy through the step (a ~40 ms spin queued first) {busy:.1f}, "
          f"device idle at the op's entry (synchronised just before it) {statistics.median(rep.host_us):.1f}")


def graphs_alone(pair, gather_scatter, x) -> None:
    for name, graph in zip(("gather", "scatter"), gather_scatter):
        print(f"  {name} graph {pair} alone, host us per launch idle / busy / queued: " + " / ".join(
            f"{host_us(graph.graph.replay, state, 100, x):.1f}" for state in ("idle", "busy", "queued")))


def step_order(order, gather_scatter, x) -> None:
    at = {id(g): i for i, g in enumerate(order)}

    def python_work():  # about the Python a step runs between two launches
        sum(range(3000))
    between = {"nothing": None, "a tiny kernel": lambda: x.add_(1), "Python work": python_work}
    for state, gap in [("idle", "nothing"), ("busy", "nothing"), ("idle", "a tiny kernel"),
                       ("busy", "a tiny kernel"), ("idle", "Python work")]:
        per: dict[int, list[float]] = {}
        for _ in range(50):
            torch.cuda.synchronize()
            if state == "busy":
                torch.cuda._sleep(20 * SPIN_CYCLES)
            for i, g in enumerate(order):
                if between[gap] is not None:
                    between[gap]()
                t0 = time.perf_counter()
                g.graph.replay()
                per.setdefault(i, []).append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
        med = [statistics.median(per[i]) for i in range(len(order))]
        print(f"  one step's {len(order)} graphs in its order, device {state} at the start, {gap} between "
              f"launches, host us per launch: median of all {statistics.median(med):.1f}, max {max(med):.1f}; "
              f"gather {med[at[id(gather_scatter[0])]]:.1f}, scatter {med[at[id(gather_scatter[1])]]:.1f}")


def real_launches(rep, prompts, steps: int) -> None:
    launches: dict[str, list[float]] = {}
    timed = timed_replay(launches)
    for sync in (False, True):  # prompts back to back, then each waited for (as the bench's runs)
        launches.clear()
        rep.host_us.clear()
        with patched(graphs.StaticGraph, "replay", timed):
            prompts("s", steps, sync=sync)
        print(f"  graph launches in real steps, {'each prompt waited for' if sync else 'prompts back to back'}: "
              f"op {statistics.median(rep.host_us):.1f} us; launches host us median / max: " + ", ".join(
                  f"{k} {statistics.median(v):.1f} / {max(v):.0f} ({len(v) // steps}/step)" for k, v in launches.items()))
    busy: dict[str, list[bool]] = {}
    waits: dict[str, list[float]] = {}

    def settled(self, args):
        busy.setdefault(_kind(self), []).append(not torch.cuda.current_stream().query())
        t0 = time.perf_counter()
        torch.cuda.synchronize()
        waits.setdefault(_kind(self), []).append((time.perf_counter() - t0) * 1e6)
        return timed(self, args)
    launches.clear()
    rep.host_us.clear()
    with patched(graphs.StaticGraph, "replay", settled):
        prompts("q", steps)
    print("  the same, synchronised before each launch: " + ", ".join(
        f"{k} launch {statistics.median(v):.1f} us, device busy at {100 * sum(busy[k]) / len(busy[k]):.0f}% "
        f"of them, sync median {statistics.median(waits[k]):.0f} us" for k, v in launches.items()))
    # The op's timer holds its two synchronisations; without them, what the op itself takes.
    own = [op - g - s for op, g, s in zip(rep.host_us, waits["trim-gather"], waits["trim-scatter"])]
    print(f"  trim op host us without the waits for the device (its two synchronisations taken out): "
          f"median {statistics.median(own):.1f}")


def extra_launches(rep, prompts, steps: int, x: torch.Tensor) -> None:
    """Real steps with ``k`` tiny kernels launched just before the op (outside its timer):
    if launches block because the queue to the device is full, the extra entries make it
    fill earlier, and the blocking moves from the scatter into the region's launches."""
    call = type(rep).__call__
    for k in (100, 300, 1000):
        launches: dict[str, list[float]] = {}

        def crowded(self, *a):
            for _ in range(k):
                x.add_(1)
            return call(self, *a)
        rep.host_us.clear()
        with patched(graphs.StaticGraph, "replay", timed_replay(launches)), patched(type(rep), "__call__", crowded):
            prompts(f"k{k}-", steps, sync=False)
        print(f"  {k} tiny kernels queued at the op's entry: op {statistics.median(rep.host_us):.1f} us; launches "
              "median / max: " + ", ".join(f"{n} {statistics.median(v):.1f} / {max(v):.0f}" for n, v in launches.items()))


def eager_scatter(runner, rep, prompts, steps: int, isl: int) -> None:
    took: list[float] = []

    def run(self, size, rows_size, rows, bufs, region, outs):
        gather, _ = self.graphs[(size, rows_size)]
        gather.replay((*rows, *bufs, *self.tails(size, rows_size)[0]))
        res = region()
        t0 = time.perf_counter()
        rep.moves.scatter(res, outs, get_forward_context().batch.replay.rows_t)
        took.append((time.perf_counter() - t0) * 1e6)
    rep.host_us.clear()
    with patched(rep, "_served_pad", []), patched(trim_io.TrimIO, "run", run):  # the general path runs TrimIO.run
        prompts("e", steps)
        op = statistics.median(rep.host_us)
        batch = runner.build_batch([RequestChunk("e-last", isl, isl)])
        got = runner.run(batch).logits
        plain = runner.run(batch, use_graphs=False).logits
        runner.free("e-last")
    print(f"  graphed path, scatter by one row-moves launch: trim op host us median {op:.1f}, the scatter "
          f"{statistics.median(took):.1f}; logits vs no graphs max|d| {(got - plain).abs().max().item():.3g}")


def runtime_calls(prompts) -> None:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        prompts("t", 5)
        torch.cuda.synchronize()
    calls = [e for e in prof.key_averages() if e.key.startswith("cu")]
    # Every launch and copy takes a slot of the queue to the device (about 1,020 deep:
    # graph_launch_probe.py); a step that queues more than that makes the host wait.
    queued = sum(e.count for e in calls if "Launch" in e.key or "Memcpy" in e.key or "Memset" in e.key)
    print(f"  launches and copies queued per step: {queued / 5:.0f}")
    print("  CUDA runtime calls in 5 steps, from the profiler: " + "; ".join(
        f"{e.key} {e.count}x avg {e.cpu_time_total / e.count:.1f} us"
        for e in sorted(calls, key=lambda e: -e.cpu_time_total)[:8]))


def study(runner, rep, prompts, last, steps: int) -> None:
    """Everything above for the trimming steps of ``prompts`` (trim_probe.py's)."""
    op_and_device(rep, prompts, steps)
    pair = (last.step.padded_tokens, last.trim.padded)
    if rep.io is None or pair not in rep.io.graphs:
        return  # the path without main graphs: no trim I/O graphs to look at
    x = torch.zeros(4, device="cuda")
    gather_scatter = rep.io.graphs[pair]
    graphs_alone(pair, gather_scatter, x)
    model = runner.backend.model
    main = [r.graphs[pair[0]] for r in model.runners("main") if pair[0] in r.graphs]
    region = [r.graphs[pair[1]] for r in model.runners("replay") if pair[1] in r.graphs]
    step_order([*main[:len(main) // 2], gather_scatter[0], *region, gather_scatter[1], *main[len(main) // 2:]],
               gather_scatter, x)
    real_launches(rep, prompts, steps)
    extra_launches(rep, prompts, steps, x)
    eager_scatter(runner, rep, prompts, steps, last.batch.num_tokens)
    runtime_calls(prompts)
