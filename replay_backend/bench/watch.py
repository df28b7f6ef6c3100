"""What the bench watches besides its steps: its time budget, the GPU's queue, the
host's speed and Python's garbage collections."""
from __future__ import annotations

import gc
import statistics
import time

import torch


class Deadline:
    """``--max-seconds``: whether the bench is past its budget. Over several ranks
    (``group``: a host group of every rank) the answer is agreed, past on every rank
    once past on any: each rank's clock started apart, and a rank that stopped while
    another went on would leave that one waiting in a collective."""

    def __init__(self, at: float, group=None) -> None:
        self.at, self.group = at, group

    def left(self) -> float:
        """Seconds until the deadline (0 once past), by this process's clock."""
        return max(0.0, self.at - time.perf_counter())

    def passed(self) -> bool:
        past = time.perf_counter() > self.at
        if self.group is None:
            return past
        import torch.distributed as dist

        flag = torch.tensor([int(past)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def host_probe() -> dict:
    """How fast this process's host is now, as two medians in us: one small CPU tensor
    op (Python and the dispatcher), and one launch of a tiny CUDA kernel (None without
    CUDA). Steps without graphs are bound by exactly this work, and their times move
    between processes (docs/benchmarks.md); taken before and after the timed points,
    these say whether the host did."""
    def per_call(op, calls: int = 2000) -> float:
        samples = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(calls):
                op()
            samples.append((time.perf_counter() - t0) / calls * 1e6)
        return statistics.median(samples)

    x = torch.zeros(4)
    out = {"cpu_op_us": per_call(lambda: torch.add(x, 1))}
    if torch.cuda.is_available():
        xg = torch.zeros(4, device="cuda")
        sync()
        out["cuda_launch_us"] = per_call(lambda: torch.add(xg, 1))
        sync()
    else:
        out["cuda_launch_us"] = None
    return out


class GcWatch:
    """Python's garbage collections while timing: count, gen-2 count and seconds.
    A gen-2 pass walks every object of the process (a compiled 40-layer model leaves
    millions), so it can land inside a timed step of whichever mode runs then."""

    def __init__(self) -> None:
        self.count = self.gen2 = 0
        self.seconds = 0.0
        self._t0 = 0.0

    def _cb(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.count += 1
            self.gen2 += info.get("generation") == 2
            self.seconds += time.perf_counter() - self._t0

    def __enter__(self) -> "GcWatch":
        gc.callbacks.append(self._cb)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._cb)
