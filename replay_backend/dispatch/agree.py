"""Data-parallel ranks agree on each step, in one small host collective.

The ranks of a data-parallel group run batches of their own, yet their steps must
meet: a collective inside a captured piece (an expert-parallel MoE's token exchange)
needs every rank in the same graph at the same size, and in the replay region at the
same replay size. So before each step every rank offers its numbers and all take the
maximum of each (one all-reduce of eight integers; the last two, below, say where the
ranks meet):

* whether it must run without graphs (a warm-up step, or a fallback of its own for
  this step): then no rank uses graphs, and where it was a fallback each rank that
  would have used them counts one too;
* its token count: every rank pads its main layers to the size that fits the largest
  rank's, a graph size, or that count itself where no graph fits (then every rank is
  eager, padded to it);
* whether it has rows to trim (a prefill longer than the window): in a step without
  graphs one rank's trimming makes every rank trim (a rank with nothing to trim runs
  all its rows as replay rows);
* its replay rows: every rank pads its replay rows to the size that fits the largest
  rank's;
* whether its batch cannot run as one FULL graph (not laid out for one, or not a
  uniform decode where attention needs that): then no rank runs FULL, every rank
  takes the other graphs of the agreed size (pieces, or none in a mode without);
* whether it failed before the agreement (a stale batch, a fallback under ``strict``),
  as its rank plus one: then every rank raises :class:`RankFailed` naming it, instead
  of waiting in a collective of the step that rank will not join.

Where the ranks meet is the other host collective of the group, capture, offered as
its number and its negative: a rank capturing while another runs a step sees both,
and every rank raises :class:`RanksApart` instead of waiting in a collective the
other never joins.

With ``debug_check_ranks`` the tensor-parallel ranks, which agree on nothing else per
step, say ahead of it whether one gave the step up (:func:`agree_step`): its peers then
give it up in their own agreements, so that no rank of either group runs it.

From these every rank derives the same decision (decide.plan_step). An idle rank
takes part through a dummy step of one token, padded to the agreed size. The group is
a CPU (gloo) group (the backend refuses another): the numbers are the host's, and a
device collective would make the host wait for the device on every step.
"""
from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

import torch

from ..parallel import check_same_point, gathered
from ..rank_errors import RankFailed, RanksApart, mark_told, told

log = logging.getLogger("replay_backend")


@dataclass(frozen=True)
class Agreement:
    """What every rank of the data-parallel group takes for this step."""

    graphs: bool  # every rank may use graphs
    tokens: int  # the largest rank's token count
    trimmable: bool  # some rank has a prefill longer than the window
    replay_rows: int  # the largest rank's replay rows
    full: bool = True  # every rank's batch may run as one FULL graph
    failed_rank: int | None = None  # a rank (the highest) that failed the step before agreeing
    fell_back: bool = False  # some rank gave up graphs for this step as a fallback (then graphs is False)


class Meeting(enum.IntEnum):
    """Where the ranks of a data-parallel group meet on the host."""

    STEP = 1
    CAPTURE = 2


def agree(group, graphs: bool, tokens: int, trimmable: bool, replay_rows: int, full: bool = False,
          failed: bool = False, meeting: Meeting = Meeting.STEP, fell_back: bool = False) -> Agreement:
    """All-reduce (max) this rank's offer over ``group``; returns what every rank takes.
    ``failed``: this rank raises after the agreement instead of running the step;
    ``fell_back``: this rank gives up graphs for the step as a fallback (``graphs``
    False), which the first number says as 2, above a plain "no graphs" (1)."""
    import torch.distributed as dist

    me = dist.get_rank(group) + 1 if failed else 0
    no_graphs = 2 if fell_back else int(not graphs)
    offer = torch.tensor([no_graphs, tokens, int(trimmable), replay_rows, int(not full), me,
                          meeting, -meeting], dtype=torch.int64)
    dist.all_reduce(offer, op=dist.ReduceOp.MAX, group=group)
    no_graphs, tokens, trimmable, rows, no_full, failed_rank, latest, neg_earliest = offer.tolist()
    if latest != -neg_earliest:
        error = RanksApart(f"dsv41_replay: the data-parallel ranks are not at the same point: this rank "
                           f"{'captures graphs' if meeting is Meeting.CAPTURE else 'runs a step'} while another "
                           f"{'runs a step' if meeting is Meeting.CAPTURE else 'captures graphs'}: every rank calls "
                           "capture() at the same point, after the same steps, before any serves")
        mark_told(error)  # every rank raises it: reported again, it is no new failure
        raise error
    return Agreement(not no_graphs, int(tokens), bool(trimmable), int(rows), not no_full,
                     int(failed_rank) - 1 if failed_rank else None, no_graphs == 2)


def tp_peer_failed(group, failed: bool) -> RankFailed | None:
    """With ``debug_check_ranks``, ahead of each step: whether this rank (``failed``, in
    ``fail_step``) or a tensor-parallel peer gave up the step. Returns the
    ``RankFailed`` naming the peer for the others to raise (having told their own
    data-parallel ranks first), else None."""
    import torch.distributed as dist

    every = gathered({"step given up": failed}, group)
    check_same_point(every, group)
    peer = next((r for r, p in enumerate(every) if p["step given up"]), None)
    if failed or peer is None:
        return None
    error = RankFailed(f"dsv41_replay: tensor-parallel rank {dist.get_process_group_ranks(group)[peer]} failed "
                       "this step before running it (its own error says why), so no rank runs it: the step's "
                       "collectives would wait for that rank")
    mark_told(error)
    return error


def agree_step(dp_group, tp_group, graphs: bool, tokens: int, trimmable: bool, replay_rows: int,
               full: bool, fell_back: bool = False) -> Agreement | None:
    """The step's agreement (None without data-parallel ranks, ``dp_group`` None),
    raising :class:`RankFailed` where a rank gave the step up. ``tp_group`` (with
    ``debug_check_ranks``): the tensor-parallel ranks first say whether one gave it up,
    so that its peers give it up in their own data-parallel agreements too and no rank
    of either group runs it."""
    peer_failed = tp_peer_failed(tp_group, False) if tp_group is not None else None
    agreement = None
    if dp_group is not None:
        agreement = agree(dp_group, graphs, tokens, trimmable, replay_rows, full, failed=peer_failed is not None,
                          fell_back=fell_back)
        if peer_failed is None:
            check_no_rank_failed(agreement)
    if peer_failed is not None:
        raise peer_failed
    return agreement


def give_up_step(dp_group, tp_group, error: BaseException) -> None:
    """This rank gives up its step with ``error``: it meets its ranks where
    :func:`agree_step` does, as failed, once per error (a server may report it again)."""
    if not told(error) and tp_group is not None:
        tp_peer_failed(tp_group, True)
    if dp_group is not None:
        tell_failed(dp_group, error)
    mark_told(error)


def meet_to_capture(group) -> None:
    """Every rank of ``group`` is about to capture: raises :class:`RanksApart` on each
    where some rank runs a step instead."""
    agree(group, False, 0, False, 0, meeting=Meeting.CAPTURE)


def tell_failed(group, error: BaseException) -> None:
    """Join this step's agreement over ``group`` as failed, once per ``error``: every
    other rank raises :class:`RankFailed` naming this one. A failure to tell (a peer
    gone too) is logged: the caller raises its own error, the one to see."""
    if told(error):
        return
    mark_told(error)
    try:
        agree(group, False, 0, False, 0, failed=True)
    except Exception as e:  # noqa: BLE001
        log.warning("dsv41_replay: telling the data-parallel ranks that this rank failed its step failed too: "
                    "%s: %s", type(e).__name__, e)


def check_no_rank_failed(agreement: Agreement) -> None:
    """Raise :class:`RankFailed` where another rank gave up the step before agreeing."""
    if agreement.failed_rank is not None:
        error = RankFailed(f"dsv41_replay: data-parallel rank {agreement.failed_rank} failed this step before the "
                           "ranks agreed on it (its own error says why), so no rank runs it: the step's collectives "
                           "would wait for that rank")
        mark_told(error)
        raise error
