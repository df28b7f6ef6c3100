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
from dataclasses import dataclass, field

import torch
from torch import fx

from .common import named_args, node_value

_MISSING = object()


@dataclass
class Call:
    """One call as the rules see it. ``rowed`` lists (argument, value, token dimension)
    for every tensor read that carries the rows."""

    node: fx.Node
    name: str
    where: str
    rowed: list
    outs: list  # (value, token dimension) of every tensor it makes
    args: dict = field(init=False)

    def __post_init__(self) -> None:
        self.args = named_args(self.node, defaults=True)

    def tdim(self, value) -> int | None:
        for _, x, d in self.rowed:
            if x is value:
                return d
        return None

    def arg(self, *names: str, pos: int | None = None, default=_MISSING):
        """A bound argument by one of its names, else the positional one (for calls no
        signature binds), else ``default``; ``_MISSING`` where absent."""
        for n in names:
            if n in self.args:
                return self.args[n]
            if n in self.node.kwargs:
                return self.node.kwargs[n]
        if not self.args and pos is not None and len(self.node.args) > pos:
            return self.node.args[pos]
        return default

    @property
    def src(self):
        """The value of the call's first argument (``self``, ``input``; a list's values)."""
        a = self.node.args[0] if self.node.args else self.arg("input", "self", "tensors", "tensor", default=None)
        return [_value(x) for x in a] if isinstance(a, (list, tuple)) else _value(a)

    def refuse(self, why: str) -> str:
        return f"{self.where} {why}"


def _value(a):
    return node_value(a) if isinstance(a, fx.Node) else a


def aligned(c: Call) -> str | None:
    """Broadcasting keeps rows apart when every token dimension sits at the same place
    counted from the last dimension: row i then meets row i of every operand and lands
    in row i of the result."""
    places = {x.dim() - d for _, x, d in c.rowed} | {o.dim() - d for o, d in c.outs}
    return None if len(places) == 1 else c.refuse("broadcasts rows against other dimensions")


# ---- ops along a dimension -----------------------------------------------------------
def _dims(c: Call, names=("dim", "dims", "axis", "dimension")):
    """The dimensions the call works along as a list of ints, or a reason why not."""
    dims = c.arg(*names)
    if dims is _MISSING and not c.args and len(c.node.args) > 1:
        return c.refuse("works along a dimension that could not be read from its arguments")
    if dims is _MISSING or dims is None or isinstance(dims, (list, tuple)) and not dims:
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
    tensors = {id(v) for v in map(_value, _flat(c.node.args, c.node.kwargs)) if isinstance(v, torch.Tensor)}
    if len(c.rowed) < len(tensors):
        return c.refuse("reads an index or source whose rows do not line up with its input's")
    return None


def index_along_dim(c: Call) -> str | None:
    """index_select, index_add, index_copy, index_fill: a row-free index picks the same
    places in every row when it runs along another dimension; a table without rows read
    by a token-indexed index (``table.index_select(0, positions)``) is a lookup per row."""
    x, index = c.src, _value(c.arg("index", pos=2))
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
        if running is not None and running is not _MISSING:
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
    a, b = (_value(c.arg(n, "self" if i == 0 else n, pos=first + i)) for i, n in enumerate(names))
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return c.refuse("could not be read as a product of two tensors")
    if c.name == "linear":  # a @ weight.T: the weight's rows are its outputs
        if c.tdim(b) is not None or c.tdim(_value(c.arg("bias", pos=2, default=None))) is not None:
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
    a, b = (_value(x) for x in c.node.args[:2])
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
        d = c.tdim(_value(a))
        if d is not None:
            letters.add(spec[d])
    if len(letters) != 1 or out.count(next(iter(letters))) != 1:
        return c.refuse("contracts or pairs the token dimension")
    return None


def embedding(c: Call) -> str | None:
    """A lookup per row, unless the table carries rows, or ``max_norm`` renormalises the
    table in place from the rows looked up (which later steps then read)."""
    weight = _value(c.arg("weight", pos=1))
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


# ---- indexing --------------------------------------------------------------------------
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
        elif isinstance(_value(e), torch.Tensor):
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
    base, index = _value(c.node.args[0]), c.node.args[1]
    if c.tdim(base) is not None:
        return _walk(c, base, index)[0]
    # A table without rows indexed by token-indexed tensors: a lookup per row, provided
    # the index tensors broadcast row against row and nothing else depends on the rows.
    entries = index if isinstance(index, tuple) else (index,)
    for e in entries:
        v = _value(e)
        if isinstance(v, torch.Tensor) and c.tdim(v) is None or isinstance(e, fx.Node) and not isinstance(
                v, torch.Tensor) or isinstance(e, slice) and any(isinstance(b, fx.Node) for b in (e.start, e.stop)):
            return c.refuse("indexes a table in a way not analysed")
    if len({v.dim() - d for _, v, d in c.rowed}) > 1:
        return c.refuse("indexes a table by tensors whose rows do not line up")
    return None


def setitem(c: Call) -> str | None:
    """``base[index] = value`` writes row i of the view from row i of ``value`` (or the
    same value into every row); a write into a tensor without rows from rows is refused."""
    base, index, value = (_value(a) for a in c.node.args[:3])
    if c.tdim(base) is None:
        return c.refuse("writes rows into a tensor without them")
    why, at, ndim = _walk(c, base, c.node.args[1])
    if why is None and c.tdim(value) is not None and value.dim() - c.tdim(value) != ndim - at:
        return c.refuse("writes rows into other rows")
    return why


# ---- the tables ------------------------------------------------------------------------
POINTWISE = frozenset({
    "add", "sub", "mul", "truediv", "div", "floordiv", "mod", "remainder", "neg", "pos", "pow", "abs",
    "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "rsqrt", "reciprocal", "square", "sign",
    "sigmoid", "silu", "relu", "relu6", "gelu", "tanh", "softplus", "mish", "elu", "selu", "celu", "leaky_relu",
    "hardtanh", "hardswish", "hardsigmoid", "logsigmoid", "softsign", "tanhshrink", "threshold", "erf", "erfc",
    "sin", "cos", "tan", "atan", "atan2", "asin", "acos", "sinh", "cosh", "floor", "ceil", "round", "trunc", "frac",
    "clamp", "clamp_min", "clamp_max", "clip", "maximum", "minimum", "fmax", "fmin", "where", "masked_fill",
    "lerp", "addcmul", "addcdiv", "hypot", "logaddexp", "isnan", "isinf", "isfinite", "logit", "xlogy",
    "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_not", "logical_xor",
    "and_", "or_", "xor", "invert", "lshift", "rshift", "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not",
    "float", "double", "half", "bfloat16", "int", "long", "bool", "to", "type", "type_as", "clone", "contiguous",
    "detach", "nan_to_num", "polar", "real", "imag", "conj",
    "iadd", "isub", "imul", "itruediv", "add_", "sub_", "mul_", "div_", "copy_", "fill_", "zero_",
})
# Shape ops that move or split dimensions but keep the token dimension whole: the
# checks every call passes (one whole token dimension in and out) are their proof.
MOVES = frozenset({"unsqueeze", "squeeze", "transpose", "permute", "t", "expand", "expand_as", "movedim",
                   "moveaxis", "swapaxes", "swapdims", "broadcast_to", "repeat", "tile", "view_as_complex",
                   "view_as_real", "T", "mT", "H", "mH", "adjoint"})
# Reshapes: row-local when as many elements precede the token dimension before and after.
RESHAPES = frozenset({"view", "reshape", "flatten", "unflatten", "view_as", "reshape_as", "_unsafe_view"})
# Ops whose values are the same for every row, whatever shape they are given.
CONSTANT_FACTORIES = frozenset({"zeros", "ones", "full", "empty", "empty_strided", "new_zeros", "new_ones",
                                "new_full", "new_empty", "zeros_like", "ones_like", "full_like", "empty_like"})
# Reading no rows, they make the same values for every row of the token dimension they make.
SAME_FOR_EVERY_ROW = CONSTANT_FACTORIES | {"expand", "expand_as", "broadcast_to"}
SIZES = frozenset({"aten::sym_size", "aten::sym_numel", "aten::sym_stride", "size", "dim", "numel", "stride",
                   "shape", "ndim", "dtype", "device", "layout", "is_cuda", "requires_grad"})
ALONG_DIM = frozenset({
    "sum", "nansum", "mean", "nanmean", "amax", "amin", "prod", "var", "std", "var_mean", "std_mean",
    "logsumexp", "all", "any", "argmax", "argmin", "median", "nanmedian", "mode", "kthvalue", "quantile",
    "nanquantile", "count_nonzero", "aminmax", "norm", "linalg_vector_norm", "vector_norm", "linalg_norm",
    "normalize", "cosine_similarity", "softmax", "log_softmax", "softmin", "cumsum", "cumprod", "cummax",
    "cummin", "logcumsumexp", "sort", "argsort", "topk", "flip", "roll", "diff", "glu", "unfold",
    "cat", "concat", "concatenate", "stack", "chunk", "split", "split_with_sizes", "tensor_split", "unbind",
    "narrow", "select", "slice",
})
RULES = {
    **{n: along_dim for n in ALONG_DIM},
    "max": maxmin, "min": maxmin,
    "fliplr": lambda c: along_dim(c, fixed=1), "flipud": lambda c: along_dim(c, fixed=0),
    "msort": lambda c: along_dim(c, fixed=0),
    **{n: indexed_along_dim for n in ("gather", "scatter", "scatter_add", "scatter_reduce", "take_along_dim")},
    **{n: index_along_dim for n in ("index_select", "index_add", "index_copy", "index_fill")},
    "layer_norm": layer_norm, "rms_norm": layer_norm, "group_norm": group_norm,
    "batch_norm": batch_norm, "instance_norm": batch_norm, "local_response_norm": local_response_norm,
    "pad": pad, "constant_pad_nd": pad,
    **{f"{p}{k}d": convolution for p in ("conv", "conv_transpose") for k in (1, 2, 3)},
    **{f"{p}{k}d": pooling for p in ("avg_pool", "max_pool", "adaptive_avg_pool", "adaptive_max_pool", "lp_pool")
       for k in (1, 2, 3)},
    **{f"max_pool{k}d_with_indices": pooling for k in (1, 2, 3)},
    **{f"upsample_{m}": pooling for m in ("nearest1d", "nearest2d", "nearest3d", "linear1d", "bilinear2d",
                                          "bicubic2d", "trilinear3d", "nearest_exact1d", "nearest_exact2d")},
    "interpolate": pooling, "upsample": pooling,
    **{n: matmul for n in ("matmul", "mm", "bmm", "baddbmm", "addmm", "addbmm", "mv", "addmv", "linear")},
    "outer": outer, "ger": outer, "einsum": einsum, "embedding": embedding, "getitem": getitem, "setitem": setitem,
    **{n: random_draw for n in ("rand_like", "randn_like", "randint_like", "bernoulli", "normal", "uniform_")},
    **{n: dropout for n in ("dropout", "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d")},
    **{n: reshape for n in RESHAPES},
}
# Parameters whose symbolic values are sizes (the row count may size a shape, but a
# value computed from it differs between a step and its replay rows, or padded rows).
SHAPE_PARAMS = frozenset({"size", "shape", "sizes", "normalized_shape", "split_size", "split_size_or_sections",
                          "split_sizes", "indices_or_sections", "sections", "length", "start", "end", "pad",
                          "output_size", "chunks", "repeats", "stride"})
