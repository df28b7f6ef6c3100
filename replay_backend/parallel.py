"""Several ranks: every rank of a group captures the same graphs, in the same order.

The collectives inside a model's pieces (a tensor-parallel all-reduce, an
expert-parallel token exchange) only meet when every rank runs the same pieces at the
same sizes: the step's sizes are agreed (dispatch/agree.py), so the graphs each rank
holds must be the same set, captured in the same order. Before capture the ranks of a
group exchange their capture schedule and refuse to go on, naming the first
difference, when one rank's differs (other options, another model, other sizes).
"""
from __future__ import annotations


def schedule(model) -> dict:
    """What a compiled model will capture, in the order it will: its sizes and pieces."""
    plan = model.plan
    return {
        "main sizes (largest first)": sorted(model.main_level.sizes, reverse=True),
        "replay sizes (largest first)": sorted(model.replay.level.sizes, reverse=True) if model.replay else [],
        "main pieces": [p.kind for p in plan.main_pieces],
        "replay pieces": [p.kind for p in plan.replay_pieces],
        "trim threshold": plan.trim_threshold,
        "window": plan.window,
    }


def check_same_schedule(model, group) -> None:
    """Raise on every rank of ``group`` when any rank's capture schedule differs from
    the first rank's, naming the ranks and what differs first."""
    import torch.distributed as dist

    mine = schedule(model)
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    for rank, theirs in enumerate(every):
        for key, want in every[0].items():
            if theirs.get(key) != want:
                ranks = dist.get_process_group_ranks(group)
                raise ValueError(f"dsv41_replay: the ranks would capture different graphs: rank {ranks[rank]} has "
                                 f"{key} {theirs.get(key)}, rank {ranks[0]} has {want} (ranks of a group need the "
                                 "same model, options and capture sizes)")
