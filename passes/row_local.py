"""Row-locality: may a graph run on a subset of its rows, or on rows padded with dummies?

A node is row-local when every row of its outputs depends on the same row of its
token-indexed inputs alone (values without a token dimension, such as weights, are
read whole), and not on how many rows there are. The replay region must be row-local
for trimming to be exact, and so must the main graph for padding to leave the real
rows alone.

A token dimension is one whose size involves the token count's symbol. A call that
reads rows must read and make tensors with exactly one, of the row count's size: a
result without one reduced the rows, with two paired them, of another size selected,
shifted or folded them. What those checks cannot see (along which dimension an op
works, what a shape argument spans, what a product contracts) each op's rule decides
from its arguments bound to its schema or signature (:mod:`.row_tables` says which
rule, :mod:`.row_rules` and :mod:`.row_indexing` hold them). The analysis is a list
of what is proven row-local: an op without a rule is refused with its name, since it
may shift, convolve or reduce rows in ways no structural check sees. Opaque ops that
work on each row alone (a fused per-token kernel) are declared with :func:`roles.declare_row_local`;
splitting ops are checked by the caller's rules, not here.
"""
from __future__ import annotations

import operator
import os
import re

import torch
from torch import fx

from . import row_tables as rules
from ..ops import TRIM
from .common import named_args, node_value, op_name, op_tags
from .row_call import Call, aligned
from .roles import OpRole, roles_of

# The trim op reads the rows it is given and the step's own: padding is its concern.
TRIM_OP = TRIM
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def declared_row_local(target) -> bool:
    return OpRole.ROW_LOCAL in roles_of(target)


def symbols(value) -> set:
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
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
    if node.target is getattr and len(node.args) > 1 and isinstance(node.args[1], str):
        return node.args[1]  # ``h.T``: the attribute is the op
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


def _located(node: fx.Node, why: str) -> str:
    """``why`` with the user's source line (the innermost outside torch's own code),
    where the tracer recorded it."""
    frames = [f for f in _FRAME.findall(node.meta.get("stack_trace") or "") if not f[0].startswith(_TORCH_DIR)]
    return f"{why} ({os.path.basename(frames[-1][0])}:{frames[-1][1]})" if frames else why


def row_mixing(node: fx.Node, token_syms: set, row_counts: set) -> str | None:
    """Why ``node`` may mix rows, or None where it is row-local. ``row_counts`` holds the
    size expressions a token dimension may have (the graph's row count)."""
    if node.op not in ("call_function", "call_method"):
        return None
    try:
        why = _row_mixing(node, token_syms, row_counts)
    except Exception as e:  # noqa: BLE001 - a call form the rules do not expect is refused, not a crash
        why = f"{node.name} ({_name(node)}) could not be analysed ({type(e).__name__}: {e})"
    return None if why is None else _located(node, why)


def _row_mixing(node: fx.Node, token_syms: set, row_counts: set) -> str | None:
    ins = [(a, x, token_dims(x, token_syms)) for a, x in _tensors(node)]
    rowed = [(a, x, d) for a, x, d in ins if d]
    out = node_value(node)
    name = _name(node)
    short = name.split("::")[-1]
    if isinstance(out, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool, torch.Size)) \
            or short in rules.SIZES:
        return None  # a size of the rows, not their values (where a size becomes a value is checked below)
    outs = [o for o in (out if isinstance(out, (list, tuple)) else [out]) if isinstance(o, torch.Tensor)]
    where = f"{node.name} ({name})"
    # An op declared row-local may be given the row count (to size its work): the
    # declaration is the model's word that each row's values do not depend on it.
    declared = node.op == "call_function" and declared_row_local(node.target)
    if (outs or short == "setitem") and not declared and (why := _row_count_as_value(node, short, token_syms)):
        return f"{where} {why}"
    if not rowed:
        # Reads no rows. Where it makes a token dimension, its values must not depend on
        # the row's index (``arange(num_rows)`` numbers the replay rows, not the step's).
        if any(token_dims(o, token_syms) for o in outs) and short not in rules.SAME_FOR_EVERY_ROW:
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
            return f"{where} {'selects rows' if short == 'getitem' else 'reduces over the token dimension'}"
        if len(d) > 1:
            return f"{where} pairs rows with rows"
        if o.shape[d[0]].node.expr not in row_counts:
            return f"{where} changes the number of rows"
    call = Call(node, short, where, [(a, x, d[0]) for a, x, d in rowed],
                      [(o, token_dims(o, token_syms)[0]) for o in outs])
    return _rule(call)


def _rule(c: Call) -> str | None:
    node, target = c.node, c.node.target
    if node.op == "call_function" and isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        if declared_row_local(target):
            return None
        if torch.Tag.pointwise in op_tags(node):
            return aligned(c)
        if not op_name(target).startswith("aten::"):
            return c.refuse("is not known to be row-local: declare it with replay_backend.declare_row_local if "
                            "it works on each row alone, or with replay_backend.declare_attention if it reads "
                            "other rows or the step's metadata (an attention op)")
    elif node.op == "call_function" and not _from_torch(target):
        return c.refuse("is not known to be row-local")
    short = c.name
    if short.endswith("_") and not short.startswith("_") and short not in rules.POINTWISE:
        short = short[:-1]  # an in-place op writes its result over its input, row by row as its twin
    if short in rules.POINTWISE:
        return aligned(c)
    if short in rules.CONSTANT_FACTORIES or short in rules.MOVES:
        return None  # the checks above: one whole token dimension in and out
    rule = rules.RULES.get(short)
    return rule(c) if rule is not None else c.refuse("is not known to be row-local")


def _from_torch(target) -> bool:
    """Name-based rules hold for torch's own functions and Python's operators only: a
    function of the model's let into the graph may carry any name."""
    module = getattr(target, "__module__", None) or ""
    return module.split(".")[0] in ("torch", "operator", "_operator", "builtins", "math")


def _row_count_as_value(node: fx.Node, short: str, token_syms: set) -> str | None:
    """The row count may size a shape, but a value computed from it (``h / h.shape[0]``)
    differs between a step and its replay rows, or its padded rows."""
    if short in rules.RESHAPES or short in rules.MOVES or short == "getitem":
        return None
    args = named_args(node)
    if short in rules.CONSTANT_FACTORIES:  # sizes, but for the fill value
        at = {"full": 1, "full_like": 1, "new_full": 2}.get(short)
        values = [args.get("fill_value", node.args[at] if at is not None and len(node.args) > at else None)]
    elif args:
        values = [v for k, v in args.items() if k not in rules.SHAPE_PARAMS]
    else:
        values = [*node.args, *node.kwargs.values()]
    found = []
    fx.node.map_aggregate(values, found.append)
    for a in found:
        v = node_value(a)
        if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)) and symbols(v) & token_syms:
            return f"uses the row count {a.name} as a value"
    return None


def padding_unsafe(gm: fx.GraphModule, splitting_ops) -> str | None:
    """Why padding a step of ``gm`` with dummy rows could change its real rows (a node
    that mixes rows outside the splitting ops), or None. The token symbols are those of
    the graph's inputs' first dimension."""
    return _first_mixing(gm, set(splitting_ops) | {TRIM_OP}, frozenset())


def reads_rows_together(gm: fx.GraphModule, splitting_ops) -> str | None:
    """Why some value of ``gm`` depends on rows other than its own (a splitting op not
    declared row-local, attention say, or a node that mixes rows), or None: such a graph,
    run after another graph's replay region in one step, reads rows a trim left
    unwritten."""
    return _first_mixing(gm, {TRIM_OP}, frozenset(splitting_ops))


def _first_mixing(gm: fx.GraphModule, skipped: set, mixing_ops: frozenset) -> str | None:
    syms, counts = set(), set()
    for node in gm.graph.nodes:
        v = node_value(node)
        if node.op == "placeholder" and isinstance(v, torch.Tensor) and v.dim() and isinstance(v.shape[0], torch.SymInt):
            syms |= symbols(v.shape[0])
            counts.add(v.shape[0].node.expr)
    if not syms:
        return None
    for node in gm.graph.nodes:
        name = op_name(node.target) if node.op == "call_function" else None
        if name in skipped:
            continue
        if name in mixing_ops and not declared_row_local(node.target):
            return f"{node.name} ({name}: a splitting op, attention or an op not declared row-local)"
        why = row_mixing(node, syms, counts)
        if why is not None:
            return why
    return None
