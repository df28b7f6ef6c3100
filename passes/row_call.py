"""One op call as the row-locality rules see it (:mod:`.row_rules`): its node, its
arguments bound by name with their defaults, and the token dimension of every tensor
it reads and makes."""
from __future__ import annotations

from dataclasses import dataclass, field

from torch import fx

from .common import named_args, node_value

MISSING = object()


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

    def arg(self, *names: str, pos: int | None = None, default=MISSING):
        """A bound argument by one of its names, else the positional one (for calls no
        signature binds), else ``default``; ``MISSING`` where absent."""
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
        return [value_of(x) for x in a] if isinstance(a, (list, tuple)) else value_of(a)

    def refuse(self, why: str) -> str:
        return f"{self.where} {why}"


def value_of(a):
    return node_value(a) if isinstance(a, fx.Node) else a


def aligned(c: Call) -> str | None:
    """Broadcasting keeps rows apart when every token dimension sits at the same place
    counted from the last dimension: row i then meets row i of every operand and lands
    in row i of the result."""
    places = {x.dim() - d for _, x, d in c.rowed} | {o.dim() - d for o, d in c.outs}
    return None if len(places) == 1 else c.refuse("broadcasts rows against other dimensions")
