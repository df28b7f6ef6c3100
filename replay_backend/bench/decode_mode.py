"""A decode-bench mode: its report entry and its runner, with its requests' positions
(bench/decode.py)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..reference.runner import StepRunner
from ..requests import RequestChunk
from .watch import sync


@dataclass
class DecodeRun:
    """One mode's report entry."""

    mode: str
    build_s: float = 0.0  # trace, compile and capture
    capture: dict = field(default_factory=dict)  # per level: graphs, sizes, seconds, GiB
    tpot_ms: dict = field(default_factory=dict)  # "context/conc" -> median step ms
    # "context/conc" -> ms per step of steps queued back to back, one sync at the end: a
    # server whose host prepares the next step while the GPU runs this one
    pipelined_ms: dict = field(default_factory=dict)
    floor_ms: dict = field(default_factory=dict)  # "context/conc" -> kernel ms of one step
    # "context/conc" -> median host ms of building the step's batch, inside tpot_ms: host
    # time before the step's first kernel, which a synchronised step cannot hide
    build_ms: dict = field(default_factory=dict)
    # "context/conc" -> median host ms from the build's start until the step is queued
    # (its run returns, before the sync): the build and every launch. Close to the
    # step's whole time, the host held the GPU back; far below it, the GPU ran the rest.
    host_ms: dict = field(default_factory=dict)
    kinds: dict = field(default_factory=dict)  # "context/conc" -> the step kind it ran as
    mixed_ms: dict = field(default_factory=dict)  # "tokens" -> median step ms
    ttft_ms: dict = field(default_factory=dict)  # "isl" -> median prefill ms (c1)
    max_abs_err_vs_first: dict = field(default_factory=dict)  # "context/conc" -> vs the first mode's logits
    floor_errors: dict = field(default_factory=dict)  # "context/conc" -> why the point has no floor
    error: str | None = None


class Mode:
    """A mode's runner and its requests' positions."""

    def __init__(self, run: DecodeRun, runner: StepRunner) -> None:
        self.run, self.runner = run, runner
        self.seq: dict[str, int] = {}

    def start(self, tag: str, context: int, conc: int) -> list[str]:
        ids = [f"{tag}-{i}" for i in range(conc)]
        self.runner.prefill({rid: context for rid in ids})
        self.seq.update({rid: context for rid in ids})
        return ids

    def decode(self, ids: list[str], synced: bool = True):
        """One decode step of ``ids``: its ms, the ms of building its batch, the host's ms
        until the step was queued, its output."""
        reqs = []
        for rid in ids:
            self.seq[rid] += 1
            reqs.append(RequestChunk(rid, 1, self.seq[rid]))
        if synced:
            sync()
        t0 = time.perf_counter()
        batch = self.runner.build_batch(reqs)
        t1 = time.perf_counter()
        out = self.runner.run(batch)
        t2 = time.perf_counter()
        if synced:
            sync()
        return (time.perf_counter() - t0) * 1e3, (t1 - t0) * 1e3, (t2 - t0) * 1e3, out

    def step_ms(self, ids: list[str]) -> float:
        """One synchronised decode step of ``ids``: its ms."""
        return self.decode(ids)[0]

    def pipelined(self, ids: list[str], steps: int) -> float:
        """ms per step of ``steps`` decode steps queued back to back."""
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            self.decode(ids, synced=False)
        sync()
        return (time.perf_counter() - t0) * 1e3 / steps

    def end(self, ids: list[str]) -> None:
        for rid in ids:
            self.runner.free(rid)
            del self.seq[rid]
