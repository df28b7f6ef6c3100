"""Row-locality: may a graph run on a subset of its rows, or on rows padded with dummies?

A node is row-local when every row of its outputs depends on the same row of its
token-indexed inputs alone (values without a token dimension, such as weights, are
read whole). The replay region must be row-local for trimming to be exact, and so
must the main graph for padding to leave the real rows alone (SPEC §5, §7).

The analysis is a list of what is known to be row-local, op by op, and everything
else is rejected with the op named: an op it does not know may shift, convolve or
reduce rows in ways no structural rule sees. Known are pointwise ops (with
broadcasting that keeps the token dimensions aligned), shape ops that keep the token
dimension whole, reductions and concatenations along other dimensions, contractions
whose token dimension is not contracted, indexing that takes every row, the lookup
of a weight by a token-indexed index (an embedding), and ops declared row-local with
:func:`roles.declare_row_local` (opaque ops that work on each row alone, such as a fused
per-token kernel). Splitting ops are checked by the caller's rules, not here.
"""
from __future__ import annotations

import operator
import re

import torch
from torch import fx

from .common import named_args, node_value, op_name, op_tags
from .roles import OpRole, roles_of

# The trim op reads the rows it is given and the step's own: padding is its concern.
TRIM_OP = "dsv41_replay::trim_and_redispatch"
POINTWISE = frozenset({
    "add", "sub", "mul", "truediv", "div", "floordiv", "mod", "remainder", "neg", "pos", "pow", "abs",
    "exp", "exp2", "expm1", "log", "log2", "log1p", "sqrt", "rsqrt", "reciprocal", "square", "sign",
    "sigmoid", "silu", "relu", "gelu", "tanh", "softplus", "erf", "sin", "cos", "clamp", "clamp_min",
    "clamp_max", "clip", "maximum", "minimum", "where", "masked_fill", "lerp", "addcmul", "addcdiv",
    "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_not", "and_", "or_", "xor",
    "invert", "bitwise_and", "bitwise_or", "bitwise_not", "float", "double", "half", "bfloat16", "int",
    "long", "bool", "to", "type", "type_as", "clone", "contiguous", "detach", "nan_to_num",
    "rand_like", "randn_like", "dropout", "alpha_dropout", "polar",
    "iadd", "isub", "imul", "itruediv", "add_", "sub_", "mul_", "div_", "copy_", "fill_", "zero_",
})
# Shape ops that move or split dimensions but keep the token dimension whole.
MOVES = frozenset({"unsqueeze", "squeeze", "transpose", "permute", "t", "expand", "expand_as", "movedim",
                   "swapaxes", "swapdims", "broadcast_to", "repeat", "tile", "view_as_complex", "view_as_real"})
# Reshapes: row-local only with the token dimension leading before and after (rows are
# then contiguous runs of the same elements).
RESHAPES = frozenset({"view", "reshape", "flatten", "unflatten", "view_as", "reshape_as"})
# Ops along a dimension: row-local when that dimension is not the token dimension.
ALONG_DIM = frozenset({
    "sum", "mean", "amax", "amin", "max", "min", "prod", "softmax", "log_softmax", "norm", "var", "std",
    "logsumexp", "all", "any", "argmax", "argmin", "topk", "sort", "argsort", "cumsum", "cumprod",
    "cummax", "cummin", "flip", "roll", "cat", "concat", "concatenate", "stack", "scatter", "scatter_add",
    "scatter_reduce", "gather", "index_select", "take_along_dim", "chunk", "split", "unbind", "narrow",
    "select", "tensor_split", "diff", "normalize",
})
CONTRACTIONS = frozenset({"matmul", "mm", "bmm", "baddbmm", "addmm", "linear", "einsum"})
# Ops whose values are the same for every row, whatever shape they are given.
CONSTANT_FACTORIES = frozenset({"zeros", "ones", "full", "empty", "empty_strided", "new_zeros", "new_ones",
                                "new_full", "new_empty", "zeros_like", "ones_like", "full_like", "empty_like"})
# Normalisations over the last ``len(normalized_shape)`` dimensions.
LAST_DIMS_NORMS = frozenset({"layer_norm", "rms_norm"})
# Ops whose every tensor argument must carry the token dimension at the same place.
ALIGNED_INDEXING = frozenset({"scatter", "scatter_add", "scatter_reduce", "gather", "take_along_dim"})
SIZES = frozenset({"aten::sym_size", "aten::sym_numel", "aten::sym_stride", "size", "dim", "numel", "stride"})


def declared_row_local(target) -> bool:
    return OpRole.ROW_LOCAL in roles_of(target)


def symbols(value) -> set:
    if isinstance(value, torch.SymInt):
        return set(value.node.expr.free_symbols)
    if isinstance(value, torch.Tensor):
        out = set()
        for s in value.shape:
            if isinstance(s, torch.SymInt):
                out |= set(s.node.expr.free_symbols)
        return out
    if isinstance(value, (list, tuple)):
        return set().union(*(symbols(v) for v in value)) if value else set()
    return set()


def token_dims(value, token_syms: set) -> list[int]:
    """The dimensions of ``value`` whose size involves a token symbol."""
    if not isinstance(value, torch.Tensor):
        return []
    return [i for i, s in enumerate(value.shape) if isinstance(s, torch.SymInt) and symbols(s) & token_syms]


def _name(node: fx.Node) -> str:
    if node.op == "call_method":
        return node.target
    name = op_name(node.target)
    if name is not None:
        return name
    return getattr(node.target, "__name__", str(node.target))


def _tensors(node: fx.Node) -> list[tuple[object, torch.Tensor]]:
    """(argument, value) of every tensor the node reads, lists flattened."""
    out = []
    for a in node.all_input_nodes:
        v = node_value(a)
        for x in (v if isinstance(v, (list, tuple)) else [v]):
            if isinstance(x, torch.Tensor):
                out.append((a, x))
    return out


def row_mixing(node: fx.Node, token_syms: set, row_counts: set) -> str | None:
    """Why ``node`` may mix rows, or None where it is row-local. ``row_counts`` holds the
    size expressions a token dimension may have (the graph's row count)."""
    if node.op not in ("call_function", "call_method"):
        return None
    try:
        return _row_mixing(node, token_syms, row_counts)
    except Exception as e:  # noqa: BLE001 - a call form the rules do not expect is refused, not a crash
        return f"{node.name} ({_name(node)}) could not be analysed ({type(e).__name__}: {e})"


def _row_mixing(node: fx.Node, token_syms: set, row_counts: set) -> str | None:
    ins = [(a, x, token_dims(x, token_syms)) for a, x in _tensors(node)]
    rowed = [(a, x, d) for a, x, d in ins if d]
    out = node_value(node)
    name = _name(node)
    if isinstance(out, (torch.SymInt, int, float, bool)) or name in SIZES:
        return None  # a size of the rows, not their values
    outs = [o for o in (out if isinstance(out, (list, tuple)) else [out]) if isinstance(o, torch.Tensor)]
    where = f"{node.name} ({name})"
    if not rowed:
        # Reads no rows. Where it makes a token dimension, its values must not depend on
        # the row's index (``arange(num_rows)`` numbers the replay rows, not the step's).
        if any(token_dims(o, token_syms) for o in outs) and name.split(".")[-1] not in CONSTANT_FACTORIES:
            return f"{where} makes values that depend on the row's index"
        return None
    for a, x, d in rowed:
        if len(d) > 1:
            return f"{where} reads {getattr(a, 'name', a)}, whose rows are paired with rows"
        if x.shape[d[0]].node.expr not in row_counts:
            return f"{where} reads {getattr(a, 'name', a)}, whose token dimension is not the row count"
    if node.op == "call_function" and node.target is operator.getitem and not isinstance(node_value(node.args[0]),
                                                                                         torch.Tensor):
        return None  # an element of a list or tuple
    for o in outs:
        d = token_dims(o, token_syms)
        if not d:
            return f"{where} reduces over the token dimension"
        if len(d) > 1:
            return f"{where} pairs rows with rows"
        if o.shape[d[0]].node.expr not in row_counts:
            return f"{where} changes the number of rows"
    return _rule(node, name, where, rowed, outs, token_syms)


def _rule(node, name: str, where: str, rowed, outs, token_syms) -> str | None:
    target = node.target
    if node.op == "call_function" and isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        if declared_row_local(target):
            return None
        if torch.Tag.pointwise in op_tags(node):
            return _aligned(where, rowed, outs, token_syms)
        return f"{where} is not known to be row-local: declare it with replay_backend.declare_row_local"
    short = name.split(".")[-1]
    if node.op == "call_function" and target is operator.getitem:
        return _getitem(node, where, rowed[0][2][0], token_syms)
    if short in POINTWISE:
        return _aligned(where, rowed, outs, token_syms)
    if short in CONSTANT_FACTORIES:
        return None  # the same values for every row, in a shape the checks above allow
    if short in ("max", "min") and isinstance(named_args(node).get("other", node.args[1] if len(node.args) > 1
                                                                     else None), fx.Node):
        return _aligned(where, rowed, outs, token_syms)  # the elementwise form: max(a, b)
    if short == "embedding":
        weight = node_value(named_args(node).get("weight", node.args[1] if len(node.args) > 1 else None))
        return f"{where} looks up a token-indexed table" if token_dims(weight, token_syms) else None
    if short in LAST_DIMS_NORMS:
        args = named_args(node)
        shape = args.get("normalized_shape", node.args[1] if len(node.args) > 1 else None)
        n = len(shape) if isinstance(shape, (list, tuple)) else 1
        first = rowed[0][1]
        return f"{where} normalises over the token dimension" if rowed[0][2][0] >= first.dim() - n else None
    if short in MOVES:
        return None  # the checks above: one whole token dimension in and out
    if short in RESHAPES:
        ok = all(d[0] == 0 for _, _, d in rowed) and all(token_dims(o, token_syms) == [0] for o in outs)
        return None if ok else f"{where} reshapes across the token dimension"
    if short in ALONG_DIM:
        return _along_dim(node, short, where, rowed, token_syms)
    if short in CONTRACTIONS:
        return _contraction(node, short, where, rowed, token_syms)
    return f"{where} is not known to be row-local"


def _aligned(where, rowed, outs, token_syms) -> str | None:
    """Broadcasting keeps rows apart when every token dimension sits at the same place
    counted from the last dimension."""
    places = {x.dim() - d[0] for _, x, d in rowed} | {o.dim() - token_dims(o, token_syms)[0] for o in outs}
    return None if len(places) == 1 else f"{where} broadcasts rows against other dimensions"


# Where an op's dimension stands among its positional arguments (``self`` first), for
# calls whose signature torch cannot bind by name.
_DIM_POSITION = {"chunk": 2, "split": 2, "tensor_split": 2, "topk": 2, "roll": 2, "cumsum": 1, "cumprod": 1}


def _along_dim(node, short: str, where: str, rowed, token_syms: set) -> str | None:
    args = named_args(node)
    dims = args.get("dim", args.get("dims", args.get("axis")))
    if dims is None and not args:
        pos = _DIM_POSITION.get(short, 1)
        dims = node.args[pos] if len(node.args) > pos else node.kwargs.get("dim")
    if dims is None and short in ("chunk", "split", "tensor_split", "unbind", "cat", "concat", "stack",
                                  "concatenate", "select", "narrow", "diff") and "dim" not in args:
        dims = 0 if short not in ("diff",) else -1  # these ops default to the first (diff: last) dimension
    if dims is None or isinstance(dims, (list, tuple)) and not dims:
        return f"{where} works over every dimension, the token dimension among them"
    dims = [dims] if isinstance(dims, int) else list(dims)
    if not all(isinstance(d, int) for d in dims):
        return f"{where} works along a dimension not known when traced"
    places = {d[0] for _, _, d in rowed}
    if short in ("cat", "concat", "concatenate", "stack"):
        # stacking aligned rows along any dimension keeps them apart; a cat along the
        # token dimension changes the row count, which the checks above refuse
        return None if len(places) == 1 else f"{where} combines tensors whose token dimensions differ"
    if short in ALIGNED_INDEXING:
        if len(places) > 1 or len(rowed) < len(_tensors(node)):
            return f"{where} reads an index or source whose rows do not line up with its input's"
    # the dimension counts in the op's own input (self): an index may carry the rows of
    # a table lookup (``cache.index_select(0, positions)``)
    first = node_value(node.args[0]) if node.args else None
    own = token_dims(first, token_syms)
    if own and any(k % max(first.dim(), 1) == own[0] for k in dims):
        return f"{where} works along the token dimension"
    if not own and short not in ("index_select",):
        return f"{where} reads rows only through an argument it does not index by"
    return None


def _contraction(node, short: str, where: str, rowed, token_syms: set) -> str | None:
    if short == "einsum":
        return _einsum(node, where, token_syms)
    names = {"linear": ("input", "weight"), "baddbmm": ("batch1", "batch2"), "addmm": ("mat1", "mat2"),
             "mm": ("input", "mat2"), "bmm": ("input", "mat2"), "matmul": ("input", "other")}[short]
    args = named_args(node)
    first = 1 if short in ("baddbmm", "addmm") else 0  # their first argument is the addend
    values = [node_value(args[k]) if k in args else node_value(node.args[first + i]) for i, k in enumerate(names)]
    dims = [token_dims_of(v, rowed) for v in values]
    a, b = values
    if short == "linear":
        bias = node_value(args.get("bias", node.args[2] if len(node.args) > 2 else None))
        if dims[1] is not None or token_dims_of(bias, rowed) is not None:
            return f"{where} reads a token-indexed weight"
        return f"{where} contracts the token dimension" if dims[0] == a.dim() - 1 else None
    if dims[0] is not None and dims[0] == a.dim() - 1:
        return f"{where} contracts the token dimension"
    if dims[1] is not None and b.dim() >= 2 and dims[1] == b.dim() - 2 or dims[1] is not None and b.dim() == 1:
        return f"{where} contracts the token dimension"
    if dims[0] is not None and dims[1] is not None and a.dim() - dims[0] != b.dim() - dims[1]:
        return f"{where} pairs rows with rows"
    return None


def token_dims_of(value, rowed) -> int | None:
    for _, x, d in rowed:
        if x is value:
            return d[0]
    return None


def _einsum(node, where: str, token_syms: set) -> str | None:
    eq = node.args[0] if isinstance(node.args[0], str) else None
    if eq is None or "->" not in eq or "." in eq:
        return f"{where}: an einsum without an explicit output is not analysed"
    lhs, out = eq.replace(" ", "").split("->")
    operands = node.args[1:] if not isinstance(node.args[1], (list, tuple)) else node.args[1]
    letters = set()
    for spec, arg in zip(lhs.split(","), operands):
        d = token_dims(node_value(arg), token_syms)
        if d:
            letters.add(spec[d[0]])
    if len(letters) != 1 or not re.search(letters.pop(), out):
        return f"{where} contracts or pairs the token dimension"
    return None


def _getitem(node, where: str, tdim: int, token_syms: set) -> str | None:
    """Indexing keeps every row when the token dimension's entry is a full slice; a
    weight indexed by a token-indexed tensor (an embedding lookup) is row-local too,
    and is caught before this as a read without rows in the indexed value."""
    base = node_value(node.args[0])
    index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    if not token_dims(base, token_syms):
        lead = index[0] if index else None
        return None if isinstance(lead, fx.Node) and len(index) == 1 else f"{where} indexes in a way not analysed"
    dim = 0
    for k, entry in enumerate(index):
        if entry is Ellipsis:
            dim = base.dim() - sum(1 for e in index[k + 1:] if e is not None)
            continue
        if entry is None:
            continue
        if dim == tdim:
            full = isinstance(entry, slice) and entry == slice(None, None, None)
            return None if full else f"{where} selects or shifts rows"
        if isinstance(entry, fx.Node):
            return f"{where} indexes with a tensor beside the token dimension"
        dim += 1
    return None


def padding_unsafe(gm: fx.GraphModule, splitting_ops) -> str | None:
    """Why padding a step of ``gm`` with dummy rows could change its real rows (a node
    that mixes rows outside the splitting ops), or None. The token symbols are those of
    the graph's inputs' first dimension."""
    syms, counts = set(), set()
    for node in gm.graph.nodes:
        v = node_value(node)
        if node.op == "placeholder" and isinstance(v, torch.Tensor) and v.dim() and isinstance(v.shape[0], torch.SymInt):
            syms |= symbols(v.shape[0])
            counts.add(v.shape[0].node.expr)
    if not syms:
        return None
    skipped = set(splitting_ops) | {TRIM_OP}
    for node in gm.graph.nodes:
        if node.op == "call_function" and op_name(node.target) in skipped:
            continue
        why = row_mixing(node, syms, counts)
        if why is not None:
            return why
    return None
