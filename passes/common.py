"""Helpers shared by the FX passes."""
from __future__ import annotations

import re

import torch
from torch import fx

_LAYER = re.compile(r"layers(?:\[|\.|_)(\d+)")


def op_name(target) -> str | None:
    """``namespace::name`` of a torch op target (packet or overload), else None."""
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    return None


def op_tags(node: fx.Node) -> tuple:
    """The tags of the torch op a node calls (none for anything else)."""
    if node.op != "call_function":
        return ()
    target = node.target
    if isinstance(target, torch._ops.OpOverloadPacket):
        target = getattr(target, "default", None)
    return tuple(getattr(target, "tags", ()) or ()) if isinstance(target, torch._ops.OpOverload) else ()


def is_op(node: fx.Node, names) -> bool:
    if node.op != "call_function":
        return False
    name = op_name(node.target)
    return name is not None and (name == names if isinstance(names, str) else name in names)


def node_value(node) -> object:
    """The fake value Dynamo recorded for a node (None for literals and unknowns)."""
    if not isinstance(node, fx.Node):
        return None
    return node.meta.get("example_value", node.meta.get("val"))


def layers_of(node: fx.Node) -> set[int]:
    """Decoder layer indices a node belongs to, from Dynamo's module stack."""
    stack = node.meta.get("nn_module_stack") or {}
    found = set()
    for key, val in stack.items():
        path = val[0] if isinstance(val, tuple) else str(key)
        found.update(int(m) for m in _LAYER.findall(str(path)))
    return found
