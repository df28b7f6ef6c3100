"""A step's requests, as the step protocol gives them: what each asks for, checked before
anything is built from it, and the rows the replay layers keep of each.

Everything here is plain host data from plain integers, so nothing on a step's path
waits for the device to learn a request's layout.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from .config import is_int
from .kv_cache import CacheLayout


# The largest length or position a request may give: past it a number is a typo, not a
# request (no cache could hold it), and it must fail here, not as an overflow or an
# allocation deep inside a step.
MAX_POSITION = 2 ** 31 - 1


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
            if not is_int(val):
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


def check_request_types(requests) -> None:
    """Refuse a step's requests that are not RequestChunks, naming the first."""
    for i, r in enumerate(requests):
        if not isinstance(r, RequestChunk):
            raise ValueError(f"request {i}: a step's requests are replay_backend.RequestChunk, got "
                             f"{type(r).__name__} {r!r:.80}")


def validate_requests(requests, layout: CacheLayout, window: int,
                      max_num_batched_tokens: int | None = None) -> None:
    if not requests:
        raise ValueError("empty batch: a step needs at least one request")
    check_request_types(requests)
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


def check_blocks(requests, blocks, layout: CacheLayout, shared: bool = False) -> list[int]:
    """Each request's cache block as a Python int, refused (naming the request and the
    block) where it is not an integer, not a block of ``layout``, or another request's
    too: two requests in one block would write over each other's KV. ``shared``: the
    requests write no block (every row to the pad slot), so they may share one."""
    out: list[int] = []
    seen: dict[int, int] = {}
    for i, (r, b) in enumerate(zip(requests, blocks)):
        where = f"request {i} (req_id={r.req_id!r})"
        if not is_int(b):
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
