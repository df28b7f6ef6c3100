"""The host cost of the data-parallel ranks' per-step agreement (dispatch/agree.py): one
gloo all-reduce (max) of five integers, timed on RANKS local processes.

    .venv/bin/python scripts/agree_cost.py [--ranks 2] [--calls 2000]

Prints the median and the 10th / 90th percentiles of one call, in us, per rank.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _rank(rank: int, world: int, port: int, calls: int, out) -> None:
    from replay_backend.dispatch.agree import agree

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.new_group(list(range(world)), backend="gloo")
    for _ in range(100):  # warm-up: connections, allocations
        agree(group, True, 1024, True, 128)
    dist.barrier(group=group)
    samples = []
    for _ in range(calls):
        t0 = time.perf_counter()
        agree(group, True, 1024, True, 128)
        samples.append((time.perf_counter() - t0) * 1e6)
    samples.sort()
    out.put((rank, statistics.median(samples), samples[len(samples) // 10], samples[9 * len(samples) // 10]))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--calls", type=int, default=2000)
    a = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    procs = [ctx.Process(target=_rank, args=(r, a.ranks, port, a.calls, out)) for r in range(a.ranks)]
    for proc in procs:
        proc.start()
    for proc in procs:  # a rank's report is one small write: it never waits for the reader
        proc.join(300)
    failed = [r for r, proc in enumerate(procs) if proc.exitcode != 0]
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    if failed:
        sys.exit(f"agree_cost.py: rank(s) {failed} failed or hung (their output is above)")
    rows = sorted(out.get() for _ in procs)
    print(f"agree() on {a.ranks} gloo ranks, {a.calls} calls, {os.cpu_count()} CPU cores:")
    for rank, med, p10, p90 in rows:
        print(f"rank {rank}: median {med:.1f} us (p10 {p10:.1f}, p90 {p90:.1f})")


if __name__ == "__main__":
    main()
