"""Profiler helpers of the benchmark: the kernel-time floor and per-point summaries."""
from __future__ import annotations

from typing import Callable

import torch


def kernels(events) -> list:
    """Device-side events only: a CPU op's "self CUDA" time is its kernels' time again."""
    return [e for e in events if e.device_type != torch.autograd.DeviceType.CPU and e.self_device_time_total > 0]


def kernel_floor_ms(ttft: Callable[[], float]) -> float:
    """Sum of GPU kernel times of one TTFT (the profile's device self time)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        ttft()
    return sum(e.self_device_time_total for e in kernels(prof.key_averages())) / 1e3


def profile_to(path: str, title: str, ttft: Callable[[], float]) -> None:
    """Where one TTFT's time goes: host wall time, GPU kernel time, top ops and kernels,
    appended to ``path`` under ``title`` (one file holds every profile of a run)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        wall = ttft()
    events = prof.key_averages()
    ks = kernels(events)
    gpu_ms = sum(e.self_device_time_total for e in ks) / 1e3
    launches = sum(e.count for e in ks)
    with open(path, "a") as f:
        f.write(f"\n\n######## {title}\n")
        f.write(f"wall {wall:.2f} ms (profiled), GPU kernel time {gpu_ms:.2f} ms, {launches} kernels\n\n")
        f.write(events.table(sort_by="self_device_time_total" if ks else "self_cpu_time_total",
                             row_limit=40, max_name_column_width=70))
        f.write("\n\nby host time\n")
        f.write(events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70))
