"""A symbolic float computed once per use: no symbolic float crosses a piece boundary.

Under ``dynamic=True`` Dynamo passes a Python float as a 0-dim tensor and reads it with
``.item()``, once, where the float is first used; every later use takes that symbolic
float. Split into pieces, a float used by several layers would leave the piece that
reads it as a piece output. Inductor compiles a piece's floats into tensor ops only
where it sees their source: a float among a piece's outputs or inputs it cannot, so it
bakes the float's first value into the piece and guards it, and a call with another
value becomes a recompile. Read again right before each use, the float is computed
inside every graph piece that uses it, from the 0-dim tensor, which crosses boundaries
as any tensor does. (A float an op's float argument takes, a splitting op's included,
is one the trace has fixed to its value already: nothing of it is left to cross.)
"""
from __future__ import annotations

import torch
from torch import fx

from .common import node_value


def _is_float(node) -> bool:
    return isinstance(node, fx.Node) and node.op != "placeholder" and isinstance(node_value(node), torch.SymFloat)


def float_per_use(gm: fx.GraphModule) -> int:
    """Give every use of a computed symbolic float its own copy of it (and of the float
    arithmetic behind it), right before the use; the originals, then unused, go.
    Returns the number of uses given a copy."""
    made = 0
    for node in list(gm.graph.nodes):
        if not _is_float(node):
            continue
        for user in [u for u in node.users if not _is_float(u)]:
            with gm.graph.inserting_before(user):
                user.replace_input_with(node, _copy(gm.graph, node))
            made += 1
    if made:
        for node in reversed(list(gm.graph.nodes)):
            if _is_float(node) and not node.users:
                gm.graph.erase_node(node)
        gm.graph.lint()
        gm.recompile()
    return made


def _copy(graph: fx.Graph, node: fx.Node) -> fx.Node:
    """``node`` and the float arithmetic it is computed from, at the insertion point."""
    args, kwargs = fx.map_arg((node.args, node.kwargs), lambda a: _copy(graph, a) if _is_float(a) else a)
    copy = graph.create_node(node.op, node.target, args, kwargs)
    copy.meta = dict(node.meta)
    return copy
