"""A step's inputs as the batch builder takes them: the token ids and cache blocks
checked per request, and per-request values spread to rows, on the host, in few ops
whatever the request count (host time before the step's first kernel)."""
from __future__ import annotations

import array

import torch

from .kv_cache import CacheLayout
from .requests import check_blocks


def check_inputs(requests, token_ids, blocks, layout: CacheLayout, pad_writes: bool) -> list[int]:
    """Refuse token ids and cache blocks that are not one entry per request of the right
    kind and size, naming the request; returns the blocks as ints (``check_blocks``)."""
    for name, given in (("token_ids", token_ids), ("blocks", blocks)):
        if not hasattr(given, "__len__") or isinstance(given, (str, bytes)):
            raise ValueError(f"{name} must be a list with one entry per request, got {type(given).__name__}")
    if len(token_ids) != len(requests):
        raise ValueError(f"{len(token_ids)} token id lists for {len(requests)} requests")
    for i, (r, toks) in enumerate(zip(requests, token_ids)):
        if isinstance(toks, torch.Tensor):  # its kind first: a 2-D tensor's length counts rows, not ids
            if toks.device.type != "cpu":
                raise ValueError(f"request {i}: token_ids[{i}] is on {toks.device}: a step's metadata is built on "
                                 "the host, so give its token ids as a list or a CPU tensor")
            if toks.dim() != 1 or toks.dtype.is_floating_point or toks.dtype.is_complex or toks.dtype == torch.bool:
                raise ValueError(f"request {i}: token_ids[{i}] is a {toks.dim()}-D {toks.dtype} tensor: give a "
                                 "request's token ids as a list of ints or a 1-D integer tensor")
        try:
            n = len(toks)
        except TypeError:
            raise ValueError(f"request {i}: token_ids[{i}] is of type {type(toks).__name__}: give a request's token "
                             "ids as a list of ints or a 1-D integer tensor") from None
        if n != r.query_len:
            raise ValueError(f"request {i}: {n} token ids for query_len={r.query_len}")
    if len(blocks) != len(requests):
        raise ValueError(f"{len(blocks)} cache blocks for {len(requests)} requests")
    return check_blocks(requests, blocks, layout, shared=pad_writes)


def built_field(name: str, value, rows: int | None = None, width: int = 1) -> torch.Tensor:
    """A ViewField's built value, refused naming the field where it is not a flat int64
    host tensor of whole rows of ``width`` values (for a per-row field, one for each of
    ``rows`` rows)."""
    if not isinstance(value, torch.Tensor) or value.dtype != torch.int64 or value.dim() != 1:
        what = f"a {value.dim()}-D {value.dtype} tensor" if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"ViewField {name!r}: build must return a 1-D int64 tensor, got {what}")
    if rows is not None and value.shape[0] != rows * width:
        raise ValueError(f"ViewField {name!r}: build returned {value.shape[0]} values for {rows} rows of width "
                         f"{width}")
    if value.shape[0] % width:
        raise ValueError(f"ViewField {name!r}: build returned {value.shape[0]} values, not whole rows of width "
                         f"{width}")
    return value


def per_row(qsl: list[int], values: list[int]) -> torch.Tensor:
    """``values[i]`` on each row of request i (rows ``qsl[i]:qsl[i + 1]``, none empty):
    each request's step from the one before at its first row, summed along the rows.
    A cumulative sum of one dimension runs on one thread, so it never waits for a busy
    host's other cores (``repeat_interleave`` does)."""
    if len(values) == qsl[-1]:  # a row per request
        return int64_tensor(values)
    steps = int64_tensor([values[0], *(b - a for a, b in zip(values, values[1:]))])
    return torch.zeros(qsl[-1], dtype=torch.int64).index_copy_(0, int64_tensor(qsl[:-1]), steps).cumsum_(0)


def token_ids_tensor(token_ids) -> torch.Tensor:
    """The requests' token ids, in order, as one int64 host tensor: each run of
    requests whose ids are lists in one conversion (decodes beside a prompt's chunk:
    one for the decodes), tensors as they are (checked 1-D integer already)."""
    parts: list[torch.Tensor] = []
    run: list = []
    for toks in token_ids:
        if isinstance(toks, torch.Tensor):
            if run:
                parts.append(_ints(run))
                run = []
            parts.append(toks.to(torch.int64))
        else:
            run.extend(toks)
    if run:
        parts.append(_ints(run))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _ints(values: list) -> torch.Tensor:
    try:
        return int64_tensor(values)
    except (TypeError, OverflowError) as e:
        raise ValueError(f"token ids must be int64 integers: {e}") from None


def int64_tensor(values: list[int]) -> torch.Tensor:
    """Python ints as a 1-D int64 host tensor. ``torch.tensor`` inspects every element,
    several times slower: the step's rows and attention row blocks are built on its
    critical path, before its first kernel."""
    if not values:
        return torch.empty(0, dtype=torch.int64)
    # The tensor holds a reference to the array, which owns the memory.
    return torch.frombuffer(array.array("q", values), dtype=torch.int64)
