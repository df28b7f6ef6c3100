"""Several ranks: every rank of a group runs the same graphs, in the same order.

The collectives inside a model's pieces (a tensor-parallel all-reduce, an
expert-parallel token exchange) only meet when every rank runs the same pieces at the
same sizes: the step's sizes are agreed (dispatch/agree.py), so the graphs each rank
holds must be the same set, captured in the same order. So the ranks of a group compare
what decides that, and refuse to go on, naming the first difference, when one rank's
differs: their options when the backend is made (before any trace), their capture
schedule before capture, and with ``debug_check_ranks`` every step's plan among
tensor-parallel ranks, which hold the same batch and must decide alike.
"""
from __future__ import annotations

import logging

from torch.nn.parameter import is_lazy

from .rank_errors import RanksApart, mark_told

log = logging.getLogger("replay_backend")


def check_groups(config, dp_group, tp_group) -> None:
    """A backend's rank groups, checked when it is made, before any trace: the
    data-parallel ranks agree on every step in a host collective, so theirs is a CPU
    group; a rank of either group with other options than its peers is an error now."""
    import torch.distributed as dist

    for name, group in (("dp_group", dp_group), ("tp_group", tp_group)):
        # new_group() gives a process outside the group a placeholder, whose rank is -1.
        if group is not None and dist.get_rank(group) < 0:
            raise ValueError(f"ReplayBackend({name}=...): this process (rank {dist.get_rank()}) is not in that "
                             "group: every rank of a group creates it, and each passes the group it belongs to")
    if dp_group is not None:
        if dist.get_backend(dp_group) != "gloo":
            raise ValueError(f"ReplayBackend(dp_group=...): a {dist.get_backend(dp_group)} group; the ranks agree "
                             "on every step in a host collective, which on a device group would make the host "
                             "wait for the device each step: give a CPU group, dist.new_group(ranks, "
                             "backend='gloo')")
    if config.debug_check_ranks and tp_group is None:
        log.warning("dsv41_replay: option debug_check_ranks=True has no effect without tensor-parallel ranks "
                    "(ReplayBackend(tp_group=...)): there is no other rank to compare plans with")
    for group in (dp_group, tp_group):
        if group is not None:
            check_same_options(config, group, rank_checks=group is tp_group)


def schedule(model) -> dict:
    """What a compiled model will capture, in the order it will: its sizes and pieces."""
    plan = model.plan
    full = model.full_policy
    return {
        "FULL sizes (largest first)": sorted(full.sizes, reverse=True) if full is not None else [],
        "FULL batches": ("uniform decodes" if full.uniform_only else "any") if full is not None else None,
        "main sizes (largest first)": sorted(model.main_level.sizes, reverse=True),
        "replay sizes (largest first)": sorted(model.replay.level.sizes, reverse=True) if model.replay else [],
        "main pieces": [p.kind for p in plan.main_pieces],
        "replay pieces": [p.kind for p in plan.replay_pieces],
        "trim threshold": plan.trim_threshold,
        "window": plan.window,
    }


_NONE = object()


def gathered(mine, group) -> list:
    import torch.distributed as dist

    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    return every


def check_same(mine: dict, group, what: str) -> None:
    """Raise on every rank of ``group`` when any rank's ``mine`` differs from the first
    rank's, naming the ranks and the first key that differs (``what``: the error's lead)."""
    _compare(gathered(mine, group), group, what)


def check_same_point(every: list, group) -> None:
    """Every rank gathered the same kind of record: a rank whose record shares no key
    with the first's is at another check (capture's while another runs a step)."""
    import torch.distributed as dist

    for rank, theirs in enumerate(every):
        if not set(theirs) & set(every[0]):
            ranks = dist.get_process_group_ranks(group)
            error = RanksApart(f"dsv41_replay: the ranks of a group are not at the same point: rank {ranks[rank]} "
                               f"checks {next(iter(theirs), 'nothing')!r} while rank {ranks[0]} checks "
                               f"{next(iter(every[0]), 'nothing')!r} (one captures while another runs a step, "
                               "say): every rank calls capture() at the same point, after the same steps")
            mark_told(error)
            raise error


def _compare(every: list, group, what: str) -> None:
    import torch.distributed as dist

    check_same_point(every, group)
    first = every[0]
    for rank, theirs in enumerate(every):
        for key in [*first, *(k for k in theirs if k not in first)]:  # a key one side lacks differs too
            if theirs.get(key, _NONE) != first.get(key, _NONE):
                ranks = dist.get_process_group_ranks(group)
                raise ValueError(f"dsv41_replay: {what}: rank {ranks[rank]} has {key} {theirs.get(key, 'none')}, "
                                 f"rank {ranks[0]} has {first.get(key, 'none')} (ranks of a group need the same "
                                 "model, options and capture sizes)")


def model_digest(model, setup=None) -> dict:
    """What every rank's model must share before its first step, whose collectives
    would otherwise meet at other sizes or counts: its modules, each parameter's and
    buffer's shape and dtype (a rank's shard of a split weight has its peers' shape,
    whatever its values), and the setup's window where given. Not its cache layout:
    data-parallel ranks may hold caches of their own sizes (where that changes the
    graphs, the capture schedule check names it)."""
    digest: dict = {f"module {name or '(the model)'}": type(m).__qualname__ for name, m in model.named_modules()}
    for kind, tensors in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in tensors:  # a lazy module's tensor has no shape until its first call
            digest[f"{kind} {name}"] = "uninitialized" if is_lazy(t) else f"{tuple(t.shape)} {t.dtype}"
    if setup is not None:
        digest["StepSetup.window"] = setup.window
    return digest


def check_same_model(model, setup, group) -> None:
    check_same(model_digest(model, setup), group, "the ranks were given different models")


def check_same_schedule(model, group) -> None:
    check_same(schedule(model), group, "the ranks would capture different graphs")


def check_same_options(config, group, rank_checks: bool = False) -> None:
    """The ranks' options, but the debug ones that stay on their rank (a dump path may
    differ per rank). ``rank_checks``: ``debug_check_ranks`` too, which on a
    tensor-parallel group adds a collective to every step that every rank must join."""
    mine = {k: v for k, v in config.as_dict().items()
            if not k.startswith("debug_") or rank_checks and k == "debug_check_ranks"}
    check_same(mine, group, "the ranks were given different options")


def check_same_plan(plan, group) -> None:
    check_same({"step plan": plan}, group, "tensor-parallel ranks decided a step differently")
