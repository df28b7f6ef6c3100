"""Run a function on several ranks (processes; gloo on the CPU, NCCL on GPUs) inside a
test, bounded in time: a rank that raises or hangs fails the test naming the rank, and
no rank is left running after it (an NCCL rank can hang in its teardown: it is killed
once its result is in)."""
from __future__ import annotations

import datetime
import os
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(fn, rank: int, world: int, init: str, out: str, collective_timeout: float, backend: str,
           args: tuple) -> None:
    torch.set_num_threads(1)
    result: dict
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=collective_timeout))
        result = {"ok": fn(rank, world, *args)}
    except BaseException:  # noqa: BLE001 - reported to the parent, which names the rank
        result = {"error": traceback.format_exc(), "at": time.time()}
    torch.save(result, os.path.join(out, f"{rank}.pt"))
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - teardown after a failure: the parent reports the failure
        pass


def run_ranks(fn, world: int, *args, timeout: float = 300.0, collective_timeout: float = 120.0,
              backend: str = "gloo") -> list:
    """``fn(rank, world, *args)`` on ``world`` ranks of one ``backend`` group (gloo on the
    CPU; nccl: one GPU per rank; ``fn`` must be a
    module-level function); returns each rank's result. A rank that raised fails with
    the first rank's traceback, that rank named; a rank that died without a result (a
    crash in native code) is named with its exit code; ranks still running after
    ``timeout`` seconds are killed and named."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'store')}"
        procs = [ctx.Process(target=_entry, args=(fn, r, world, init, tmp, collective_timeout, backend, args),
                             daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        done = lambda: [os.path.exists(os.path.join(tmp, f"{r}.pt")) for r in range(world)]  # noqa: E731
        # Until every rank has its result, or every rank without one has died (a crash
        # in native code writes nothing).
        while time.monotonic() < deadline and any(not d and p.is_alive() for d, p in zip(done(), procs)):
            time.sleep(0.2)
        for p in procs:  # a rank past its result only tears down: a moment, then killed
            p.join(max(1.0, min(10.0, deadline - time.monotonic())))
        died = [(r, p.exitcode) for r, p in enumerate(procs) if not done()[r] and p.exitcode is not None]
        hung = [r for r, p in enumerate(procs) if not done()[r] and p.exitcode is None]
        for p in procs:
            if p.is_alive():
                p.kill()
        results = [torch.load(os.path.join(tmp, f"{r}.pt"), weights_only=False) if done()[r] else None
                   for r in range(world)]
    errors = [(r, res["error"]) for r, res in enumerate(results) if res is not None and "error" in res]
    if died:  # the likely cause, which its peers' errors follow: each one's last line
        raise AssertionError("; ".join(f"rank {r} died without a result (exit code {code})" for r, code in died)
                             + "".join(f"\n(rank {r} raised: {e.strip().splitlines()[-1]})" for r, e in errors))
    if errors:
        # The first to raise is the cause; the others fail in a collective it left.
        first = min(errors, key=lambda e: results[e[0]]["at"])
        raise AssertionError(f"rank {first[0]} raised first:\n{first[1]}"
                             + "".join(f"\n(rank {r} raised after it)" for r, _ in errors if r != first[0]))
    if hung:
        raise AssertionError(f"rank(s) {hung} still running after {timeout:.0f} s: killed")
    return [res["ok"] for res in results]
