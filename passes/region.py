"""Find the decoder-replay region between the boundary markers and extract it.

The region becomes its own graph module (inputs: the row-indexed values passed to
``replay_begin``, then the row-independent values it reads, e.g. weights). In the main
graph it is replaced by one ``trim_and_redispatch`` call that writes into output
tensors allocated just before it, so they belong to the preceding graph piece and have
a stable address when that piece is captured (SPEC §7).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

from .common import is_op, node_value

BEGIN = "dsv41_replay::replay_begin"
END = "dsv41_replay::replay_end"
TRIM = "dsv41_replay::trim_and_redispatch"

# Ops that mix rows when applied along the token dimension.
_ROW_MIXING = {"cumsum", "cumprod", "cummax", "cummin", "flip", "roll", "sort", "argsort"}


class ReplayRegionError(ValueError):
    """The graph's replay region cannot be extracted; the message says why."""


@dataclass
class ExtractedRegion:
    graph: fx.GraphModule
    num_row_inputs: int
    num_outputs: int
    window: int | None


def _symbols(value) -> set:
    if isinstance(value, torch.SymInt):
        return set(value.node.expr.free_symbols)
    if isinstance(value, torch.Tensor):
        out = set()
        for s in value.shape:
            if isinstance(s, torch.SymInt):
                out |= set(s.node.expr.free_symbols)
        return out
    if isinstance(value, (list, tuple)):
        return set().union(*(_symbols(v) for v in value)) if value else set()
    return set()


def find_markers(gm: fx.GraphModule) -> tuple[fx.Node, fx.Node] | None:
    begins = [n for n in gm.graph.nodes if is_op(n, BEGIN)]
    ends = [n for n in gm.graph.nodes if is_op(n, END)]
    if not begins and not ends:
        return None
    if len(begins) != 1 or len(ends) != 1:
        raise ReplayRegionError(f"the replay boundary must be marked once: found {len(begins)} "
                                f"replay_begin and {len(ends)} replay_end markers")
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    if order[ends[0]] < order[begins[0]]:
        raise ReplayRegionError("replay_end comes before replay_begin")
    return begins[0], ends[0]


def _token_dim(value, token_syms: set) -> int | None:
    if isinstance(value, torch.Tensor):
        for i, s in enumerate(value.shape):
            if _symbols(s) & token_syms:
                return i
    return None


def _named_args(node: fx.Node) -> dict:
    """The node's arguments by schema name, where torch can tell (else its kwargs)."""
    from torch.fx.operator_schemas import normalize_function

    target = node.target
    args = node.args
    if node.op == "call_method":
        target, args = getattr(torch, node.target, None), node.args
    if target is None or not callable(target):
        return dict(node.kwargs)
    try:
        norm = normalize_function(target, tuple(args), dict(node.kwargs), normalize_to_only_use_kwargs=True)
    except Exception:  # unknown or ambiguous signature: fall back to what is named
        norm = None
    return dict(norm.kwargs) if norm is not None else dict(node.kwargs)


def _check_row_local(node: fx.Node, token_syms: set) -> None:
    """A structural check of row-locality: no op may work *along* the token dimension
    (a ``dim``/``dims`` argument naming it: softmax, cumsum, roll, cat, index_select...),
    drop it (a reduction over rows) or pair rows with rows (two token dimensions)."""
    ins = [node_value(a) for a in node.all_input_nodes]
    dims = [(d, v) for v in ins if (d := _token_dim(v, token_syms)) is not None]
    if not dims:
        return
    name = str(getattr(node.target, "__name__", node.target)).split(".")[-1]
    tok, first = dims[0]
    named = _named_args(node)
    for key in ("dim", "dims", "axis"):
        val = named.get(key)
        if isinstance(val, int) or isinstance(val, (list, tuple)):
            wanted = [val] if isinstance(val, int) else [d for d in val if isinstance(d, int)]
            if any(d % max(first.dim(), 1) == tok for d in wanted):
                raise ReplayRegionError(f"replay region is not row-local: {node.name} ({name}) "
                                        "works along the token dimension")
    if name in _ROW_MIXING and not any(k in named for k in ("dim", "dims", "axis")):
        raise ReplayRegionError(f"replay region is not row-local: {node.name} ({name}) "
                                "mixes rows along the token dimension")
    out = node_value(node)
    outs = out if isinstance(out, (list, tuple)) else [out]
    for o in outs:
        if not isinstance(o, torch.Tensor):
            continue
        n_tok = sum(1 for s in o.shape if _symbols(s) & token_syms)
        if n_tok == 0:
            raise ReplayRegionError(f"replay region is not row-local: {node.name} ({name}) "
                                    "reduces over the token dimension")
        if n_tok > 1:
            raise ReplayRegionError(f"replay region is not row-local: {node.name} ({name}) "
                                    "pairs rows with rows")


def extract_replay_region(gm: fx.GraphModule, allowed_ops, forbidden_ops, region_id: int = 0
                          ) -> ExtractedRegion | None:
    """Move the region out of ``gm`` (in place) and return it; None if unmarked."""
    markers = find_markers(gm)
    if markers is None:
        return None
    begin, end = markers
    nodes = list(gm.graph.nodes)
    body = nodes[nodes.index(begin) + 1:nodes.index(end)]
    body_set = set(body)
    row_inputs = list(begin.args[0])
    window = begin.args[1] if len(begin.args) > 1 else begin.kwargs.get("window")
    token_syms = set().union(*(_symbols(node_value(x)) for x in row_inputs))
    if not token_syms:
        raise ReplayRegionError("replay_begin inputs have no symbolic token dimension "
                                "(was the token count marked dynamic?)")
    for x in row_inputs:
        v = node_value(x)
        if not isinstance(v, torch.Tensor) or not v.dim() or not _symbols(v.shape[0]) & token_syms:
            raise ReplayRegionError(f"replay_begin input {getattr(x, 'name', x)} is not indexed by token")

    rg = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    # The region's token count is its first input, a SymInt placeholder like Dynamo's own
    # (split_module needs symbols bound by placeholders). Inside the region it is the
    # replay batch's row count, not the step's token count.
    n_rows = rg.placeholder("num_rows")
    rows = [rg.placeholder(f"row_{i}") for i in range(len(row_inputs))]
    for user in begin.users:
        if user.op == "call_function" and user.target is operator.getitem:
            env[user] = rows[user.args[1]]
        else:
            raise ReplayRegionError(f"replay_begin output used directly by {user.name}")
    consts: list[fx.Node] = []
    const_ph: dict[fx.Node, fx.Node] = {}
    for ph, orig in zip(rows, row_inputs):
        ph.meta["example_value"] = node_value(orig)
    n0 = node_value(row_inputs[0]).shape[0]
    n_rows.meta["example_value"] = n0
    if any(node_value(x).shape[0].node.expr != n0.node.expr for x in row_inputs):
        raise ReplayRegionError("replay_begin inputs disagree on the token count symbol")
    local_sizes = {n0.node.expr: n_rows}

    def outside(x: fx.Node) -> fx.Node:
        v = node_value(x)
        syms = _symbols(v)
        if isinstance(v, torch.SymInt) and v.node.expr in local_sizes:
            return local_sizes[v.node.expr]
        if syms:
            raise ReplayRegionError(
                f"the replay region reads {x.name}, a token-indexed value computed outside it; "
                "pass it through replay_begin so it can be trimmed with the rows")
        if x not in const_ph:
            last = const_ph[consts[-1]] if consts else rows[-1]
            consts.append(x)
            with rg.inserting_after(last):  # placeholders stay ahead of every computation
                const_ph[x] = rg.placeholder(f"const_{len(consts) - 1}")
            const_ph[x].meta["example_value"] = node_value(x)
        return const_ph[x]

    for node in body:
        if node in env:
            continue
        if is_op(node, forbidden_ops):
            raise ReplayRegionError(f"KV source op {node.target} at {node.name} lies after the cut: "
                                    "the replay region must not write global KV")
        for user in node.users:
            if user not in body_set and user is not end:
                raise ReplayRegionError(f"{node.name}, computed in the replay region, is used by "
                                        f"{user.name} after it: the boundary must be single-exit")
        if not is_op(node, allowed_ops):
            _check_row_local(node, token_syms)
        for x in node.all_input_nodes:
            if x not in body_set and x not in env:
                env[x] = outside(x)
        env[node] = rg.node_copy(node, lambda x: env[x])
    end_inputs = list(end.args[0])
    for x in end_inputs:
        if x not in body_set and x not in env:
            raise ReplayRegionError(f"replay_end output {x.name} is not computed in the region")
    rg.output(tuple(env[x] for x in end_inputs))
    region = fx.GraphModule(gm, rg, class_name="ReplayRegion")

    # ---- rewrite the main graph ------------------------------------------------------
    g = gm.graph
    with g.inserting_before(begin):
        size = g.call_function(torch.ops.aten.sym_size.int, (row_inputs[0], 0))
        outs = []
        for x in end_inputs:
            v = node_value(x)
            rest = [int(s) for s in v.shape[1:]]
            outs.append(g.call_function(torch.empty, ((size, *rest),),
                                        {"dtype": v.dtype, "device": v.device}))
        trim = g.call_function(torch.ops.dsv41_replay.trim_and_redispatch.default,
                               (row_inputs, consts, outs, region_id))
    for user in list(end.users):
        if user.op == "call_function" and user.target is operator.getitem:
            user.replace_all_uses_with(outs[user.args[1]])
            g.erase_node(user)
        else:
            raise ReplayRegionError(f"replay_end output used directly by {user.name}")
    g.erase_node(end)
    for node in reversed(body):
        g.erase_node(node)
    g.erase_node(begin)
    g.lint()
    gm.recompile()
    trim.meta["replay_region"] = region_id
    return ExtractedRegion(region, len(row_inputs), len(end_inputs), window)
