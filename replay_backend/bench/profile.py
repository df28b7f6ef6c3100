"""Profiler helpers of the benchmark: the kernel-time floor and per-point summaries."""
from __future__ import annotations

from typing import Callable

import torch

from .cuda_tracing import CudaTracing
def kernels(events) -> list:
    """Device-side events only: a CPU op's "self CUDA" time is its kernels' time again."""
    return [e for e in events if e.device_type != torch.autograd.DeviceType.CPU and e.self_device_time_total > 0]


class NoKernelsRecorded(RuntimeError):
    """A profiler session over a step recorded no GPU kernels: its tracing was lost, and
    a floor read from it would be 0 ms."""


def kernel_floor_ms(ttft: Callable[[], float], tracing: CudaTracing | None = None) -> float:
    """Sum of GPU kernel times of one TTFT (the profile's device self time), in a
    session of ``tracing`` (by default one of its own, left attached). Raises
    :class:`NoKernelsRecorded` when the session recorded none."""
    from torch.profiler import ProfilerActivity

    with (tracing or CudaTracing()).session([ProfilerActivity.CUDA]) as prof:
        wall = ttft()
    ks = kernels(prof.key_averages())
    if not ks:
        raise NoKernelsRecorded(f"the profiler recorded no GPU kernels in a step of {wall:.1f} ms: its CUDA "
                                "tracing was lost (CudaTracing)")
    return sum(e.self_device_time_total for e in ks) / 1e3


def profile_to(path: str, title: str, ttft: Callable[[], float], trace_dir: str | None = None,
               tracing: CudaTracing | None = None) -> None:
    """Where one TTFT's time goes: host wall time, GPU kernel time, the GPU's idle time
    by cause (:mod:`bench.gaps`), top ops and kernels, appended to ``path`` under
    ``title`` (one file holds every profile of a run). With ``trace_dir`` the Chrome
    trace is kept there, gzipped."""
    import gzip
    import os
    import shutil
    import tempfile

    from torch.profiler import ProfilerActivity

    from .gaps import analyse_file

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with (tracing or CudaTracing()).session(acts) as prof:
        wall = ttft()
    events = prof.key_averages()
    ks = kernels(events)
    gpu_ms = sum(e.self_device_time_total for e in ks) / 1e3
    launches = sum(e.count for e in ks)
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(trace)
        gaps = analyse_file(trace).render()
        if trace_dir:
            os.makedirs(trace_dir, exist_ok=True)
            name = "".join(c if c.isalnum() else "_" for c in title) + ".json.gz"
            with open(trace, "rb") as src, gzip.open(os.path.join(trace_dir, name), "wb") as dst:
                shutil.copyfileobj(src, dst)
    with open(path, "a") as f:
        f.write(f"\n\n######## {title}\n")
        f.write(f"wall {wall:.2f} ms (profiled), GPU kernel time {gpu_ms:.2f} ms, {launches} kernels\n")
        f.write(gaps + "\n\n")
        f.write(events.table(sort_by="self_device_time_total" if ks else "self_cpu_time_total",
                             row_limit=40, max_name_column_width=70))
        f.write("\n\nby host time\n")
        f.write(events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70))


def host_profile_to(path: str, title: str, step: Callable[[], float], steps: int) -> None:
    """Where ``steps`` calls of ``step`` spend host time, by Python function (cProfile),
    appended to ``path`` under ``title``: sorted by cumulative time, then by own time.
    cProfile slows every Python call, so read its figures as shares of the host's work,
    and the step times of the bench (taken without it) as times."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    walls = []
    for _ in range(steps):
        prof.enable()
        walls.append(step())
        prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("cumulative").print_stats(50)
    stats.sort_stats("tottime").print_stats(30)
    with open(path, "a") as f:
        f.write(f"\n\n######## {title}: {steps} steps, {sum(walls) / steps:.2f} ms each under cProfile\n")
        f.write(text.getvalue())
