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

from .common import node_value, op_name, op_tags
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
    "empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like",
    "iadd", "isub", "imul", "itruediv", "add_", "sub_", "mul_", "div_", "copy_", "fill_", "zero_",
})
# Shape ops that move or split dimensions but keep the token dimension whole.
MOVES = frozenset({"unsqueeze", "squeeze", "transpose", "permute", "t", "expand", "expand_as", "movedim",
                   "swapaxes", "swapdims", "broadcast_to"})
# Reshapes: row-local only with the token dimension leading before and after (rows are
# then contiguous runs of the same elements).
RESHAPES = frozenset({"view", "reshape", "flatten", "unflatten", "view_as", "reshape_as"})
# Ops along a dimension: row-local when that dimension is not the token dimension.
ALONG_DIM = frozenset({
    "sum", "mean", "amax", "amin", "max", "min", "prod", "softmax", "log_softmax", "norm", "var", "std",
    "logsumexp", "all", "any", "argmax", "argmin", "topk", "sort", "argsort", "cumsum", "cumprod",
    "cummax", "cummin", "flip", "roll", "cat", "concat", "concatenate", "stack", "scatter", "scatter_add",
    "scatter_reduce", "gather", "index_select", "take_along_dim", "chunk", "split", "unbind", "narrow",
    "select", "tensor_split", "diff",
})
CONTRACTIONS = frozenset({"matmul", "mm", "bmm", "linear", "einsum"})
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


def named_args(node: fx.Node) -> dict:
    """The node's arguments by schema name, where torch can tell (else its kwargs)."""
    from torch.fx.operator_schemas import normalize_function

    target, args = node.target, node.args
    if node.op == "call_method":
        target = getattr(torch, node.target, None)
    if target is None or not callable(target):
        return dict(node.kwargs)
    try:
        norm = normalize_function(target, tuple(args), dict(node.kwargs), normalize_to_only_use_kwargs=True)
    except Exception:  # unknown or ambiguous signature: only what is named
        norm = None
    return dict(norm.kwargs) if norm is not None else dict(node.kwargs)


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
    ins = [(a, x, token_dims(x, token_syms)) for a, x in _tensors(node)]
    rowed = [(a, x, d) for a, x, d in ins if d]
    out = node_value(node)
    if isinstance(out, (torch.SymInt, int, float, bool)) or _name(node) in SIZES:
        return None  # a size of the rows, not their values
    outs = [o for o in (out if isinstance(out, (list, tuple)) else [out]) if isinstance(o, torch.Tensor)]
    name = _name(node)
    where = f"{node.name} ({name})"
    if not rowed:
        return None  # reads no rows: its values are the same for every row
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
    if short in MOVES:
        return None  # the checks above: one whole token dimension in and out
    if short in RESHAPES:
        ok = all(d[0] == 0 for _, _, d in rowed) and all(token_dims(o, token_syms) == [0] for o in outs)
        return None if ok else f"{where} reshapes across the token dimension"
    if short in ALONG_DIM:
        return _along_dim(node, short, where, rowed)
    if short in CONTRACTIONS:
        return _contraction(node, short, where, rowed)
    return f"{where} is not known to be row-local"


def _aligned(where, rowed, outs, token_syms) -> str | None:
    """Broadcasting keeps rows apart when every token dimension sits at the same place
    counted from the last dimension."""
    places = {x.dim() - d[0] for _, x, d in rowed} | {o.dim() - token_dims(o, token_syms)[0] for o in outs}
    return None if len(places) == 1 else f"{where} broadcasts rows against other dimensions"


# Where an op's dimension stands among its positional arguments (``self`` first), for
# calls whose signature torch cannot bind by name.
_DIM_POSITION = {"chunk": 2, "split": 2, "tensor_split": 2, "topk": 2, "roll": 2, "cumsum": 1, "cumprod": 1}


def _along_dim(node, short: str, where: str, rowed) -> str | None:
    args = named_args(node)
    dims = args.get("dim", args.get("dims", args.get("axis")))
    if dims is None and not args:
        pos = _DIM_POSITION.get(short, 1)
        dims = node.args[pos] if len(node.args) > pos else node.kwargs.get("dim")
    if dims is None and short in ("chunk", "split", "tensor_split", "unbind", "cat", "concat", "stack",
                                  "concatenate", "select", "narrow", "diff") and "dim" not in args:
        dims = 0 if short not in ("diff",) else -1  # these ops default to the first (diff: last) dimension
    if dims is None:
        return f"{where} works over every dimension, the token dimension among them"
    dims = [dims] if isinstance(dims, int) else list(dims)
    if not all(isinstance(d, int) for d in dims):
        return f"{where} works along a dimension not known when traced"
    places = {d[0] for _, _, d in rowed}
    if short in ("cat", "concat", "concatenate", "stack", "scatter", "scatter_add", "scatter_reduce",
                 "gather", "take_along_dim") and len(places) > 1:
        return f"{where} combines tensors whose token dimensions differ"
    for _, x, d in rowed:
        if any(k % max(x.dim(), 1) == d[0] for k in dims):
            return f"{where} works along the token dimension"
    return None


def _contraction(node, short: str, where: str, rowed) -> str | None:
    if short == "einsum":
        return _einsum(node, where)
    values = [node_value(a) for a in node.args[:2]]
    dims = [token_dims_of(v, rowed) for v in values]
    a, b = values
    if short == "linear":
        if dims[1] is not None or (len(node.args) > 2 and token_dims_of(node_value(node.args[2]), rowed) is not None):
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


def _einsum(node, where: str) -> str | None:
    eq = node.args[0] if isinstance(node.args[0], str) else None
    if eq is None or "->" not in eq or "." in eq:
        return f"{where}: an einsum without an explicit output is not analysed"
    lhs, out = eq.replace(" ", "").split("->")
    operands = node.args[1:] if not isinstance(node.args[1], (list, tuple)) else node.args[1]
    letters = set()
    for spec, arg in zip(lhs.split(","), operands):
        v = node_value(arg)
        d = next((k for k, s in enumerate(getattr(v, "shape", ())) if isinstance(s, torch.SymInt)), None)
        if d is not None:
            letters.add(spec[d])
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
    for node in gm.graph.nodes:
        if node.op == "call_function" and op_name(node.target) in set(splitting_ops) | {TRIM_OP}:
            continue
        why = row_mixing(node, syms, counts)
        if why is not None:
            return why
    return None
