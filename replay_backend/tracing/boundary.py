"""The decoder-replay boundary markers: a small API any model can use.

A model marks its replay region with two calls::

    hidden, residual, positions = replay_begin(hidden, residual, positions, window=W)
    ... replay layers: row-local work and attention ops only ...
    (out,) = replay_end(out)

Every tensor passed to ``replay_begin`` has the token count as its first dimension,
and the region may read nothing else that is row-indexed (weights are fine). The
region's results leave through ``replay_end``, again one row per token.

The markers are custom ops so that Dynamo keeps them in the traced graph, where the
backend's pass finds the region and replaces it with the trim-and-redispatch op. In
an uncompiled run they implement the eager behaviours:

* ``off``: identity (the replay layers run on the whole batch);
* ``parent``: ``replay_begin`` gathers the replay rows and points attention at the
  replay batch; ``replay_end`` scatters back into zeros that nobody reads.
"""
from __future__ import annotations

import torch

from .. import torch_compat
from ..kv_cache import MAX_MODEL_LEN
from ..forward_context import get_forward_context, has_forward_context
from ..passes.roles import declare_row_local

BEGIN_OP = "dsv41_replay::replay_begin"
END_OP = "dsv41_replay::replay_end"


def _uncompiled_context():
    """The step's forward context where the model runs uncompiled, else None: in a
    compiled model (its plan set) the backend runs the region and points attention at
    the replay layers' view itself, and the markers are the identity."""
    if not has_forward_context():
        return None
    ctx = get_forward_context()
    return ctx if ctx.plan is None else None


def _gathers(ctx) -> bool:
    return ctx.eager_replay == "parent" and ctx.batch.has_trimmable_rows


@torch.library.custom_op(BEGIN_OP, mutates_args=(),
                          tags=torch_compat.step_dependent_tags())
def _replay_begin(xs: list[torch.Tensor], window: int = 0) -> list[torch.Tensor]:
    ctx = _uncompiled_context()
    if ctx is None:
        return [x.clone() for x in xs]
    if not _gathers(ctx):
        ctx.point_at(ctx.batch.region_view)  # every row, read as the replay layers read it
        return [x.clone() for x in xs]
    rep = ctx.batch.replay
    ctx.point_at(rep.view)  # restored by replay_end
    return [x.index_select(0, rep.rows_t) for x in xs]


@_replay_begin.register_fake
def _(xs, window=0):
    return [torch.empty_like(x) for x in xs]


@torch.library.custom_op(END_OP, mutates_args=(),
                          tags=torch_compat.step_dependent_tags())
def _replay_end(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    ctx = _uncompiled_context()
    if ctx is None:
        return [x.clone() for x in xs]
    ctx.active = ctx.batch.view
    if not _gathers(ctx):
        return [x.clone() for x in xs]
    n = ctx.batch.num_tokens
    rows = ctx.batch.replay.rows_t
    return [x.new_zeros((n, *x.shape[1:])).index_copy_(0, rows, x) for x in xs]


@_replay_end.register_fake
def _(xs):
    return [torch.empty_like(x) for x in xs]


# In compiled steps the markers are the identity (the backend replaces them where it
# trims), so they are row-local where they stay: in a graph whose region was refused.
declare_row_local(BEGIN_OP, END_OP)


def replay_begin(*tensors: torch.Tensor, window: int) -> tuple[torch.Tensor, ...]:
    """Mark the entry of the replay region; returns the region's row-indexed inputs.

    ``window`` is the model's sliding window W, an int in ``[1, MAX_MODEL_LEN]``: the
    backend needs it for the replay capture sizes and to validate the trim threshold.
    It is checked here, so that a bad one names itself instead of surfacing as an
    empty replay batch while graphs are captured.
    """
    if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= MAX_MODEL_LEN:
        raise ValueError(f"replay_begin: window must be the model's sliding window, an int in [1, {MAX_MODEL_LEN}] "
                         f"(MAX_MODEL_LEN), got {type(window).__name__} {window!r}")
    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise ValueError(f"replay_begin: needs the region's row-indexed tensors, got "
                         f"{[type(t).__name__ for t in tensors]}")
    return tuple(torch.ops.dsv41_replay.replay_begin(list(tensors), window))


def replay_end(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Mark the exit of the replay region; returns its row-indexed outputs."""
    return tuple(torch.ops.dsv41_replay.replay_end(list(tensors)))
