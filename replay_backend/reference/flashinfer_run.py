"""Running FlashInfer's plans (attention_flashinfer.py makes them): inside the
attention op, between graph pieces and inside graphs. A view's plans wait in its
``derived`` metadata; each part's wrapper computes one attention state, rows permuted
where the part's requests need them in another order, and :func:`merge` combines the
states with the sink into the layer's output."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention_merge import merge
from .flashinfer_staging import Wrapper

# Where a view's plans wait for the attention ops (``AttnView.derived``): the plans the
# layers about to run read, and every plan made for the view, by slot.
PLAN = "flashinfer_plan"
PLANS = "flashinfer_plans"


@dataclass(frozen=True)
class Planned:
    """One part planned: the wrapper to run, the rows it covers (the view's, or a
    graph's size), and on the device their permutation and its inverse (None: view
    order; flashinfer_batches.PartLayout)."""

    wrapper: Wrapper
    rows: int
    perm: torch.Tensor | None
    unperm: torch.Tensor | None


def attend(q: torch.Tensor, out: torch.Tensor, swa: torch.Tensor, glob: torch.Tensor | None, ratio: int,
           view, floored: bool, sink: torch.Tensor, in_full_graph: bool = False) -> None:
    """Write attention for the planned rows of ``q`` into ``out`` (both [rows, heads,
    D]): the SWA state and the global state, merged with the sink. ``in_full_graph``:
    inside a FULL step's graph, which may read only plans of its size."""
    plans = _plans_of(view, in_full_graph)
    if plans is None:
        raise RuntimeError("attention_impl='flashinfer' but this view was not planned: the runner's "
                           "ForwardContext must carry prepare_view=FlashInferAttention.prepare")
    first = plans.get(("swa", floored))
    if first is None:  # only the replay layers read floored keys
        raise RuntimeError("attention_impl='flashinfer': the replay layers read the whole batch, which was "
                           "planned for the main layers only (prepare_main); a runner whose replay layers "
                           "run outside a replay region plans it with prepare(view, None)")
    qn = q[:first.rows]
    # Both states in one allocation each: the host's time per layer is the step's
    # critical path where the rows are few.
    states = 1 if glob is None else 2
    o = torch.empty((states, *qn.shape), dtype=q.dtype, device=q.device)
    lse = torch.empty((states, *qn.shape[:2]), dtype=torch.float32, device=q.device)
    _run(first, qn, swa, o[0], lse[0])
    if glob is None:
        merge(out[:first.rows], o[0], lse[0], None, None, sink)
        return
    second = plans[("global", ratio)]
    _run(second, qn, glob, o[1], lse[1])
    merge(out[:first.rows], o[0], lse[0], o[1], lse[1], sink, second.unperm)


def _plans_of(view, in_full_graph: bool = False) -> dict | None:
    """The plans attention reads for ``view``. A view of a step laid out for FULL graphs
    reads the plans of its graph's size where the step made them (a FULL step, before
    its graph ran): inside the graph no host code points attention anywhere, so the
    plans are found by the view alone. Else the plans last pointed at (:data:`PLAN`),
    never inside a FULL graph: a plan made outside graphs moves with every plan."""
    g = view.graph
    if g is not None:
        graph_plans = view.derived.get(PLANS, {}).get(g.rows)
        if graph_plans and ("swa", view.replay) in graph_plans:
            return graph_plans
    if in_full_graph:
        raise RuntimeError(f"attention_impl='flashinfer': a FULL graph of {g.rows if g else '?'} rows reads a view "
                           f"({'the replay layers' if view.replay else 'the main layers'}') not planned at its size: "
                           "every view a FULL graph reads must be planned with prepare_view(view, size) before it")
    return view.derived.get(PLAN)


def _run(planned: Planned, q: torch.Tensor, cache: torch.Tensor, o: torch.Tensor, lse: torch.Tensor) -> None:
    """One part's state into ``o`` [rows, heads, D] and ``lse`` [rows, heads] (base-2
    log-sum-exp), its rows in the part's order (``planned.perm``)."""
    kv = cache.view(cache.shape[0], 1, 1, cache.shape[1])  # page size 1, one KV head, NHD
    planned.wrapper.run(q if planned.perm is None else q.index_select(0, planned.perm), (kv, kv), o, lse)
