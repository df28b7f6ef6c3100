"""Kineto's CUDA tracing over the benchmark's profiler sessions (private torch behaviour,
read from its environment variables)."""
from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Iterator

import torch


class CudaTracing:
    """Kineto's CUDA tracing (CUPTI) over one phase of profiler sessions: each
    :meth:`session` leaves it attached for the next, :meth:`release` tears it down
    after the last. Attached, it makes every later CUDA call slower on the host, which
    would fall on whatever is timed afterwards (docs/benchmarks.md).

    Kineto resets its trace state as each session starts and again as it ends. A reset
    under ``TEARDOWN_CUPTI=1`` while the tracing is attached starts a teardown, carried
    out on the process's next CUDA call, and a session in which that call lands records
    no GPU kernels: a reset at one session's end can empty the next one, a reset at a
    session's start empties that session itself. So the variable is ``0`` from each
    session's start on, and stays ``0``: every later session starts with the tracing
    attached and nothing to tear down. A session's start sees the variable as left
    before it: at the process's first session nothing is attached yet, and after a
    release it is ``1``, under which the start re-attaches the torn-down tracing
    (Kineto's lazy re-init).

    Whether a release may tear down is the environment's as found when the phase starts,
    before its sessions set the variable: not where ``TEARDOWN_CUPTI=0`` was set (the
    user, or torch itself where CUDA graphs and teardown crash, CUDA before 12.6) or
    torch's profiler marks a session after a teardown as crashing
    (``DISABLE_CUPTI_LAZY_REINIT``), nor without CUDA."""

    def __init__(self) -> None:
        self.cuda = torch.cuda.is_available()
        self.releasable = (self.cuda and os.environ.get("TEARDOWN_CUPTI") != "0"
                           and "DISABLE_CUPTI_LAZY_REINIT" not in os.environ)
        self.attached = False

    @contextlib.contextmanager
    def session(self, activities) -> Iterator[Any]:
        """``torch.profiler.profile(activities=...)``, its tracing left attached."""
        from torch.profiler import profile

        with profile(activities=activities) as prof:
            if self.cuda:
                os.environ["TEARDOWN_CUPTI"] = "0"
                self.attached = True
            yield prof

    def release(self) -> None:
        """Tear down the tracing the sessions left attached, where it may be. One short
        session whose start resets with ``TEARDOWN_CUPTI=1``, which starts the teardown,
        and inside it CUDA calls that carry it out (Kineto runs it from a thread of its
        own, so a few, a moment apart), while the variable still says ``1`` (its lazy
        re-init stays on); ``0`` just before the session ends, so its end starts no
        second teardown. The variable is left at ``1``, under which the next session
        re-attaches the tracing (and a plain profiler session tears it down at its end,
        Kineto's own way)."""
        if not (self.attached and self.releasable):
            return  # a release's session where nothing is attached would attach it
        from torch.profiler import ProfilerActivity, profile

        os.environ["TEARDOWN_CUPTI"] = "1"
        with profile(activities=[ProfilerActivity.CUDA]):
            for _ in range(_RELEASE_CALLS):
                time.sleep(_RELEASE_PAUSE_S)
                torch.cuda.synchronize()
            os.environ["TEARDOWN_CUPTI"] = "0"
        os.environ["TEARDOWN_CUPTI"] = "1"
        self.attached = False


# The release's CUDA calls, and the pause before each: Kineto's teardown thread arms
# the teardown a moment after the session's start.
_RELEASE_CALLS, _RELEASE_PAUSE_S = 3, 0.01
