"""Find the decoder-replay region between the boundary markers and extract it.

The region becomes its own graph module (inputs: the row-indexed values passed to
``replay_begin``, then the row-independent values it reads, e.g. weights). In the main
graph it is replaced by one ``trim_and_redispatch`` call that writes into output
tensors allocated just before it, so they belong to the preceding graph piece and have
a stable address when that piece is captured.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

from ..compat.dynamo import shares_memory
from ..ops import BEGIN, END
from .common import op_name, is_op, node_value
from .row_local import declared_row_local, row_mixing, symbols

class ReplayRegionError(ValueError):
    """The graph's replay region cannot be extracted; the message says why."""


@dataclass
class ExtractedRegion:
    graph: fx.GraphModule
    num_row_inputs: int
    num_outputs: int
    window: int | None
    # The constants (region inputs after the rows) the main graph computes, rather than
    # takes as graph inputs: their addresses may change from step to step.
    computed_consts: tuple[int, ...] = ()


class MarkerError(ValueError):
    """The graph's markers do not pair up: which layers read the replay floor would
    depend on graphs this one cannot see."""


def replay_spans(gm: fx.GraphModule) -> frozenset:
    """The nodes from each ``replay_begin`` to the ``replay_end`` after it: those the
    markers point at the replay layers' view when the model runs uncompiled, which a
    region left in the main graph must point there too. Raises :class:`MarkerError`
    where the markers do not alternate begin, end, begin, end within the graph."""
    inside, opened = [], None
    hint = ("mark the replay layers with one replay_begin and one replay_end in one graph (a graph break "
            "between them splits the pair: TORCH_LOGS=graph_breaks names it)")
    for node in gm.graph.nodes:
        if is_op(node, BEGIN):
            if opened is not None:
                raise MarkerError(f"replay_begin at {node.name} comes while the one at {opened.name} is still "
                                  f"open: {hint}")
            opened = node
        elif is_op(node, END):
            if opened is None:
                raise MarkerError(f"replay_end at {node.name} has no replay_begin before it in this graph: {hint}")
            opened = None
        elif opened is not None:
            inside.append(node)
    if opened is not None:
        raise MarkerError(f"replay_begin at {opened.name} has no replay_end after it in this graph: {hint}")
    return frozenset(inside)


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


def marked_window(gm: fx.GraphModule) -> int | None:
    """The window ``replay_begin`` declares, or None where the markers are missing or
    malformed (:func:`extract_replay_region` then says why)."""
    try:
        markers = find_markers(gm)
    except ReplayRegionError:
        return None
    if markers is None:
        return None
    begin = markers[0]
    return begin.args[1] if len(begin.args) > 1 else begin.kwargs.get("window")


def _computed(x: fx.Node, graph_inputs: list[torch.Tensor]) -> bool:
    """Whether the main graph computes ``x`` into memory of its own, whose address may
    change from step to step: not a graph input, nor a view of one of ``graph_inputs``
    (a weight's slice or transpose keeps the weight's memory). Where torch cannot tell
    a view, computed: holding a copy of a view is safe, only slower."""
    if x.op in ("placeholder", "get_attr"):
        return False
    v = node_value(x)
    return not any(shares_memory(v, w) for w in graph_inputs)


def _check_after_end(gm: fx.GraphModule, end: fx.Node, allowed_ops, token_syms: set, row_counts: set) -> None:
    """What reads the region's results after ``replay_end`` reads each row alone: after
    a trim only the kept rows hold results, and the caller reads only those."""
    after = set(end.users)
    for node in gm.graph.nodes:
        if node not in after and not any(x in after for x in node.all_input_nodes):
            continue
        after.add(node)
        if node.op == "output":
            continue
        if is_op(node, allowed_ops) and not declared_row_local(node.target):
            raise ReplayRegionError(f"{op_name(node.target)} at {node.name} (a splitting op: attention, or an op not "
                                    "declared row-local) runs after replay_end on the region's results, whose rows a "
                                    "trim leaves unwritten but the kept ones: every attention layer from the first "
                                    "replay layer on goes inside the region")
        why = row_mixing(node, token_syms, row_counts)
        if why is not None:
            raise ReplayRegionError(f"after replay_end, the region's results are not row-local: {why} (after a "
                                    "trim only the kept rows hold results)")


def extract_replay_region(gm: fx.GraphModule, allowed_ops, forbidden_ops) -> ExtractedRegion | None:
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
    token_syms = set().union(*(symbols(node_value(x)) for x in row_inputs))
    if not token_syms:
        raise ReplayRegionError("replay_begin inputs have no symbolic token dimension "
                                "(was the token count marked dynamic?)")
    for x in row_inputs:
        v = node_value(x)
        if not isinstance(v, torch.Tensor) or not v.dim() or not symbols(v.shape[0]) & token_syms:
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
    row_counts = {n0.node.expr}

    def outside(x: fx.Node) -> fx.Node:
        v = node_value(x)
        syms = symbols(v)
        if isinstance(v, torch.SymInt) and v.node.expr in local_sizes:
            return local_sizes[v.node.expr]
        if syms and not syms & token_syms:  # the trim op passes the region tensors only
            raise ReplayRegionError(
                f"the replay region reads {x.name}, a Python number the model is called with (symbolic under "
                "dynamic=True), and takes nothing but tensors from outside it: trace with the token dimension "
                "alone dynamic (replay_backend.compile, or mark_token_dims), or pass the number as a 0-dim tensor")
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
        # replay_begin's outputs too: after a trim only the replay rows exist
        for user in node.users:
            if user not in body_set and user is not end:
                raise ReplayRegionError(f"{node.name}, {'an output of replay_begin' if node in env else 'computed'} "
                                        f"in the replay region, is used by {user.name} after it: the boundary "
                                        "must be single-exit")
        if node in env:
            continue
        if is_op(node, forbidden_ops):
            raise ReplayRegionError(f"KV source op {op_name(node.target)} at {node.name} lies after the cut: "
                                    "the replay region must not write KV that later layers or steps read "
                                    "for every row (declared kv_source=True)")
        if not is_op(node, allowed_ops):
            why = row_mixing(node, token_syms, row_counts)
            if why is not None:
                raise ReplayRegionError(f"replay region is not row-local: {why}")
        for x in node.all_input_nodes:
            if x not in body_set and x not in env:
                env[x] = outside(x)
        env[node] = rg.node_copy(node, lambda x: env[x])
    end_inputs = list(end.args[0])
    for x in end_inputs:
        if x not in body_set and x not in env:
            raise ReplayRegionError(f"replay_end output {x.name} is not computed in the region")
        v = node_value(x)
        rows = v.shape[0] if isinstance(v, torch.Tensor) and v.dim() else None
        if not isinstance(rows, torch.SymInt) or rows.node.expr != n0.node.expr:
            shape = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            raise ReplayRegionError(f"replay_end input {x.name} ({shape}) is not indexed by token: the region's "
                                    "results leave it one row per token, as its inputs enter it")
    _check_after_end(gm, end, allowed_ops, token_syms, row_counts)
    rg.output(tuple(env[x] for x in end_inputs))
    region = fx.GraphModule(gm, rg, class_name="ReplayRegion")

    # ---- rewrite the main graph ------------------------------------------------------
    g = gm.graph
    with g.inserting_before(begin):
        size = g.call_function(torch.ops.aten.sym_size.int, (row_inputs[0], 0))
        size.meta["example_value"] = n0
        outs = []
        for x in end_inputs:
            v = node_value(x)
            rest = [int(s) for s in v.shape[1:]]
            outs.append(g.call_function(torch.empty, ((size, *rest),),
                                        {"dtype": v.dtype, "device": v.device}))
            # The value the later passes see (row-locality, splitting): the step's rows,
            # shaped as the region's output
            outs[-1].meta["example_value"] = v
        g.call_function(torch.ops.dsv41_replay.trim_and_redispatch.default, (row_inputs, consts, outs))
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
    inputs = [v for n in g.nodes
              if n.op in ("placeholder", "get_attr") and isinstance(v := node_value(n), torch.Tensor)]
    computed = tuple(i for i, x in enumerate(consts) if _computed(x, inputs))
    return ExtractedRegion(region, len(row_inputs), len(end_inputs), window, computed)
