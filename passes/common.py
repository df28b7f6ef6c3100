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


def named_args(node: fx.Node, defaults: bool = False) -> dict:
    """The node's arguments by schema name, bound to the one overload of its target that
    the traced values fit; ``{}`` where none or several different bindings fit (callers
    then read positions or refuse). Binding by the values, not by the argument count
    alone, keeps the answer the same whatever overloads a torch version lists: some list
    a named-dimension twin (``mean(x, dim: str[])``) beside ``mean(x, dim: int[])``.

    With ``defaults`` the parameters left out carry their declared defaults (a dimension
    a call leaves implicit is as decisive as one it spells out); a default on which the
    fitting overloads disagree is left out rather than guessed."""
    signatures = _signatures(node)
    values = fx.node.map_aggregate(node.args, _traced), fx.node.map_aggregate(dict(node.kwargs), _traced)
    found: list[tuple[dict, dict]] = []
    for sig in signatures:
        try:
            by_value = sig.bind(*values[0], **values[1])
            bound = sig.bind(*node.args, **node.kwargs)
        except TypeError:
            continue
        if not all(_fits(sig.parameters[k].annotation, v) for k, v in by_value.arguments.items()):
            continue
        given = dict(bound.arguments)
        bound.apply_defaults()
        found.append((given, dict(bound.arguments)))
    if not found or any(not _same(given, found[0][0]) for given, _ in found):
        return {}
    if not defaults:
        return found[0][0]
    full = found[0][1]
    return {k: v for k, v in full.items() if all(k in f and _same(f[k], v) for _, f in found)}


def _signatures(node: fx.Node) -> list[inspect.Signature]:
    """The signatures a call may bind to: a torch op's schemas (a tensor method's are its
    ``torch`` function's or its aten op's), else a Python function's own signature."""
    from torch.fx import operator_schemas

    if node.op == "call_method":
        target = getattr(torch, node.target, None)
        if target is None or not callable(target):
            target = getattr(torch.ops.aten, node.target, None) if not node.target.startswith("_") else None
    else:
        target = node.target
    if target is None or not callable(target):
        return []
    try:
        found = operator_schemas.get_signature_for_torch_op(target) or []
    except Exception:  # noqa: BLE001 - a target torch has no schema for
        found = []
    if found or not inspect.isfunction(target):
        return found
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return []
    # ``*args`` says nothing of what a position means (boolean_dispatch's wrappers)
    return [] if any(p.kind is p.VAR_POSITIONAL for p in sig.parameters.values()) else [sig]


def _same(a, b) -> bool:
    if a is b:
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    # by identity only: a symbolic size compared by value would record a guard on it
    opaque = (fx.Node, torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)
    if isinstance(a, opaque) or isinstance(b, opaque):
        return False
    try:
        return bool(type(a) is type(b) and a == b)
    except Exception:  # noqa: BLE001 - values without a plain equality
        return False


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
