"""The per-op rules of the row-locality analysis (:mod:`.row_local`).

Each rule reads one call, its arguments bound by name with their defaults (the schema's
or the Python function's) and the token dimension of every tensor it reads and makes,
and says why the call may mix rows, or None where it provably does not. The checks
every call passes first (one token dimension of the row count in and out) are
:mod:`.row_local`'s; a rule decides what they cannot see: along which dimension the op
works, what it contracts, what a shape argument spans. An op without a rule here is
refused by the caller.
"""
from __future__ import annotations

import math
import re

import torch
from torch import fx

from .common import node_value
from .row_call import MISSING, Call, aligned, value_of


# ---- ops along a dimension -----------------------------------------------------------
def _dims(c: Call, names=("dim", "dims", "axis", "dimension")):
    """The dimensions the call works along as a list of ints, or a reason why not."""
    dims = c.arg(*names)
    if dims is MISSING and not c.args and len(c.node.args) > 1:
        return c.refuse("works along a dimension that could not be read from its arguments")
    if dims is MISSING or dims is None or isinstance(dims, (list, tuple)) and not dims:
        return c.refuse("works over every dimension, the token dimension among them (no dim given)")
    dims = list(dims) if isinstance(dims, (list, tuple)) else [dims]
    if not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        return c.refuse("works along a dimension not known when traced")
    return dims


def _hits(dims, tdim: int, ndim: int) -> bool:
    return any(d % max(ndim, 1) == tdim for d in dims)


def along_dim(c: Call, fixed: int | None = None) -> str | None:
    """An op that mixes values only along its ``dim`` (reductions, scans, softmax, sort,
    flip, roll, splits, normalize): row-local when that is not the token dimension of
    its input, and every other tensor it reads has its rows where the input has them."""
    dims = [fixed] if fixed is not None else _dims(c)
    if isinstance(dims, str):
        return dims
    x = c.src
    if isinstance(x, list):  # cat, stack: a list of tensors, which must agree on their rows
        if len({x_.dim() - d for _, x_, d in c.rowed}) > 1:
            return c.refuse("combines tensors whose token dimensions differ")
        if c.name == "stack":  # the new dimension numbers the tensors, never the rows
            return None
        x = next(x_ for _, x_, _ in c.rowed)
    tdim = c.tdim(x)
    if tdim is None:
        return c.refuse("reads rows only through an argument it does not index by")
    if _hits(dims, tdim, x.dim()):
        return c.refuse("works along the token dimension")
    others = [(a, v, d) for a, v, d in c.rowed if v is not x]
    if any(v.dim() - d != x.dim() - tdim for _, v, d in others):
        return c.refuse("reads a tensor whose rows do not line up with its input's")
    return None


def indexed_along_dim(c: Call) -> str | None:
    """gather, scatter and the like: along a dimension other than the tokens, with an
    index (and source) that carries the same rows as the input, row i reads and writes
    row i only. An index without rows would point every row at the same places."""
    why = along_dim(c)
    if why is not None:
        return why
    tensors = {id(v) for v in map(value_of, _flat(c.node.args, c.node.kwargs)) if isinstance(v, torch.Tensor)}
    if len(c.rowed) < len(tensors):
        return c.refuse("reads an index or source whose rows do not line up with its input's")
    return None


def index_along_dim(c: Call) -> str | None:
    """index_select, index_add, index_copy, index_fill: a row-free index picks the same
    places in every row when it runs along another dimension; a table without rows read
    by a token-indexed index (``table.index_select(0, positions)``) is a lookup per row."""
    x, index = c.src, value_of(c.arg("index", pos=2))
    if c.tdim(x) is None:
        return None if c.name == "index_select" else c.refuse("writes rows into a tensor without them")
    if c.tdim(index) is not None:
        return c.refuse("indexes by an index computed from the rows")
    return along_dim(c)


def layer_norm(c: Call) -> str | None:
    """layer_norm and rms_norm normalise over the last ``len(normalized_shape)``
    dimensions, whatever sizes the shape names (``h.shape`` spans the rows too)."""
    shape = c.arg("normalized_shape", pos=1)
    if isinstance(shape, fx.Node):
        shape = node_value(shape)
    if isinstance(shape, (int, torch.SymInt)):
        shape = [shape]
    if not isinstance(shape, (list, tuple, torch.Size)):
        return c.refuse("normalises over a shape not known when traced")
    x = c.src
    if c.tdim(x) is None or c.tdim(x) >= x.dim() - len(shape):
        return c.refuse("normalises over the token dimension")
    return _only_input_rowed(c)


def _only_input_rowed(c: Call) -> str | None:
    x = c.src
    if any(v is not x for _, v, _ in c.rowed):
        return c.refuse("reads a token-indexed weight or statistic")
    return None


def group_norm(c: Call) -> str | None:
    """(N, C, *): each sample's groups are normalised alone, so rows may be N only."""
    return _only_input_rowed(c) if c.tdim(c.src) == 0 else c.refuse("normalises over the token dimension")


def batch_norm(c: Call) -> str | None:
    """(N, C, *): in training (or without running statistics) each channel is
    normalised over N and the spatial dimensions, and the running statistics are
    updated from every row; from running statistics it is per channel and pointwise."""
    training = c.arg("training", "use_input_stats", default=None)
    running = c.arg("running_mean", pos=1, default=None)
    tdim = c.tdim(c.src)
    if training is not False and c.name == "instance_norm":
        if running is not None and running is not MISSING:
            return c.refuse("updates running statistics from every row")
        return _only_input_rowed(c) if tdim in (0, 1) else c.refuse("normalises over the token dimension")
    if training is not False:
        return c.refuse("normalises over the batch, the token dimension among it")
    return _only_input_rowed(c) if tdim != 1 else c.refuse("normalises with statistics indexed by token")


def local_response_norm(c: Call) -> str | None:
    """Its window runs over the channels, dimension 1."""
    return along_dim(c, fixed=1)


def pad(c: Call) -> str | None:
    """``pad`` pairs run from the last dimension back; the token dimension's pair must be
    zeros (any other pads each row from itself, whatever the mode)."""
    amounts, x = c.arg("pad", pos=1), c.src
    if not isinstance(amounts, (list, tuple)):
        return c.refuse("pads by amounts not known when traced")
    k = 2 * (x.dim() - 1 - c.tdim(x))
    pair = list(amounts[k:k + 2])
    if not all(isinstance(a, int) and a == 0 for a in pair):
        return c.refuse("pads or shifts along the token dimension")
    return None


_SPATIAL = re.compile(r"(\d)d")


def convolution(c: Call) -> str | None:
    """A convolution mixes its channels and its spatial dimensions: rows may be its batch
    dimension only (the first, with every spatial dimension after the channels)."""
    spatial = int(_SPATIAL.search(c.name).group(1))
    x = c.src
    if x.dim() != spatial + 2 or c.tdim(x) != 0:
        return c.refuse("convolves or mixes channels along the token dimension")
    return _only_input_rowed(c)


def pooling(c: Call) -> str | None:
    """Pooling (and interpolation) works on each sample's channels alone, over the last
    1, 2 or 3 dimensions: rows may be any dimension before those."""
    m = _SPATIAL.search(c.name)
    x = c.src
    spatial = int(m.group(1)) if m else x.dim() - 2
    if c.tdim(x) is None or c.tdim(x) >= x.dim() - spatial:
        return c.refuse("pools or resamples along the token dimension")
    return _only_input_rowed(c)


def reshape(c: Call) -> str | None:
    """A reshape keeps rows whole when the token dimension has the same number of
    elements before it (row-major order) in its input and its output: element (p, i, r)
    then stays (p, i, r') with the same p and i."""
    x = c.src
    tdim = c.tdim(x)
    if tdim is None:
        return c.refuse("reads rows only through the shape it is given")
    o, odim = c.outs[0]
    before = [x.shape[:tdim], o.shape[:odim]]
    if not all(isinstance(s, int) for part in before for s in part):
        return c.refuse("reshapes across the token dimension")
    return None if math.prod(before[0]) == math.prod(before[1]) else c.refuse("reshapes across the token dimension")


# ---- contractions ----------------------------------------------------------------------
def matmul(c: Call) -> str | None:
    """``a @ b`` over (..., n, k) x (..., k, m): rows may be a's n or b's m (when the
    other operand has none) or a batch dimension they share; a row in either k is
    contracted with every other row."""
    first = 1 if c.name in ("baddbmm", "addmm", "addmv", "addbmm") else 0
    names = {"linear": ("input", "weight"), "baddbmm": ("batch1", "batch2"), "addbmm": ("batch1", "batch2"),
             "addmm": ("mat1", "mat2"), "addmv": ("mat", "vec"), "mv": ("input", "vec"),
             "mm": ("input", "mat2"), "bmm": ("input", "mat2")}.get(c.name, ("input", "other"))
    a, b = (value_of(c.arg(n, "self" if i == 0 else n, pos=first + i)) for i, n in enumerate(names))
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return c.refuse("could not be read as a product of two tensors")
    if c.name == "linear":  # a @ weight.T: the weight's rows are its outputs
        if c.tdim(b) is not None or c.tdim(value_of(c.arg("bias", pos=2, default=None))) is not None:
            return c.refuse("reads a token-indexed weight")
        return c.refuse("contracts the token dimension") if c.tdim(a) == a.dim() - 1 else None
    if c.name == "addbmm":
        return c.refuse("sums its batch of products, the rows among them")
    da, db = c.tdim(a), c.tdim(b)
    if da is not None and da == a.dim() - 1 or db is not None and (b.dim() == 1 or db == b.dim() - 2):
        return c.refuse("contracts the token dimension")
    if da is not None and db is not None and (a.dim() - da < 3 or b.dim() - db < 3):
        return c.refuse("pairs rows with rows")  # a's n against b's m (or a batch one)
    if first:  # the addend broadcasts onto the product like a pointwise operand
        return aligned(c)
    return None


def outer(c: Call) -> str | None:
    a, b = (value_of(x) for x in c.node.args[:2])
    return c.refuse("pairs rows with rows") if c.tdim(a) is not None and c.tdim(b) is not None else None


def einsum(c: Call) -> str | None:
    """Row-local when the token dimension has one letter in every operand that carries
    it, and that letter is kept in the output (once)."""
    eq = c.node.args[0] if c.node.args and isinstance(c.node.args[0], str) else None
    if eq is None or "->" not in eq or "." in eq:
        return c.refuse("is an einsum without an explicit output, not analysed")
    lhs, out = eq.replace(" ", "").split("->")
    operands = c.node.args[1] if isinstance(c.node.args[1], (list, tuple)) else c.node.args[1:]
    letters = set()
    for spec, a in zip(lhs.split(","), operands):
        d = c.tdim(value_of(a))
        if d is not None:
            letters.add(spec[d])
    if len(letters) != 1 or out.count(next(iter(letters))) != 1:
        return c.refuse("contracts or pairs the token dimension")
    return None


def embedding(c: Call) -> str | None:
    """A lookup per row, unless the table carries rows, or ``max_norm`` renormalises the
    table in place from the rows looked up (which later steps then read)."""
    weight = value_of(c.arg("weight", pos=1))
    if c.tdim(weight) is not None:
        return c.refuse("looks up a token-indexed table")
    return None if c.arg("max_norm", default=None) is None else c.refuse("renormalises its table from the rows")


def _flat(args, kwargs) -> list:
    out = []
    fx.node.map_aggregate((args, kwargs), out.append)
    return out


def maxmin(c: Call) -> str | None:
    """``max(a, b)`` is pointwise; ``max(a, dim)`` a reduction."""
    if isinstance(c.arg("other", pos=1, default=None), fx.Node) and isinstance(
            node_value(c.arg("other", pos=1, default=None)), torch.Tensor):
        return aligned(c)
    return along_dim(c)


# ---- random numbers --------------------------------------------------------------------
def random_draw(c: Call) -> str | None:
    """A row's random numbers depend on its place in the step's draw: a trimmed step, or a
    padded one, draws other numbers for the same row."""
    return c.refuse("draws random numbers by the row's place in the step, which trimming and padding move")


def dropout(c: Call) -> str | None:
    """Dropout is the identity where it does not train (or drops nothing)."""
    training, p = c.arg("training", "train", pos=2, default=True), c.arg("p", pos=1, default=0.5)
    if training is False or p == 0:
        return None
    return random_draw(c)
