"""Kineto's CUDA tracing over the benchmark's profiler sessions (private torch behaviour,
read from its environment variables)."""
from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import torch


class CudaTracing:
    """Kineto's CUDA tracing (CUPTI) over a process's profiler sessions, left attached
    from each session to the next.

    Once a session has attached it, every later CUDA launch of the process is slower on
    the host, a CUDA graph's most (about half a microsecond per kernel node), whether
    the tracing is torn down at the session's end or not (``scripts/tracing_probe.py``
    shows it). So a process profiles only after its last timed step: the benches take
    every floor and profile after all their timing (docs/benchmarks.md).

    Kineto resets its trace state as each session starts and again as it ends. A reset
    under ``TEARDOWN_CUPTI=1`` while the tracing is attached starts a teardown, carried
    out on the process's next CUDA call, and a session in which that call lands records
    no GPU kernels: a reset at one session's end can empty the next one, a reset at a
    session's start empties that session itself. So the variable is ``0`` from each
    session's start on, and stays ``0``: every later session starts with the tracing
    attached and nothing to tear down. The first session sees the variable as found:
    nothing is attached yet to tear down."""

    def __init__(self) -> None:
        self.cuda = torch.cuda.is_available()

    @contextlib.contextmanager
    def session(self, activities) -> Iterator[Any]:
        """``torch.profiler.profile(activities=...)``, its tracing left attached."""
        from torch.profiler import profile

        with profile(activities=activities) as prof:
            if self.cuda:
                os.environ["TEARDOWN_CUPTI"] = "0"
            yield prof
