"""Helpers shared by the FX passes."""
from __future__ import annotations

import inspect
import numbers
import re
import typing

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


def named_args(node: fx.Node) -> dict:
    """The node's arguments by schema name, bound to the one overload of its target that
    the traced values fit; ``{}`` where none or several different bindings fit (callers
    then read positions). Binding by the values, not by the argument count alone, keeps
    the answer the same whatever overloads a torch version lists: some list a
    named-dimension twin (``mean(x, dim: str[])``) beside ``mean(x, dim: int[])``."""
    from torch.fx import operator_schemas

    target = getattr(torch, node.target, None) if node.op == "call_method" else node.target
    if target is None or not callable(target):
        return {}
    try:
        signatures = operator_schemas.get_signature_for_torch_op(target) or []
    except Exception:  # noqa: BLE001 - a target torch has no schema for
        return {}
    values = fx.node.map_aggregate(node.args, _traced), fx.node.map_aggregate(dict(node.kwargs), _traced)
    found: dict | None = None
    for sig in signatures:
        try:
            by_value = sig.bind(*values[0], **values[1])
            bound = sig.bind(*node.args, **node.kwargs)
        except TypeError:
            continue
        if not all(_fits(sig.parameters[k].annotation, v) for k, v in by_value.arguments.items()):
            continue
        if found is not None and found != dict(bound.arguments):
            return {}
        found = dict(bound.arguments)
    return found or {}


_UNKNOWN = object()


def _traced(a):
    if isinstance(a, fx.Node):
        v = node_value(a)
        return _UNKNOWN if v is None else v
    return a


def _fits(annotation, value) -> bool:
    """May ``value`` (a traced value, or a literal) be passed where the schema says
    ``annotation``? Lenient where it cannot tell; strict on what tells overloads apart
    (tensors, numbers, names)."""
    if value is _UNKNOWN or annotation is inspect.Parameter.empty or annotation is typing.Any:
        return True
    origin = typing.get_origin(annotation)
    if origin is typing.Union:
        return any(_fits(a, value) for a in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if origin in (list, tuple):
        (elem, *_) = typing.get_args(annotation) or (typing.Any,)
        if isinstance(value, (list, tuple)):
            return all(_fits(elem, v) for v in value)
        return elem in (int, float) and _fits(elem, value)  # ``int[1]`` takes one int
    if annotation is torch.Tensor:
        return isinstance(value, torch.Tensor)
    if annotation is bool:
        return isinstance(value, (bool, torch.SymBool))
    if annotation is int:  # dtypes, layouts and memory formats are ints in schemas
        return isinstance(value, (int, torch.SymInt, torch.dtype, torch.layout, torch.memory_format))
    if annotation in (float, numbers.Number, complex):
        return isinstance(value, (int, float, complex, torch.SymInt, torch.SymFloat))
    if annotation is str:
        return isinstance(value, str)
    if isinstance(annotation, type):
        return isinstance(value, annotation) or not isinstance(value, (torch.Tensor, str, int, float))
    return True
