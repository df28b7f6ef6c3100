"""A step's batch: the views attention reads, the replay batch, the model's own fields.

Everything here is built on the host from plain integers (the requests, requests.py),
so attention and the trim op never need a device-to-host sync to learn a request's
layout, and it reaches the device by asynchronous copies, so building a step never
waits for the step before it.
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

# int64_tensor: this module's name too, which the model's view fields import.
from .batch_inputs import built_field, check_inputs, int64_tensor, per_row, token_ids_tensor  # noqa: F401
from .graph_layout import GraphFields, GraphLayout, GraphPadding, graph_max_requests
from .kv_cache import CacheLayout
# The requests' names are this module's too: a step's batch is built from them.
from .requests import (MAX_POSITION, ReplayRows, RequestChunk, check_blocks, kept_len,  # noqa: F401
                       replay_floor, replay_rows, replay_rows_for, validate_requests)
from .step_metadata import MetadataBuffer, aligned_fields, to_device


@dataclass(frozen=True)
class AttnView:
    """What an attention op reads: row layout of the rows it is given.

    ``query_start_loc[i]:query_start_loc[i+1]`` are request i's rows; they hold the
    *last* ``n_i`` positions of its sequence (``seq_len - n_i .. seq_len - 1``).
    ``kv_start[i]`` is the replay floor (0 = none), which only the replay layers apply:
    ``replay`` says the view is read by them (the replay batch, or the whole batch
    while the replay region runs on every row). ``trimmed`` says its rows are the
    replay batch's (each request's kept rows), not the whole batch's.
    """

    num_tokens: int
    query_start_loc: tuple[int, ...]
    seq_lens: tuple[int, ...]
    kv_start: tuple[int, ...]
    cache_base: tuple[int, ...]
    slot_mapping: torch.Tensor  # [num_tokens] int64: where each row writes its KV
    replay: bool = False
    trimmed: bool = False
    # Set on the view of a step run at a padded size within its batch's graph layout
    # (``StepBatch.graph``): the fixed-layout metadata that attention reads inside a
    # FULL graph, where no host value of the step may be read.
    graph: "GraphFields | None" = None
    # Derived device metadata (the model's ViewFields, e.g. attention kernel row blocks),
    # built once per step and shared by every layer, and by the whole batch's two views.
    derived: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)

    def for_replay_layers(self) -> "AttnView":
        """The same rows as read by the replay layers: the floor applies. It shares this
        view's derived metadata, which the rows alone determine."""
        view = dataclasses.replace(self, replay=True)
        object.__setattr__(view, "derived", self.derived)
        return view


@dataclass(frozen=True)
class ReplayBatch:
    """The rows the replay layers need, as indices into the step's batch."""

    rows: tuple[int, ...]  # ascending and unique (the trim op's scatter searches them)
    rows_t: torch.Tensor  # [num_rows] int64 on the model's device
    # [1 + num_rows]: the row count, then ``rows_t`` (a view of the same memory), so the
    # trim op stages its index data with one device copy.
    count_rows: torch.Tensor
    positions: torch.Tensor  # [num_rows]
    view: AttnView

    @property
    def num_rows(self) -> int:
        return len(self.rows)


@dataclass(frozen=True)
class StepBatch:
    requests: tuple[RequestChunk, ...]
    window: int
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    logits_indices: torch.Tensor  # [R]: each request's last row
    view: AttnView  # the whole batch, as the layers before the replay region read it
    replay: ReplayBatch
    # The whole batch as the replay layers read it when they run on every row.
    region_view: AttnView
    # Set when the device fields live in a runner's MetadataBuffer: valid while the
    # buffer is still at this generation (step_metadata.py).
    metadata: MetadataBuffer | None = field(default=None, compare=False, repr=False)
    generation: int = 0
    layout: CacheLayout | None = None  # the cache layout its slots address
    # Who built it (``build_step_batch(owner=...)``, a runner's build_batch: the runner):
    # the blocks it names are that owner's, and only its owner may run it. The identity
    # only: what an owner checks is the owner's business.
    owner: object | None = field(default=None, compare=False, repr=False)
    # Every row writes its KV to the pad slot (a dummy step's): it writes no block.
    pad_writes: bool = False
    # Its metadata also laid out for FULL graphs (``build_step_batch(graph_rows=...)``).
    graph: GraphLayout | None = field(default=None, compare=False, repr=False)

    def check_current(self) -> None:
        """Raise if a later build overwrote this batch's device metadata."""
        if self.metadata is not None:
            self.metadata.check(self.generation)

    @property
    def num_tokens(self) -> int:
        return self.view.num_tokens

    @property
    def has_trimmable_rows(self) -> bool:
        """True when some request keeps fewer rows than it has (a prefill longer than W)."""
        return self.replay.num_rows < self.num_tokens


@dataclass(frozen=True)
class ViewField:
    """Per-view device metadata a model's attention reads (``AttnView.derived[name]``),
    built on the host and sent in the step's one metadata copy instead of in a copy of
    its own inside the first attention op, on the critical path. The view holds it as
    ``[-1, width]``. Two kinds:

    * per view (``per_row=False``): ``build(query_start_loc, seq_lens, kv_start,
      cache_base, window)`` -> a 1-D int64 host tensor, built for each view from its
      layout; ``max_rows(max_tokens, max_requests)`` bounds its rows for a step of at
      most that many tokens and requests (without it the backend cannot size a fixed
      metadata buffer: see ``metadata_in_place``);
    * per row (``per_row=True``): ``build(positions, slots, layout)`` -> ``width``
      values per row of the whole batch, from its positions and slots (int64 host
      tensors; a dummy step's slots are all the pad slot) and the cache layout; the
      replay batch's view holds its kept rows' values. A model derives per-token cache
      slots this way (e.g. the slots of a compressed cache)."""

    build: Callable[..., torch.Tensor]
    width: int = 1
    per_row: bool = False
    max_rows: Callable[[int, int], int] | None = None

    def __post_init__(self) -> None:
        if not callable(self.build):
            raise ValueError(f"ViewField.build must be callable, got {self.build!r}")
        if isinstance(self.width, bool) or not isinstance(self.width, int) or self.width < 1:
            raise ValueError(f"ViewField.width must be an integer >= 1, got {self.width!r}")
        if self.max_rows is not None and not callable(self.max_rows):
            raise ValueError(f"ViewField.max_rows must be callable (max_tokens, max_requests) -> rows, got "
                             f"{self.max_rows!r}")

    def capacity(self, max_tokens: int, max_requests: int) -> int | None:
        """Elements this field takes in one view of a step of at most ``max_tokens``
        tokens and ``max_requests`` requests; None where it has no bound."""
        if self.per_row:
            return self.width * max_tokens
        return None if self.max_rows is None else self.width * self.max_rows(max_tokens, max_requests)


def build_step_batch(requests, token_ids, blocks: list[int], layout: CacheLayout,
                     window: int, device, max_num_batched_tokens: int | None = None,
                     inputs_in_metadata: bool = False, metadata: MetadataBuffer | None = None,
                     view_fields: Mapping[str, ViewField] | None = None, *, pad_writes: bool = False,
                     owner: object | None = None, graph_rows: int | None = None) -> StepBatch:
    """Host-built metadata for one step. ``token_ids[i]`` are request i's new tokens (a
    list of ints or a 1-D tensor) and ``blocks[i]`` its cache block.

    ``inputs_in_metadata``: the token ids and positions travel in the metadata's one
    copy too, as views of it, instead of in two copies of their own. Only for a model
    that is not called through Dynamo (a direct call, dispatch/direct.py): Dynamo would
    trace the views' storage offsets as symbols of a new graph.

    ``metadata``: the copy goes into this fixed buffer (the serving backend's) instead
    of fresh device memory, and the batch is valid until the buffer's next use.

    ``view_fields``: the model's own device metadata (:class:`ViewField`), for the whole
    batch's view and the replay batch's.

    ``pad_writes``: every row writes its KV to the pad slot (a dummy step's), so its
    requests may share a block (they only read it).

    ``owner``: who builds it (a runner's ``build_batch`` passes the runner), carried as
    ``StepBatch.owner`` for the owner to check that a batch it runs is its own.

    ``graph_rows``: lay the metadata out for FULL graphs of every padded size up to
    this many tokens (``StepBatch.graph``): every field at its capacity for them, the
    rows past the step's own padded (the pad slot, zeros), so each field has one
    address and shape per padded size, whatever the step holds."""
    requests = tuple(requests)
    validate_requests(requests, layout, window, max_num_batched_tokens)
    blocks = check_inputs(requests, token_ids, blocks, layout, pad_writes)

    qlens = [r.query_len for r in requests]
    base = tuple(layout.base(b) for b in blocks)
    qsl = list(itertools.accumulate(qlens, initial=0))
    t = qsl[-1]
    # A row's position less its index is one number per request, and so is its slot
    # less its position (the request's block base): each spread to its request's rows
    # in a few host ops whatever the request count, where ops per request would put
    # hundreds before a many-request step's first kernel.
    pos = torch.arange(t, dtype=torch.int64) + per_row(qsl, [r.seq_len - q - a
                                                               for r, q, a in zip(requests, qlens, qsl)])
    if pad_writes:
        slots = torch.full((t,), layout.pad_slot, dtype=torch.int64)
    else:
        slots = pos + per_row(qsl, base)
    floors = tuple(replay_floor(r, window) for r in requests)
    seq_lens = tuple(r.seq_len for r in requests)
    rows, kqsl = replay_rows(requests, window)
    rows_cpu = int64_tensor([len(rows), *rows])  # the count, then the rows
    kept = rows_cpu[1:]
    ids = token_ids_tensor(token_ids)
    last = int64_tensor([q - 1 for q in qsl[1:]])
    fields = tuple((view_fields or {}).items())
    extra = []
    for name, f in fields:
        if f.per_row:
            whole = built_field(name, f.build(pos, slots, layout), t, f.width)
            extra += [whole, whole.view(-1, f.width)[kept].reshape(-1)]
        else:
            extra += [built_field(name, f.build(q, seq_lens, floors, base, window), width=f.width)
                      for q in (qsl, kqsl)]
    # One copy to the device for the metadata, every field a view of it, and for the
    # inputs too where the caller allows (each copy is host time before the first kernel).
    # The count and rows come first: in a metadata buffer they sit at its head, where the
    # trim op's gather graph reads them (step_metadata.py).
    parts = [rows_cpu, slots, last, slots[kept], pos[kept], *extra]
    # A graph layout holds the inputs' places whether or not they travel there, so
    # that its fields sit at the same offsets for every caller.
    inputs_placed = inputs_in_metadata or graph_rows is not None
    if inputs_placed:
        parts[1:1] = [ids, pos]
    lens = [x.shape[0] for x in parts]
    grown = None
    if graph_rows is not None:
        grown = GraphPadding(graph_rows, t, layout, len(requests))
        parts = grown.pad(parts, fields)
    placed = aligned_fields(parts, device, metadata)
    real = [x[:n] for x, n in zip(placed, lens)]
    if inputs_placed:
        count_rows, placed_ids, placed_pos, slots, last, rslots, rpos, *extra = real
    else:
        count_rows, slots, last, rslots, rpos, *extra = real
    if inputs_in_metadata:
        ids, pos = placed_ids, placed_pos
    else:
        ids, pos = to_device(ids, device), to_device(pos, device)
    view = AttnView(t, tuple(qsl), seq_lens, floors, base, slots)
    replay_view = AttnView(len(rows), tuple(kqsl), seq_lens, floors, base, rslots, replay=True, trimmed=True)
    for k, (name, f) in enumerate(fields):
        view.derived[name] = extra[2 * k].view(-1, f.width)
        replay_view.derived[name] = extra[2 * k + 1].view(-1, f.width)
    replay = ReplayBatch(tuple(rows), count_rows[1:], count_rows, rpos, replay_view)
    graph = None
    if grown is not None:  # the slots and the whole view's fields, at their capacities
        first = 3  # the slots' part
        graph = GraphLayout(graph_rows, grown.max_requests, placed[first],
                            {name: placed[first + 4 + 2 * k] for k, (name, _) in enumerate(fields)},
                            dict(fields), layout.max_model_len)
    return StepBatch(requests, window, ids, pos, last, view, replay, view.for_replay_layers(), metadata,
                     metadata.generation if metadata is not None else 0, layout, owner=owner, pad_writes=pad_writes,
                     graph=graph)


def dummy_step_batch(num_tokens: int, layout: CacheLayout, window: int, device, context: int = 0,
                     view_fields: Mapping[str, ViewField] | None = None, *, graph_rows: int | None = None,
                     metadata: MetadataBuffer | None = None, per_request: int | None = None) -> StepBatch:
    """A batch of ``num_tokens`` rows for warm-up and capture, every KV write aimed at
    the pad slot: requests of at most ``window`` tokens (so every row is a replay row),
    or of ``per_request`` tokens each (a uniform decode's, which may be longer than the
    window: a FULL graph's step never trims). The first request's rows follow
    ``context`` positions, whose cache entries its attention reads (whatever they hold:
    the outputs are thrown away). ``graph_rows`` and ``metadata``: as
    ``build_step_batch``'s (a FULL graph's capture); laid out so, the requests are no
    more than the layout holds (``graph_max_requests``), longer than the window where
    they must be."""
    if layout.max_model_len - context < 1:
        raise ValueError(f"context={context} leaves no room in max_model_len={layout.max_model_len}")
    w = per_request or window
    if graph_rows is not None and per_request is None:
        w = max(w, -(-num_tokens // graph_max_requests(graph_rows, layout)))
    lens, left = [], num_tokens
    while left > 0:  # the first request after the context, the rest from position 0
        lens.append(min(w, left, layout.max_model_len - (0 if lens else context)))
        left -= lens[-1]
    reqs = [RequestChunk(f"__dummy{i}", q, q + (context if i == 0 else 0)) for i, q in enumerate(lens)]
    return build_step_batch(reqs, [[0] * r.query_len for r in reqs], [0] * len(reqs), layout, window, device,
                            view_fields=view_fields, pad_writes=True, graph_rows=graph_rows, metadata=metadata)
