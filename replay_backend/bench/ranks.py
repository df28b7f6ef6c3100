"""The bench over several ranks (``--tp``, ``--dp``, ``--enable-expert-parallel``): one
process per rank, started by ``torchrun`` or spawned here, their process groups, and
what every rank must decide alike.

Every collective inside a step meets only if every rank runs the same steps in the
same order, so nothing that decides the bench's control flow may be one rank's own:
the ``--max-seconds`` checks are agreed over a host (gloo) group of every rank
(watch.Deadline), and a mode that fails on one rank ends the run (run.py says why).
"""
from __future__ import annotations

import contextlib
import datetime
import os
import socket
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..compat import dynamo as compat_dynamo
from ..reference.parallel import Parallel

# Long enough for one rank's compile of a 40-layer model while another waits in the
# first step's collective; short enough that a rank left waiting by a dead peer ends.
COLLECTIVE_TIMEOUT_S = 1800.0
# After a rank fails, the others are stopped this long after: they can only be waiting
# in a collective the failed rank left (or failing in the same way).
KILL_GRACE_S = 10.0
AGREE_CALLS = 200
TORCHRUN_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK")


@dataclass(frozen=True)
class Topology:
    tp: int = 1
    dp: int = 1
    enable_expert_parallel: bool = False

    @property
    def world(self) -> int:
        return self.tp * self.dp

    def as_dict(self) -> dict:
        return {"tp": self.tp, "dp": self.dp, "enable_expert_parallel": self.enable_expert_parallel,
                "world": self.world}


def topology(args) -> Topology | None:
    """The bench's topology, or None without any of its flags (one process, as ever)."""
    tp, dp, ep = getattr(args, "tp", None), getattr(args, "dp", None), getattr(args, "enable_expert_parallel", False)
    if tp is None and dp is None and not ep:
        return None
    return Topology(tp or 1, dp or 1, bool(ep))


def torchrun_env() -> tuple[int, int, int] | None:
    """(world, rank, local rank) when started by ``torchrun``, else None."""
    if not all(k in os.environ for k in TORCHRUN_ENV):
        return None
    try:
        return tuple(int(os.environ[k]) for k in TORCHRUN_ENV)  # type: ignore[return-value]
    except ValueError:
        raise ValueError(f"torchrun's {', '.join(TORCHRUN_ENV)} must be integers, got "
                         + ", ".join(repr(os.environ[k]) for k in TORCHRUN_ENV)) from None


def check_launch(topo: Topology) -> None:
    """The ranks this machine can start, checked before any process starts."""
    env = torchrun_env()
    if env is not None:
        if env[0] != topo.world:
            raise ValueError(f"--tp {topo.tp} --dp {topo.dp} make {topo.world} ranks, torchrun started "
                             f"{env[0]} (WORLD_SIZE): give torchrun --nproc-per-node {topo.world}")
    elif torch.cuda.is_available() and topo.world > torch.cuda.device_count():
        raise ValueError(f"--tp {topo.tp} --dp {topo.dp} make {topo.world} ranks, one GPU each; this machine has "
                         f"{torch.cuda.device_count()}")


@dataclass
class Ranks:
    """This rank's place: the model's groups (NCCL on GPUs), the backend's host groups,
    and a host group of every rank for the bench's own agreements."""

    topo: Topology
    rank: int
    parallel: Parallel
    backend_groups: dict
    world_group: Any

    @property
    def lead(self) -> bool:
        return self.rank == 0

    def gather(self, obj) -> list:
        import torch.distributed as dist

        every: list = [None] * self.topo.world
        dist.all_gather_object(every, obj, group=self.world_group)
        return every

    def own_paths(self, args):
        """``args`` with this rank's own profile file and trace folder (rank 0 keeps them)."""
        import copy

        if self.lead or not (getattr(args, "profile_out", None) or getattr(args, "trace_dir", None)):
            return args
        args = copy.copy(args)
        if args.profile_out:
            args.profile_out = f"{args.profile_out}.rank{self.rank}"
        if getattr(args, "trace_dir", None):
            args.trace_dir = os.path.join(args.trace_dir, f"rank{self.rank}")
        return args


def make_groups(topo: Topology, rank: int) -> Ranks:
    """Every group, created on every rank in one order (as torch.distributed asks), at
    size 1 too: a TP group of one rank still runs its all-reduce, a DEP group of one its
    exchange, inside the captured graphs. TP groups are consecutive ranks, DP groups one
    rank of each TP group."""
    import torch.distributed as dist

    tp, dp = topo.tp, topo.dp
    tp_ranks = [[d * tp + t for t in range(tp)] for d in range(dp)]
    dp_ranks = [[d * tp + t for d in range(dp)] for t in range(tp)]
    tp_groups = [dist.new_group(r) for r in tp_ranks]
    dp_groups = [dist.new_group(r) for r in dp_ranks]
    # The backend's groups carry host decisions (the per-step agreement, the checks of
    # options and schedules): gloo, apart from the model's device groups.
    tp_host = [dist.new_group(r, backend="gloo") for r in tp_ranks]
    dp_host = [dist.new_group(r, backend="gloo") for r in dp_ranks]
    world_group = dist.new_group(list(range(topo.world)), backend="gloo")
    t, d = rank % tp, rank // tp
    par = Parallel(tp, t, tp_groups[d], dp, d, dp_groups[t], topo.enable_expert_parallel)
    # A DP group of one rank has nothing to agree on, unless its exchange needs every
    # rank's sizes agreed (DEP); a TP group of one nothing to check.
    backend_groups = {"dp_group": dp_host[t] if dp > 1 or topo.enable_expert_parallel else None,
                      "tp_group": tp_host[d] if tp > 1 else None}
    return Ranks(topo, rank, par, backend_groups, world_group)


def agreement_us(ranks: Ranks, calls: int = AGREE_CALLS) -> float:
    """Median host time of one per-step agreement (dispatch/agree.py) on the backend's
    data-parallel group, in us; every rank calls it."""
    import torch.distributed as dist

    from ..dispatch.agree import agree

    dist.barrier(group=ranks.world_group)
    samples = []
    for _ in range(calls):
        t0 = time.perf_counter()
        agree(ranks.backend_groups["dp_group"], True, 1024, True, 128)
        samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def run_rank(body: Callable, args, topo: Topology, rank: int, world: int, local_rank: int,
             init_method: str) -> int:
    """``body(args, ranks)`` as rank ``rank``: its device, the process group, the groups.
    Only rank 0 prints."""
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if cuda:
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"local rank {local_rank}: this machine has {torch.cuda.device_count()} GPU(s)")
        torch.cuda.set_device(local_rank)
    if rank != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the life of the rank
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        return body(args, make_groups(topo, rank))
    finally:
        with contextlib.suppress(Exception):  # a failed rank's teardown: its error is what counts
            dist.destroy_process_group()


def launch(body: Callable, args, topo: Topology) -> int:
    """Run ``body(args, ranks)`` on every rank: in this process under ``torchrun``, else
    in one spawned process per rank. Returns rank 0's exit status (this rank's under
    torchrun); a rank that raises is named in the error."""
    env = torchrun_env()
    if env is not None:
        world, rank, local_rank = env
        try:
            return run_rank(body, args, topo, rank, world, local_rank, "env://")
        except Exception as e:  # noqa: BLE001 - named here; torchrun stops the other ranks
            return _failed(rank, e, traceback.format_exc())
    return _spawn(body, args, topo)


def _failed(rank: int, exc: BaseException | None, tb: str, user: str | None = None, note: str = "") -> int:
    """A rank's failure: a usage error (a ValueError, however wrapped) as the CLI's one
    line, anything else as its traceback and a last line naming the rank (status 1)."""
    err = compat_dynamo.user_error(exc) if exc is not None else None
    user = user if user is not None else (str(err) if err is not None else None)
    if user is not None:
        raise ValueError(f"rank {rank}: {user}")
    print(tb.rstrip() + note, file=sys.stderr)
    last = tb.strip().splitlines()[-1] if tb.strip() else "no report"
    print(f"replay-backend: error: rank {rank} raised: {last}", file=sys.stderr)
    return 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned(body, args, topo: Topology, rank: int, port: int, out) -> None:
    if not torch.cuda.is_available():  # the ranks share the machine's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // topo.world))
    try:
        code = run_rank(body, args, topo, rank, topo.world, rank, f"tcp://127.0.0.1:{port}")
        out.send((code, None, None, time.time()))
    except BaseException as e:  # noqa: BLE001 - reported to the launcher, which names the rank
        err = compat_dynamo.user_error(e)
        out.send((None, traceback.format_exc(), None if err is None else str(err), time.time()))
    out.close()


def _spawn(body: Callable, args, topo: Topology) -> int:
    import torch.multiprocessing as mp
    from multiprocessing.connection import wait

    ctx = mp.get_context("spawn")
    port = _free_port()
    pipes = [ctx.Pipe(duplex=False) for _ in range(topo.world)]
    # Not daemonic: a rank's Inductor may start compile workers of its own.
    procs = [ctx.Process(target=_spawned, args=(body, args, topo, r, port, pipes[r][1])) for r in range(topo.world)]
    for p, (_, send) in zip(procs, pipes):
        p.start()
        send.close()  # the rank's end only: its report, or EOF when it dies without one
    done: dict[int, tuple] = {}
    stop_at = None
    try:
        while len(done) < topo.world:
            waiting = {pipes[r][0]: r for r in range(topo.world) if r not in done}
            for conn in wait(list(waiting), timeout=0.5):
                rank = waiting[conn]
                try:
                    done[rank] = conn.recv()
                except EOFError:  # killed without a word (out of memory, a signal)
                    procs[rank].join(1.0)
                    done[rank] = (None, f"rank {rank} ended (exit status {procs[rank].exitcode}) before its "
                                        "report", None, time.time())
            if stop_at is None and any(v[0] is None for v in done.values()):
                stop_at = time.monotonic() + KILL_GRACE_S
            if stop_at is not None and time.monotonic() > stop_at:
                break
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join()
        for recv, _ in pipes:
            recv.close()
    failed = sorted((v[3], r) for r, v in done.items() if v[0] is None)
    if failed:
        rank = failed[0][1]
        _, tb, user, _ = done[rank]
        others = sorted([r for _, r in failed[1:]] + [r for r in range(topo.world) if r not in done])
        note = f"\n(rank(s) {others} failed or were stopped after it)" if others else ""
        return _failed(rank, None, tb, user, note)
    return done[0][0]
