"""The replay layers' attention where their region stays in the main graph.

Where the backend does not cut the replay region out (``decoder_replay=false``, or a
region the passes refuse), the replay layers run inside the main graph on every row.
They must still read the batch as the replay layers read it (``AttnView.replay``: the
floor applies), and inside captured pieces the boundary markers are the identity, so
each of their attention pieces, which run eagerly between the pieces, points
attention at that view around its call.
"""
from __future__ import annotations

from torch import nn

from ..forward_context import get_forward_context


class RegionAttention(nn.Module):
    """An attention piece of the replay layers, run with the replay layers' view."""

    def __init__(self, piece: nn.Module) -> None:
        super().__init__()
        self.piece = piece

    def forward(self, *args):
        ctx = get_forward_context()
        plan = ctx.plan  # in a FULL step the graph that reads the view is the step's
        saved = ctx.point_at(ctx.region_view, plan.region_read_by if plan is not None else None)
        try:
            return self.piece(*args)
        finally:
            ctx.active = saved
