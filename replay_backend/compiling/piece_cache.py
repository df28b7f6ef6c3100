"""Compile identical pieces once.

The pieces of a decoder stack repeat: every layer of one kind splits into the same graph
with its own weights as inputs. A piece's key is its graph with nodes renamed by
position, plus the metadata of its inputs (token symbols renamed by first appearance),
so layer 5's piece and layer 6's share one compiled artifact. A cache object can be
shared by several backends (e.g. the benchmark's modes) to compile each piece once per
process.
"""
from __future__ import annotations

import hashlib
import re
from typing import Callable

import torch
from torch import fx

_SYM = re.compile(r"\bs\d+\b")


def _target(t) -> str:
    return t if isinstance(t, str) else f"{getattr(t, '__module__', '')}.{getattr(t, '__qualname__', repr(t))}" \
        if callable(t) else repr(t)


def piece_key(gm: fx.GraphModule, args) -> str | None:
    """A structural key, or None when the piece holds module state (get_attr)."""
    names: dict[fx.Node, str] = {}
    lines = []
    for i, node in enumerate(gm.graph.nodes):
        if node.op == "get_attr":
            return None
        names[node] = f"v{i}"
        a = fx.map_arg((node.args, node.kwargs), lambda n: names[n])
        lines.append(f"{node.op}|{_target(node.target) if node.op != 'placeholder' else ''}|{a!r}")
    for x in args:
        if isinstance(x, torch.Tensor):
            lines.append(f"T{tuple(x.shape)}|{x.dtype}|{tuple(x.stride())}|{x.device.type}")
        else:
            lines.append(f"{type(x).__name__}|{x if not isinstance(x, torch.SymInt) else 'sym'}")
    text = "\n".join(lines)
    seen: dict[str, str] = {}
    text = _SYM.sub(lambda m: seen.setdefault(m.group(0), f"S{len(seen)}"), text)
    return hashlib.sha256(text.encode()).hexdigest()


class PieceCache:
    def __init__(self) -> None:
        self._fns: dict[str, Callable] = {}

    def get_or_compile(self, gm: fx.GraphModule, args, compile_fn: Callable[[], Callable]
                       ) -> tuple[Callable, bool]:
        """The compiled piece and whether it came from the cache."""
        key = piece_key(gm, args)
        if key is not None and key in self._fns:
            return self._fns[key], True
        fn = compile_fn()
        if key is not None:
            self._fns[key] = fn
        return fn, False

    def __len__(self) -> int:
        return len(self._fns)
