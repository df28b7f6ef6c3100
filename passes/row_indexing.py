"""The row-locality rules of indexing (:mod:`.row_rules`): ``base[index]`` and
``base[index] = value``, whose index entries say which rows survive and where the
token dimension lands."""
from __future__ import annotations

import torch
from torch import fx

from .row_call import Call, value_of


def _walk(c: Call, base, index) -> tuple[str | None, int, int]:
    """(why indexing ``base`` may mix rows, where its token dimension lands, how many
    dimensions the result has). Every row is kept only by a full slice at the token
    dimension; a tensor index on a token-indexed tensor is refused whatever it indexes."""
    entries = index if isinstance(index, tuple) else (index,)
    tdim, ndim = c.tdim(base), base.dim()
    dim = out = 0
    at = None
    for k, e in enumerate(entries):
        if e is Ellipsis:
            skip = ndim - dim - sum(1 for x in entries[k + 1:] if x is not None)
            at = out + tdim - dim if dim <= tdim < dim + skip else at
            dim, out = dim + skip, out + skip
        elif e is None:
            out += 1
        elif isinstance(value_of(e), torch.Tensor):
            return c.refuse("indexes a token-indexed tensor with a tensor"), 0, 0
        elif isinstance(e, bool) or not (isinstance(e, int) or isinstance(e, slice) and not any(
                isinstance(b, fx.Node) for b in (e.start, e.stop, e.step))):
            # a list, a bool, or a bound computed from the row count: sizes it cannot read
            return c.refuse("indexes a token-indexed tensor in a way not analysed"), 0, 0
        elif dim == tdim:
            if not (isinstance(e, slice) and e == slice(None)):
                return c.refuse("selects or shifts rows"), 0, 0
            at, dim, out = out, dim + 1, out + 1
        else:
            out, dim = out + isinstance(e, slice), dim + 1
    if at is None:  # the token dimension is among the trailing ones the index leaves whole
        at = out + tdim - dim
    return None, at, out + ndim - dim


def getitem(c: Call) -> str | None:
    base, index = value_of(c.node.args[0]), c.node.args[1]
    if c.tdim(base) is not None:
        return _walk(c, base, index)[0]
    # A table without rows indexed by token-indexed tensors: a lookup per row, provided
    # the index tensors broadcast row against row and nothing else depends on the rows.
    entries = index if isinstance(index, tuple) else (index,)
    for e in entries:
        v = value_of(e)
        if isinstance(v, torch.Tensor) and c.tdim(v) is None or isinstance(e, fx.Node) and not isinstance(
                v, torch.Tensor) or isinstance(e, slice) and any(isinstance(b, fx.Node) for b in (e.start, e.stop)):
            return c.refuse("indexes a table in a way not analysed")
    if len({v.dim() - d for _, v, d in c.rowed}) > 1:
        return c.refuse("indexes a table by tensors whose rows do not line up")
    return None


def setitem(c: Call) -> str | None:
    """``base[index] = value`` writes row i of the view from row i of ``value`` (or the
    same value into every row); a write into a tensor without rows from rows is refused."""
    base, index, value = (value_of(a) for a in c.node.args[:3])
    if c.tdim(base) is None:
        return c.refuse("writes rows into a tensor without them")
    why, at, ndim = _walk(c, base, c.node.args[1])
    if why is None and c.tdim(value) is not None and value.dim() - c.tdim(value) != ndim - at:
        return c.refuse("writes rows into other rows")
    return why
