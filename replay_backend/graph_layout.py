"""A batch's metadata laid out for FULL graphs: one address and shape per padded size.

A FULL graph replays the kernels of the step it was captured on, attention's among
them, so the metadata attention reads must sit where it sat then, in the same shapes,
whatever the step holds. ``build_step_batch(graph_rows=...)`` lays it out so: every
field at its capacity for ``graph_rows`` tokens, the rows past the step's own padded.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

import torch

from .kv_cache import CacheLayout

if TYPE_CHECKING:  # pragma: no cover
    from .batch import AttnView, ViewField


@dataclass(frozen=True)
class GraphFields:
    """A view's device metadata at the fixed layout of a padded size ``rows``: the
    same addresses and shapes in every step padded to it, so a FULL graph captured on
    one step reads the next one's. The rows after the step's own are padding: their
    slots are the pad slot and their per-view field entries zero (which a model's
    field must make mean "nothing to do"). Attention inside a FULL graph reads only
    this, never the view's host fields (``num_tokens``, ``seq_lens``, ...): those are
    the captured step's."""

    rows: int
    slot_mapping: torch.Tensor  # [rows]
    derived: Mapping[str, torch.Tensor]  # each ViewField at its capacity for ``rows`` tokens
    max_model_len: int  # the longest sequence a row may belong to (the cache layout's)


@dataclass(frozen=True)
class GraphLayout:
    """A batch's metadata laid out for every padded size up to ``rows`` at once: each
    field at its capacity for ``rows`` tokens, so that the first ``p`` entries (the
    first ``capacity(p)`` of a per-view field) are the layout of padded size ``p``."""

    rows: int
    max_requests: int  # requests a step of ``rows`` tokens may hold (capacities)
    slot_mapping: torch.Tensor  # [rows]
    derived: Mapping[str, torch.Tensor]  # flat, at capacity for ``rows``
    fields: Mapping[str, "ViewField"]
    max_model_len: int
    _views: dict = field(default_factory=dict, compare=False, repr=False)

    def views(self, base: "AttnView", size: int) -> tuple["AttnView", "AttnView"]:
        """``base`` (the batch's whole view) and its replay layers' twin, at padded size
        ``size`` with their graph fields."""
        got = self._views.get(size)
        if got is None:
            if size > self.rows:
                raise ValueError(f"padded size {size} is beyond the batch's graph layout of {self.rows} rows")
            reqs = min(size, self.max_requests)
            derived = {name: self.derived[name][:f.capacity(size, reqs)].view(-1, f.width)
                       for name, f in self.fields.items()}
            fields = GraphFields(size, self.slot_mapping[:size], derived, self.max_model_len)
            view = dataclasses.replace(base, graph=fields)
            object.__setattr__(view, "derived", base.derived)
            got = self._views[size] = (view, view.for_replay_layers())
        return got


def graph_max_requests(rows: int, layout: CacheLayout) -> int:
    """The requests a graph layout of ``rows`` holds: as many as a served batch may
    have, one per cache block, each of at least one row."""
    return min(rows, layout.num_blocks)


class GraphPadding:
    """The rows a graph layout adds after a step's ``t`` own: token 0 at position 0,
    writing the pad slot, as padded rows do in every graph."""

    def __init__(self, rows: int, t: int, layout: CacheLayout, requests: int) -> None:
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < t:
            raise ValueError(f"graph_rows={rows!r}: the graph layout must hold the step's {t} tokens")
        self.rows, self.t, self.layout = rows, t, layout
        self.max_requests = graph_max_requests(rows, layout)
        # Per-request parts past their capacity would move every later field: the graph
        # would read them where another step's lie.
        if requests > self.max_requests:
            raise ValueError(f"graph_rows={rows}: a graph layout holds at most {self.max_requests} requests (its "
                             f"rows, or the cache's {layout.num_blocks} blocks), the step has {requests}")

    def pad(self, parts: list[torch.Tensor], fields) -> list[torch.Tensor]:
        """Every part at its capacity for ``rows`` tokens: the count and rows, ids,
        positions, slots, logits indices, replay slots and positions, then two parts
        per field (the whole view's, the kept rows'). Slots pad with the pad slot, a
        per-row field's whole part with its values for the padding rows, the rest with
        zeros."""
        rows, extra = self.rows, self.rows - self.t
        pos = torch.zeros(extra, dtype=torch.int64)
        slots = torch.full((extra,), self.layout.pad_slot, dtype=torch.int64)
        lead = [(1 + rows, None), (rows, None), (rows, None), (rows, slots),
                (self.max_requests, None), (rows, slots), (rows, None)]
        for name, f in fields:
            cap = f.capacity(rows, self.max_requests)
            if cap is None:
                raise ValueError(f"a graph layout needs every ViewField bounded: {name!r} has no max_rows")
            lead += [(cap, f.build(pos, slots, self.layout) if f.per_row else None), (cap, None)]
        out = []
        for x, (cap, fill) in zip(parts, lead):
            if fill is not None:
                x = torch.cat([x, fill])
            if cap > x.shape[0]:
                x = torch.cat([x, x.new_zeros(cap - x.shape[0])])
            out.append(x)
        return out
