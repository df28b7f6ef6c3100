"""Split a graph at its splitting ops (attention, the trim op), keeping original order.

Every splitting op becomes a one-node piece that runs eagerly between the compiled
pieces; everything between two splitting ops becomes one graph piece.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

from torch import fx
from torch.fx.passes.split_module import split_module

from .common import is_op, layers_of, op_name, op_tags
from .roles import OpRole, roles_of


@dataclass
class PieceInfo:
    """One piece of a split graph, as shown by ``inspect``."""

    name: str  # submodule name in the split graph
    kind: str  # "graph" | "attention" | "replay"
    layers: list[int] = field(default_factory=list)
    num_ops: int = 0
    op: str | None = None  # the splitting op, for attention / replay pieces
    # An attention piece of the replay layers left in the main graph (their region not
    # cut out): it runs with the replay layers' view of the batch.
    in_region: bool = False

    def as_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "layers": self.layers,
                "num_ops": self.num_ops, "op": self.op, "in_region": self.in_region}


def split_at_ops(gm: fx.GraphModule, splitting_ops, replay_op: str | None = None,
                 in_region: frozenset = frozenset()) -> tuple[fx.GraphModule, list[PieceInfo]]:
    """``in_region``: nodes of the replay layers, whose attention pieces are marked."""
    splitting_ops = set(splitting_ops) | ({replay_op} if replay_op else set())
    part: dict[fx.Node, int] = {}
    pid = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if is_op(node, splitting_ops):
            pid += 1
            part[node] = pid
            pid += 1
        else:
            part[node] = pid
    split = split_module(gm, None, lambda n: part[n], keep_original_order=True)

    infos = []
    by_part: dict[int, list[fx.Node]] = {}
    for node, p in part.items():
        by_part.setdefault(p, []).append(node)
    for node in split.graph.nodes:
        if node.op != "call_module":
            continue
        nodes = by_part[int(node.target.split("_")[-1])]
        split_op = next((op_name(n.target) for n in nodes if is_op(n, splitting_ops)), None)
        kind = "graph" if split_op is None else ("replay" if split_op == replay_op else "attention")
        layers = sorted(set().union(*(layers_of(n) for n in nodes)))
        ops = sum(1 for n in nodes if n.op in ("call_function", "call_method", "call_module"))
        region = kind == "attention" and any(n in in_region for n in nodes)
        infos.append(PieceInfo(node.target, kind, layers, ops, split_op, region))
    return split, infos


def live_across(split: fx.GraphModule, piece: str) -> set[str]:
    """Pieces before ``piece`` whose outputs are still read after it (or by it, for its
    out-arguments, which the pieces after it read).

    Their outputs are alive while ``piece`` runs; graphs it runs from the same memory
    pool must not have been given their memory (see ``capture/graphs.py``)."""
    order = {n: i for i, n in enumerate(split.graph.nodes)}
    at = next((n for n in split.graph.nodes if n.op == "call_module" and n.target == piece), None)
    if at is None:
        return set()

    def readers(node: fx.Node):
        for user in node.users:  # a multi-output piece is read through getitem nodes
            if user.op == "call_function" and user.target is operator.getitem:
                yield from readers(user)
            else:
                yield user

    return {n.target for n in split.graph.nodes
            if n.op == "call_module" and order[n] < order[at]
            and any(order[u] >= order[at] for u in readers(n))}



# How input_sources names a piece input that is an input of the whole graph (a weight, a
# buffer, a tensor argument), which the piece's address check tells apart by it.
GRAPH_INPUT = "the graph input"


def input_sources(split: fx.GraphModule, infos) -> dict[str, tuple[str, ...]]:
    """Per piece, where each of its inputs comes from, in words, for the error a captured
    graph raises when an input moved: the usual cause is an eager op (an attention op)
    that allocated its output instead of writing into the out-argument it was given."""
    kinds = {p.name: p for p in infos}

    def producer(node):
        if node.op == "call_function" and node.target is operator.getitem:
            node = node.args[0]
        return node

    def describe(a) -> str:
        if not isinstance(a, fx.Node):
            return "a constant"
        p = producer(a)
        if p.op == "placeholder":
            return f"{GRAPH_INPUT} {p.name}"
        info = kinds.get(p.target) if p.op == "call_module" else None
        if info is None:
            return f"{a.name}"
        if info.kind == "graph":
            return f"an output of piece {info.name}"
        return (f"an output of {info.name}, the {info.kind} op {info.op}, which must write into an out-argument "
                "the piece before it allocated, not return a tensor of its own")

    return {n.target: tuple(describe(a) for a in n.args) for n in split.graph.nodes
            if n.op == "call_module" and n.target in kinds and kinds[n.target].kind == "graph"}


def unsplit_attention(nodes, splitting_ops) -> list[str]:
    """The declared attention ops (passes/roles.py) called by ``nodes`` that are not
    splitting ops, so would run inside a graph piece."""
    return sorted({op_name(n.target) for n in nodes if n.op == "call_function"
                   and OpRole.ATTENTION in roles_of(n.target) and op_name(n.target) not in splitting_ops})


def step_dependent_ops(gm: fx.GraphModule, splitting_ops, step_tags: tuple, exempt: frozenset = frozenset()
                       ) -> list[str]:
    """Ops carrying one of ``step_tags`` (they read per-step state, such as the step's
    metadata) that are not splitting ops, so would run inside a graph piece, where a
    captured graph replays the first step's values. ``exempt`` names ops whose
    captured behaviour is the intended one."""
    allowed = set(splitting_ops) | set(exempt)
    return sorted({op_name(n.target) for n in gm.graph.nodes
                   if n.op == "call_function" and op_name(n.target) not in allowed and set(op_tags(n)) & set(step_tags)})
