"""The backend's custom ops: their names, schemas and kernels, in one module.

The passes find and emit them by these names and the runtime runs them; defining all
three here, on import, means an op exists wherever its name is used.

* ``replay_begin(Tensor[] xs, int window) -> Tensor[]`` and
  ``replay_end(Tensor[] xs) -> Tensor[]``: the boundary markers a model calls
  (``replay_backend.replay_begin`` / ``replay_end``). In a compiled model they are the
  identity, or gone where the backend cut the region out. Where the model runs
  uncompiled they point attention at the replay layers' view of the step (the whole
  batch, or in ``eager_replay="parent"`` the replay batch, whose rows ``replay_begin``
  gathers and ``replay_end`` scatters back into zeros nobody reads).
* ``trim_and_redispatch(Tensor[] rows, Tensor[] consts, Tensor(a!)[] outs) -> ()``:
  what the region pass puts where the region was; it runs the step's replay region
  (``ForwardContext.replay_runtime``) and writes its results into ``outs``, which the
  preceding graph piece allocated.
"""
from __future__ import annotations

import torch

from .compat import dynamo as compat_dynamo
from .forward_context import get_forward_context, has_forward_context
from .oplib import define_op, no_output
from .passes.roles import declare_row_local

BEGIN = "dsv41_replay::replay_begin"
END = "dsv41_replay::replay_end"
TRIM = "dsv41_replay::trim_and_redispatch"
# Tagged as reading per-step state: stock torch.compile keeps them out of its graphs.
_STEP_TAGS = compat_dynamo.step_dependent_tags()


def _uncompiled_context():
    """The step's forward context where the model runs uncompiled, else None: in a
    compiled model the backend runs the region and points attention at the replay
    layers' view itself, and the markers are the identity."""
    if not has_forward_context():
        return None
    ctx = get_forward_context()
    return None if ctx.compiled_step else ctx


def _gathers(ctx) -> bool:
    return ctx.eager_replay == "parent" and ctx.batch.has_trimmable_rows


@torch.library.custom_op(BEGIN, mutates_args=(), tags=_STEP_TAGS)
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


@torch.library.custom_op(END, mutates_args=(), tags=_STEP_TAGS)
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
declare_row_local(BEGIN, END)


def _trim_and_redispatch(rows: list[torch.Tensor], consts: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
    runtime = get_forward_context().replay_runtime
    if runtime is None:
        raise RuntimeError("trim_and_redispatch ran outside a dsv41_replay compiled model")
    runtime(rows, consts, outs)


trim_and_redispatch = define_op(TRIM, "(Tensor[] rows, Tensor[] consts, Tensor(a!)[] outs) -> ()",
                                _trim_and_redispatch, no_output, _STEP_TAGS)


def _declare_collectives() -> None:
    """Torch's functional all-reduce (and its wait) are row-local for the ranks of a
    tensor-parallel group: every rank holds the same rows, trims and pads them alike,
    and row i of the result sums row i of each rank's partial result. A collective
    across ranks that hold different rows (data parallelism) mixes requests and is a
    model's own op, declared by the model."""
    ns = getattr(torch.ops, "_c10d_functional", None)
    names = [f"_c10d_functional::{op}" for op in ("all_reduce", "wait_tensor") if ns is not None and hasattr(ns, op)]
    if names:
        declare_row_local(*names)


_declare_collectives()
