"""Where the GPU waits in one profiled step: idle gaps of a Chrome trace, by cause.

A kernel total says how busy the GPU was, not why it was not busier. This reads the
trace that ``torch.profiler`` exports and splits the GPU's idle time inside the
profiled window into the lead (before the first kernel), the tail (after the last)
and the gaps between kernels. A gap whose next kernel was launched after the GPU went
idle is the host's: it is charged to the ops open on the host at that launch (the
innermost op of this project or of a compiled graph, and the innermost aten op).
Other gaps (the launch came first: graph launch latency, stream waits) are counted
apart.

Kernels launched inside the trim op (the replay region) are also summed on their own,
so a profile says whether the region is launch-bound: in a step without replay graphs
its host time and its host-bound gaps dwarf its kernels, with graphs they do not.
"""
from __future__ import annotations

import bisect
import gzip
import json
from collections import defaultdict
from dataclasses import dataclass, field

from ..ops import TRIM

_DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
_HOST_CATS = {"cpu_op", "user_annotation"}
_LAUNCH_CATS = {"cuda_runtime", "cuda_driver"}  # Triton launches through the driver API
MIN_GAP_US = 5.0
REGION_OP = TRIM


@dataclass
class RegionReport:
    """The replay region's share of a profiled window: what the trim op's calls took on
    the host, and the kernels launched inside them on the device."""

    calls: int = 0
    host_us: float = 0.0  # wall time inside the trim op (its own work and the region's)
    kernels: int = 0
    busy_us: float = 0.0  # GPU time of the region's kernels (overlaps counted once)
    span_us: float = 0.0  # per call, first region kernel start to last end, summed
    host_gaps_us: float = 0.0  # host-bound gaps before region kernels
    # kernel name -> [total us, count]: what the region's GPU time is spent on
    by_kernel: dict = field(default_factory=lambda: defaultdict(lambda: [0.0, 0]))

    def render(self, top: int = 12) -> str:
        if not self.calls:
            return "replay region: no trim op in the window"
        lines = [f"replay region ({self.calls} trim op calls): host {self.host_us / 1e3:.2f} ms, "
                 f"{self.kernels} kernels, GPU busy {self.busy_us / 1e3:.2f} ms over a device span of "
                 f"{self.span_us / 1e3:.2f} ms, of it host-bound gaps {self.host_gaps_us / 1e3:.2f} ms"]
        for name, (us, n) in sorted(self.by_kernel.items(), key=lambda kv: -kv[1][0])[:top]:
            lines.append(f"  region kernel {us / 1e3:8.3f} ms {n:5d}  {name[:90]}")
        return "\n".join(lines)


@dataclass
class GapReport:
    window_us: float = 0.0
    busy_us: float = 0.0
    lead_us: float = 0.0
    tail_us: float = 0.0
    host_gaps_us: float = 0.0
    other_gaps_us: float = 0.0
    # label -> [total us, count], host-bound gaps only
    by_op: dict = field(default_factory=lambda: defaultdict(lambda: [0.0, 0]))
    region: RegionReport = field(default_factory=RegionReport)

    @property
    def short_gaps_us(self) -> float:
        """Idle time in gaps under the threshold, which are not classified."""
        idle = self.window_us - self.busy_us
        return max(0.0, idle - self.lead_us - self.tail_us - self.host_gaps_us - self.other_gaps_us)

    def render(self, top: int = 15) -> str:
        lines = [f"window {self.window_us / 1e3:.2f} ms: GPU busy {self.busy_us / 1e3:.2f} ms, idle "
                 f"{(self.window_us - self.busy_us) / 1e3:.2f} ms = lead {self.lead_us / 1e3:.2f} + host-bound "
                 f"gaps {self.host_gaps_us / 1e3:.2f} + other gaps {self.other_gaps_us / 1e3:.2f} + tail "
                 f"{self.tail_us / 1e3:.2f} + short gaps {self.short_gaps_us / 1e3:.2f}",
                 self.region.render(),
                 "host-bound gaps by the ops open at the late launch (ms, gaps):"]
        for label, (us, n) in sorted(self.by_op.items(), key=lambda kv: -kv[1][0])[:top]:
            lines.append(f"  {us / 1e3:8.3f} {n:5d}  {label}")
        return "\n".join(lines)


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def _label(stack: list[dict]) -> str:
    """The innermost op that is not aten's (ours, a compiled graph, Dynamo's region) and
    the innermost aten op below it, from a host stack ordered outermost first."""
    ours = next((e["name"] for e in reversed(stack) if not e["name"].startswith("aten::")), None)
    aten = next((e["name"] for e in reversed(stack) if e["name"].startswith("aten::")), None)
    parts = [p[:70] for p in (ours, aten) if p]
    return " > ".join(parts) if parts else "(no op open)"


def _stacks_at(host: list[dict], queries: list[tuple[float, object]]) -> dict:
    """For each ``(ts, tid)`` query, the host ops of that thread open at ``ts``, outermost
    first. One sweep per thread: ops nest on a thread, so a stack holds the open ones."""
    out: dict = {}
    by_tid: dict = defaultdict(list)
    for e in host:
        by_tid[e["tid"]].append(e)
    for tid, evs in by_tid.items():
        qs = sorted(q for q in queries if q[1] == tid)
        stack: list[dict] = []
        i = 0
        for ts, _ in qs:
            while i < len(evs) and evs[i]["ts"] <= ts:
                while stack and stack[-1]["ts"] + stack[-1].get("dur", 0) < evs[i]["ts"]:
                    stack.pop()
                stack.append(evs[i])
                i += 1
            while stack and stack[-1]["ts"] + stack[-1].get("dur", 0) < ts:
                stack.pop()
            out[(ts, tid)] = [e for e in stack if e["ts"] + e.get("dur", 0) >= ts]
    return out


class _RegionCalls:
    """Which trim op call (an index), if any, was open on the launching thread when a
    kernel was launched. The op does not nest in itself, so per thread its calls are
    disjoint intervals and a bisection finds the one that could hold a launch."""

    def __init__(self, calls: list[dict]) -> None:
        self.by_tid: dict = defaultdict(list)
        for i, e in enumerate(calls):
            self.by_tid[e["tid"]].append((e["ts"], e["ts"] + e.get("dur", 0), i))
        self.starts = {tid: [c[0] for c in cs] for tid, cs in self.by_tid.items()}

    def __call__(self, launch: dict | None) -> int | None:
        if launch is None or launch["tid"] not in self.by_tid:
            return None
        j = bisect.bisect_right(self.starts[launch["tid"]], launch["ts"]) - 1
        if j < 0:
            return None
        start, stop, i = self.by_tid[launch["tid"]][j]
        return i if launch["ts"] <= stop else None


def analyse(events: list[dict], min_gap_us: float = MIN_GAP_US) -> GapReport:
    rep = GapReport()
    dev = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in _DEVICE_CATS),
                 key=lambda e: e["ts"])
    host = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in _HOST_CATS),
                  key=lambda e: e["ts"])
    if not host:
        return rep
    t0 = host[0]["ts"]
    t1 = max(e["ts"] + e.get("dur", 0) for e in host + dev)
    rep.window_us = t1 - t0
    calls = [e for e in host if e["name"] == REGION_OP]
    rep.region.calls = len(calls)
    rep.region.host_us = sum(e.get("dur", 0) for e in calls)
    if not dev:
        rep.lead_us = rep.window_us
        return rep
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("ph") == "X" and e.get("cat") in _LAUNCH_CATS and "correlation" in e.get("args", {})}
    rep.lead_us = max(0.0, dev[0]["ts"] - t0)
    in_region = _RegionCalls(calls)
    spans: dict[int, list[float]] = {}  # region call -> [first kernel start, last kernel end]
    late: list[tuple[float, float, object]] = []  # host-bound gaps: (gap, launch ts, tid)
    end = dev[0]["ts"]
    for k in dev:
        k_end = k["ts"] + k.get("dur", 0)
        gap = k["ts"] - end
        launch = launches.get(k.get("args", {}).get("correlation"))
        call = in_region(launch)
        host_bound = False
        if gap >= min_gap_us:
            if launch is not None and launch["ts"] + launch.get("dur", 0) > end:
                host_bound = True
                rep.host_gaps_us += gap
                late.append((gap, launch["ts"], launch["tid"]))
            else:
                rep.other_gaps_us += gap
        busy = max(0.0, k_end - max(end, k["ts"]))
        rep.busy_us += busy
        if call is not None:
            reg = rep.region
            reg.kernels += 1
            reg.busy_us += busy
            reg.host_gaps_us += gap if host_bound else 0.0
            slot = reg.by_kernel[k["name"]]
            slot[0] += k.get("dur", 0)
            slot[1] += 1
            span = spans.setdefault(call, [k["ts"], k_end])
            span[1] = max(span[1], k_end)
        end = max(end, k_end)
    rep.region.span_us = sum(b - a for a, b in spans.values())
    rep.tail_us = max(0.0, t1 - end)
    stacks = _stacks_at(host, [(ts, tid) for _, ts, tid in late])
    for gap, ts, tid in late:
        slot = rep.by_op[_label(stacks[(ts, tid)])]
        slot[0] += gap
        slot[1] += 1
    return rep


def analyse_file(path: str) -> GapReport:
    return analyse(load(path))
