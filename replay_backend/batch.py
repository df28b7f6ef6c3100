"""Per-step batch metadata and the replay batch.

Everything here is built on the host from plain integers, so attention and the trim op
never need a device-to-host sync to learn a request's layout, and it reaches the device
by asynchronous copies, so building a step never waits for the step before it.
"""
from __future__ import annotations

import array
import dataclasses
import operator
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from .kv_cache import CacheLayout
from .step_metadata import MetadataBuffer, aligned_fields, to_device


# The largest length or position a request may give: past it a number is a typo, not a
# request (no cache could hold it), and it must fail here, not as an overflow or an
# allocation deep inside a step.
MAX_POSITION = 2 ** 31 - 1


def _is_index(val) -> bool:
    """An integer of any kind (numpy's too), not a float or a string."""
    try:
        operator.index(val)
    except TypeError:
        return False
    return True


@dataclass(frozen=True)
class RequestChunk:
    """One request's share of a step: ``query_len`` new tokens ending at ``seq_len``.

    ``keep_all`` marks a request that needs every row (e.g. prompt logprobs): it is
    never trimmed and keeps its normal windows. ``kv_start`` lets a runner that
    restored the request from a prefix cache set a later replay floor than
    ``seq_len - window``.
    """

    req_id: int | str
    query_len: int
    seq_len: int
    keep_all: bool = False
    kv_start: int | None = None

    def __post_init__(self) -> None:
        try:
            hash(self.req_id)
        except TypeError:
            raise ValueError(f"RequestChunk.req_id must be hashable (an int or a str), got "
                             f"{type(self.req_id).__name__} {self.req_id!r}") from None
        for name in ("query_len", "seq_len", "kv_start"):
            val = getattr(self, name)
            if val is None and name == "kv_start":
                continue
            if isinstance(val, bool) or not _is_index(val):
                raise ValueError(f"RequestChunk.{name} must be an int, got {type(val).__name__} {val!r} "
                                 f"(req_id={self.req_id!r})")
            if not -MAX_POSITION <= val <= MAX_POSITION:
                raise ValueError(f"RequestChunk.{name}={val} is beyond the limit of {MAX_POSITION} positions "
                                 f"(req_id={self.req_id!r})")
        if not isinstance(self.keep_all, bool):
            raise ValueError(f"RequestChunk.keep_all must be true or false, got {self.keep_all!r} "
                             f"(req_id={self.req_id!r})")

    @property
    def context_len(self) -> int:
        return self.seq_len - self.query_len


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


def kept_len(req: RequestChunk, window: int) -> int:
    return req.query_len if req.keep_all else min(req.query_len, window)


def replay_floor(req: RequestChunk, window: int) -> int:
    """First SWA position replay layers may read for this request (0 = no floor)."""
    if req.keep_all or req.query_len <= window:
        return 0
    floor = req.seq_len - window
    return max(floor, req.kv_start) if req.kv_start is not None else floor


def replay_rows(requests: list[RequestChunk] | tuple[RequestChunk, ...], window: int
                ) -> tuple[list[int], list[int]]:
    """Rows kept for the replay layers and their ``query_start_loc``.

    Each request keeps its last ``min(query_len, W)`` rows (all with ``keep_all``): with
    W=128, query lens [1, 250, 60] give rows
    ``[0] + [123..250] + [251..310]`` and ``query_start_loc [0, 1, 129, 189]``.
    """
    rows: list[int] = []
    qsl = [0]
    start = 0
    for req in requests:
        k = kept_len(req, window)
        rows.extend(range(start + req.query_len - k, start + req.query_len))
        qsl.append(qsl[-1] + k)
        start += req.query_len
    return rows, qsl


@dataclass(frozen=True)
class ReplayRows:
    """A step's replay batch as host data, from the step protocol alone: each
    request's query length, sequence length, keep-all flag and optional floor.

    ``rows`` index the step's flattened batch (request order, ascending); ``positions``
    are their sequence positions; ``query_start_loc`` splits them by request;
    ``kv_start`` is each request's bounded-replay floor (0 = none). Apply
    :meth:`take` to any per-token tensor (slot mappings, ids) to get its kept rows."""

    rows: tuple[int, ...]
    positions: tuple[int, ...]
    query_start_loc: tuple[int, ...]
    kv_start: tuple[int, ...]

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    def take(self, per_token: torch.Tensor) -> torch.Tensor:
        """The kept rows of a tensor indexed by the step's tokens (dim 0)."""
        index = torch.as_tensor(self.rows, dtype=torch.int64, device=per_token.device)
        return per_token.index_select(0, index)


def replay_rows_for(requests, window: int) -> ReplayRows:
    """The replay batch of a step of ``requests`` (RequestChunks) at sliding window
    ``window``: with W = 128, query lens ``[1, 250, 60]`` and seq lens
    ``[700, 250, 260]``, keeps rows ``[0] + [123..250] + [251..310]``, with
    ``query_start_loc [0, 1, 129, 189]`` and request 1's floor at position 122."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    rows, qsl = replay_rows(requests, window)
    positions: list[int] = []
    for r in requests:
        k = kept_len(r, window)
        positions.extend(range(r.seq_len - k, r.seq_len))
    return ReplayRows(tuple(rows), tuple(positions), tuple(qsl), tuple(replay_floor(r, window) for r in requests))


def validate_requests(requests, layout: CacheLayout, window: int,
                      max_num_batched_tokens: int | None = None) -> None:
    if not requests:
        raise ValueError("empty batch: a step needs at least one request")
    seen = set()
    total = 0
    for i, r in enumerate(requests):
        where = f"request {i} (req_id={r.req_id!r})"
        if r.req_id in seen:
            raise ValueError(f"{where}: req_id appears twice in one step")
        seen.add(r.req_id)
        if r.query_len < 1:
            raise ValueError(f"{where}: query_len must be >= 1, got {r.query_len}")
        if r.seq_len < r.query_len:
            raise ValueError(f"{where}: seq_len={r.seq_len} is shorter than query_len={r.query_len}")
        if r.seq_len > layout.max_model_len:
            raise ValueError(f"{where}: seq_len={r.seq_len} exceeds the cache's max_model_len="
                             f"{layout.max_model_len}")
        if r.kv_start is not None and not 0 <= r.kv_start < r.seq_len:
            raise ValueError(f"{where}: kv_start={r.kv_start} must lie in [0, seq_len={r.seq_len})")
        total += r.query_len
    if max_num_batched_tokens is not None and total > max_num_batched_tokens:
        raise ValueError(f"step has {total} tokens, more than max_num_batched_tokens="
                         f"{max_num_batched_tokens}")


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
                     owner: object | None = None) -> StepBatch:
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
    ``StepBatch.owner`` for the owner to check that a batch it runs is its own."""
    requests = tuple(requests)
    validate_requests(requests, layout, window, max_num_batched_tokens)
    for i, (r, toks) in enumerate(zip(requests, token_ids)):
        if len(toks) != r.query_len:
            raise ValueError(f"request {i}: {len(toks)} token ids for query_len={r.query_len}")
    if len(blocks) != len(requests):
        raise ValueError(f"{len(blocks)} cache blocks for {len(requests)} requests")
    blocks = check_blocks(requests, blocks, layout, shared=pad_writes)

    qlens = [r.query_len for r in requests]
    base = tuple(layout.base(b) for b in blocks)
    qsl = [0]
    for q in qlens:
        qsl.append(qsl[-1] + q)
    # Tensor ops on the host rather than per-token Python: a 16K-token step's metadata
    # is on the critical path before its first kernel.
    # One arange per request, not ``repeat_interleave`` of the bases: that one runs a
    # parallel region for two or more requests, which on a host whose cores are busy
    # waits for a scheduler time slice (milliseconds), and is no faster when idle.
    pos = torch.cat([torch.arange(r.seq_len - q, r.seq_len, dtype=torch.int64)
                     for r, q in zip(requests, qlens)])
    if pad_writes:
        slots = torch.full((qsl[-1],), layout.pad_slot, dtype=torch.int64)
    else:
        slots = torch.cat([torch.arange(b + r.seq_len - q, b + r.seq_len, dtype=torch.int64)
                           for r, q, b in zip(requests, qlens, base)])
    floors = tuple(replay_floor(r, window) for r in requests)
    seq_lens = tuple(r.seq_len for r in requests)
    rows, kqsl = replay_rows(requests, window)
    rows_cpu = int64_tensor([len(rows), *rows])  # the count, then the rows
    kept = rows_cpu[1:]
    ids = torch.cat([torch.as_tensor(toks, dtype=torch.int64).reshape(-1) for toks in token_ids])
    last = int64_tensor([q - 1 for q in qsl[1:]])
    fields = tuple((view_fields or {}).items())
    extra = []
    for name, f in fields:
        if f.per_row:
            whole = f.build(pos, slots, layout)
            extra += [whole, whole.view(-1, f.width)[kept].reshape(-1)]
        else:
            extra += [f.build(q, seq_lens, floors, base, window) for q in (qsl, kqsl)]
    # One copy to the device for the metadata, every field a view of it, and for the
    # inputs too where the caller allows (each copy is host time before the first kernel).
    # The count and rows come first: in a metadata buffer they sit at its head, where the
    # trim op's gather graph reads them (step_metadata.py).
    parts = [rows_cpu, slots, last, slots[kept], pos[kept], *extra]
    if inputs_in_metadata:
        count_rows, ids, pos, slots, last, rslots, rpos, *extra = aligned_fields(
            [parts[0], ids, pos, *parts[1:]], device, metadata)
    else:
        count_rows, slots, last, rslots, rpos, *extra = aligned_fields(parts, device, metadata)
        ids, pos = to_device(ids, device), to_device(pos, device)
    view = AttnView(len(pos), tuple(qsl), seq_lens, floors, base, slots)
    replay_view = AttnView(len(rows), tuple(kqsl), seq_lens, floors, base, rslots, replay=True, trimmed=True)
    for k, (name, f) in enumerate(fields):
        view.derived[name] = extra[2 * k].view(-1, f.width)
        replay_view.derived[name] = extra[2 * k + 1].view(-1, f.width)
    replay = ReplayBatch(tuple(rows), count_rows[1:], count_rows, rpos, replay_view)
    return StepBatch(requests, window, ids, pos, last, view, replay, view.for_replay_layers(), metadata,
                     metadata.generation if metadata is not None else 0, layout, owner=owner, pad_writes=pad_writes)


def check_blocks(requests, blocks, layout: CacheLayout, shared: bool = False) -> list[int]:
    """Each request's cache block as a Python int, refused (naming the request and the
    block) where it is not an integer, not a block of ``layout``, or another request's
    too: two requests in one block would write over each other's KV. ``shared``: the
    requests write no block (every row to the pad slot), so they may share one."""
    out: list[int] = []
    seen: dict[int, int] = {}
    for i, (r, b) in enumerate(zip(requests, blocks)):
        where = f"request {i} (req_id={r.req_id!r})"
        if isinstance(b, bool) or not _is_index(b):
            raise ValueError(f"{where}: cache block must be an int, got {type(b).__name__} {b!r}")
        b = operator.index(b)
        if not 0 <= b < layout.num_blocks:
            raise ValueError(f"{where}: cache block {b} is outside [0, {layout.num_blocks}) "
                             f"(the layout's num_blocks: max_num_seqs)")
        if not shared:
            j = seen.setdefault(b, i)
            if j != i:
                raise ValueError(f"{where}: cache block {b} is request {j}'s (req_id={requests[j].req_id!r}) too: "
                                 "each request of a step needs a block of its own")
        out.append(b)
    return out


def int64_tensor(values: list[int]) -> torch.Tensor:
    """Python ints as a 1-D int64 host tensor. ``torch.tensor`` inspects every element,
    several times slower: the step's rows and attention row blocks are built on its
    critical path, before its first kernel."""
    if not values:
        return torch.empty(0, dtype=torch.int64)
    # The tensor holds a reference to the array, which owns the memory.
    return torch.frombuffer(array.array("q", values), dtype=torch.int64)


def dummy_step_batch(num_tokens: int, layout: CacheLayout, window: int, device, context: int = 0,
                     view_fields: Mapping[str, ViewField] | None = None) -> StepBatch:
    """A batch of ``num_tokens`` rows for warm-up and capture: requests of at most
    ``window`` tokens (so every row is a replay row), every KV write aimed at the pad
    slot. The first request's rows follow ``context`` positions, whose cache entries its
    attention reads (whatever they hold: the outputs are thrown away)."""
    w = min(window, layout.max_model_len - context)
    if w < 1:
        raise ValueError(f"context={context} leaves no room in max_model_len={layout.max_model_len}")
    reqs = [RequestChunk(f"__dummy{i}", min(w, num_tokens - s), min(w, num_tokens - s) + (context if i == 0 else 0))
            for i, s in enumerate(range(0, num_tokens, w))]
    return build_step_batch(reqs, [[0] * r.query_len for r in reqs], [0] * len(reqs), layout, window, device,
                            view_fields=view_fields, pad_writes=True)
