"""Calling the compiled model without Dynamo's entry.

After its one trace the model never traces again, so on every later call Dynamo's
entry does the same work to reach the same compiled model: it evaluates its guards
(over every parameter of the model) and runs the prologue that loads each parameter as
a graph argument, a large share of the host time before a graphed step's first kernel.
Two records make that call instead, each learned from one call Dynamo made:

* :class:`GraphCall` (every compiled model records its first call): the graph's own
  arguments with the token-indexed ones and the token count left open, so the backend
  runs dummy steps of any size (capture, the memory estimate) without the model's
  forward or Dynamo.
* :class:`DirectEntry`: the forward's arguments mapped onto the graph's, and the
  graph's outputs onto what the forward returns, so a user's call of the compiled
  model reaches the graph directly. Every forward tensor must be a graph argument or
  unused, every other graph argument a parameter or buffer of the model, every other
  forward argument a constant, and what the forward returns must be graph outputs and
  constants; any other shape of call is not learned (a counted fallback: calls then go
  through Dynamo).

What Dynamo's guards checked and the entry checks per call: each tensor input's dtype,
device and shape (the token-indexed ones past their first dimension, which they agree
on), the constant arguments' values, the arguments Python would refuse, and the grad
mode. What it does not see: a
parameter replaced by another object (the graphs read the old one's memory regardless:
update weights in place), module flags such as ``training``, and global state such as
the grad mode. ``direct_dispatch=false`` keeps Dynamo's entry on every call.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..compat import dynamo as compat_dynamo
from ..forward_context import set_forward_context


class CallLog:
    """The last call a backend's compiled model received while watched: the arguments
    as Dynamo passed them and the outputs the model returned. Only calls through
    Dynamo are watched, so a direct call pays one attribute test."""

    __slots__ = ("active", "call")

    def __init__(self) -> None:
        self.active = False
        self.call: tuple | None = None  # (model, args, outputs)

    def record(self, model, args: tuple, outputs: tuple) -> None:
        self.call = (model, args, outputs)

    def take(self) -> tuple | None:
        """The recorded ``(model, args, outputs)``, forgotten here: the outputs are the
        step's, not to be kept alive."""
        call, self.call = self.call, None
        return call

    def watch(self) -> "CallLog":
        """Record the calls inside a ``with``, from a clean slate."""
        self.call = None
        return self

    def __enter__(self) -> "CallLog":
        self.active = True
        return self

    def __exit__(self, *exc) -> None:
        self.active = False


@dataclass(frozen=True)
class GraphCall:
    """A compiled model's arguments with the token count left open."""

    model: Callable
    template: tuple  # the graph's arguments, None at the token-indexed and size slots
    tokens: tuple[tuple[int, tuple[int, ...], torch.dtype, torch.device], ...]  # slot, trailing shape, dtype, device
    syms: tuple[int, ...]  # slots of the token count
    # A slot holding one of the model's parameters (None: none), which every later call
    # must pass as the same object: the same module instance.
    anchor: int | None = None

    @classmethod
    def of(cls, model, args: tuple) -> "GraphCall":
        token, sym = set(model.token_inputs), set(model.sym_inputs)
        template = tuple(None if i in token or i in sym else a for i, a in enumerate(args))
        tokens = tuple((i, tuple(args[i].shape[1:]), args[i].dtype, args[i].device) for i in sorted(token))
        anchor = next((i for i, a in enumerate(template) if isinstance(a, torch.nn.Parameter)), None)
        return cls(model, template, tokens, tuple(sorted(sym)), anchor)

    def dummy(self, n: int):
        """Run the model on ``n`` rows of zeros (token 0 at position 0 for an id or
        position input): a dummy step, whose attention reads the caller's context."""
        args = list(self.template)
        for slot, rest, dtype, device in self.tokens:
            args[slot] = torch.zeros((n, *rest), dtype=dtype, device=device)
        for slot in self.syms:
            args[slot] = n
        return self.model(*args)


_NOT_GRAPH = -1  # a forward tensor the graph does not read


@dataclass(frozen=True)
class DirectEntry:
    """One forward call of the compiled model, as Dynamo made it."""

    model: Callable  # the compiled model (CompiledReplayModel)
    template: tuple  # the graph's arguments, None where they change per call
    params: tuple[str, ...]  # the forward's parameters in order (for positional calls)
    inputs: tuple[tuple[str, int, bool], ...]  # (name, graph slot or _NOT_GRAPH, token-indexed) per tensor
    specs: tuple[tuple[torch.dtype, torch.device, tuple[int, ...]], ...]  # dtype, device, shape (past dim 0 if token)
    constants: tuple[tuple[str, Any], ...]  # the forward's other arguments and their traced values
    tokens: tuple[int, ...]  # slots of the token count
    outputs: tuple[int | None, ...]  # per leaf of the result: the graph output, or None for a constant
    constant_leaves: tuple  # the constant leaves, in order
    spec: Any  # the result's pytree structure
    grad_enabled: bool  # the grad mode of the traced call (a guard of Dynamo's)

    def bind(self, args: tuple, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """The call's arguments by name, refused where Python would refuse them."""
        if len(args) > len(self.params):
            raise TypeError(f"forward takes {len(self.params)} arguments, got {len(args)}")
        bound = dict(zip(self.params, args))
        for name, value in kwargs.items():
            if name not in self.params:
                raise TypeError(f"forward got an unexpected keyword argument {name!r}")
            if name in bound:
                raise TypeError(f"forward got multiple values for argument {name!r}")
            bound[name] = value
        return bound

    def mismatch(self, bound: Mapping[str, Any]) -> str | None:
        """What about these arguments Dynamo would have traced anew, or None."""
        if torch.is_grad_enabled() != self.grad_enabled:
            return (f"grad mode is {'on' if torch.is_grad_enabled() else 'off'}, traced with it "
                    f"{'on' if self.grad_enabled else 'off'} (run steps under torch.no_grad or inference_mode)")
        n = None
        for (name, _, token), (dtype, device, shape) in zip(self.inputs, self.specs):
            x = bound.get(name)
            if not isinstance(x, torch.Tensor):
                return f"input {name} is {type(x).__name__}, traced as a tensor"
            if x.dtype != dtype or x.device != device:
                return f"input {name} is {x.dtype} on {x.device}, traced as {dtype} on {device}"
            if token:
                if tuple(x.shape[1:]) != shape:
                    return f"input {name} has shape {tuple(x.shape)}, traced with {('T', *shape)}"
                if n is None:
                    n = x.shape[0]
                elif x.shape[0] != n:
                    return f"input {name} has {x.shape[0]} rows, the other token inputs {n}"
            elif tuple(x.shape) != shape:
                return f"input {name} has shape {tuple(x.shape)}, traced with {shape}"
        for name, value in self.constants:
            got = bound.get(name, value)
            if got is not value and not _same_constant(got, value):
                return f"argument {name} is {got!r}, traced as {value!r}"
        return None

    def __call__(self, bound: Mapping[str, Any]) -> Any:
        """Call the graph with ``bound`` (the forward's arguments by name, checked by
        :meth:`mismatch`) and return what the forward would."""
        args = list(self.template)
        n = None
        for name, slot, token in self.inputs:
            x = bound[name]
            if slot != _NOT_GRAPH:
                args[slot] = x
            if token and n is None:
                n = x.shape[0]
        for slot in self.tokens:
            args[slot] = n
        out = self.model(*args)
        if len(self.outputs) == 1 and self.outputs[0] is not None and self.spec is None:
            return out[self.outputs[0]]  # the common case: the forward returns one graph output
        consts = iter(self.constant_leaves)
        leaves = [out[i] if i is not None else next(consts) for i in self.outputs]
        return compat_dynamo.tree_unflatten(leaves, self.spec)


def _same_constant(a, b) -> bool:
    if type(a) is tuple and type(b) is tuple:  # element by element: (1, True) is not (1, 1)
        return len(a) == len(b) and all(_same_constant(x, y) for x, y in zip(a, b))
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - a value without a plain equality is not the traced one
        return False


_CONSTANT_TYPES = (int, float, bool, str, type(None), torch.dtype, torch.device)


def _is_constant(x) -> bool:
    """A plain constant, or a tuple of them (Dynamo guards both by value)."""
    return isinstance(x, _CONSTANT_TYPES) or (type(x) is tuple and all(_is_constant(v) for v in x))


def learn(model, args: tuple, outputs: tuple, bound: Mapping[str, Any], params: Sequence[str], result,
          fixed_ids: set[int]) -> DirectEntry | str:
    """The direct entry for ``model`` (a CompiledReplayModel) from one call Dynamo made
    to it (its ``args`` and ``outputs``) for the forward arguments ``bound`` (by name;
    ``params`` in the forward's order), which returned ``result``; or why it cannot be
    learned. ``fixed_ids``: the ids of the model's parameters and buffers, the only
    objects a later call may pass unchanged."""
    token, sym = set(model.token_inputs), set(model.sym_inputs)
    tensors = {name: x for name, x in bound.items() if isinstance(x, torch.Tensor)}
    where = {id(x): name for name, x in tensors.items()}
    slot_of: dict[str, int] = {}
    n = None
    for i, a in enumerate(args):
        name = where.get(id(a))
        if name is not None:
            slot_of[name] = i
            if i in token:
                n = a.shape[0]
        elif i in token:
            return f"graph argument {i} is token-indexed but none of the forward's inputs"
        elif i not in sym and not (isinstance(a, torch.Tensor) and id(a) in fixed_ids):
            return (f"graph argument {i} ({type(a).__name__}) is neither a forward input, the token "
                    "count, nor a parameter or buffer of the model")
    for i in sym:
        if args[i] != n:
            return f"graph argument {i} is a symbolic size {args[i]!r}, not the token count {n}"
    constants = []
    for name, x in bound.items():
        if name in tensors:
            continue
        if not _is_constant(x):
            return f"forward argument {name} is a {type(x).__name__}, not a tensor or a plain constant"
        constants.append((name, x))
    inputs, specs = [], []
    for name, x in tensors.items():
        slot = slot_of.get(name, _NOT_GRAPH)
        is_token = slot in token
        inputs.append((name, slot, is_token))
        specs.append((x.dtype, x.device, tuple(x.shape[1:]) if is_token else tuple(x.shape)))
    if n is None:
        return "no forward input is token-indexed in the compiled graph"
    leaves, spec = compat_dynamo.tree_flatten(result)
    position = {id(o): j for j, o in enumerate(outputs) if isinstance(o, torch.Tensor)}
    outs, const_leaves = [], []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            j = position.get(id(leaf))
            if j is None:
                return "the forward returns a tensor that is not one of the compiled graph's outputs as it is"
            outs.append(j)
        elif isinstance(leaf, _CONSTANT_TYPES):
            outs.append(None)
            const_leaves.append(leaf)
        else:
            return f"the forward returns a {type(leaf).__name__}, not a tensor or a plain constant"
    bare = isinstance(result, torch.Tensor)
    per_call = set(slot_of.values()) | sym
    template = tuple(None if i in per_call else a for i, a in enumerate(args))
    return DirectEntry(model, template, tuple(params), tuple(inputs), tuple(specs), tuple(constants),
                       tuple(sorted(sym)), tuple(outs), tuple(const_leaves), None if bare else spec,
                       torch.is_grad_enabled())


def for_serving(learned: DirectEntry | str | None, compiled: Sequence) -> DirectEntry | str:
    """The entry calls take, given what was learned (``learned``) and the backend's
    compiled models; or why they go through Dynamo."""
    if len(compiled) > 1:
        return f"the backend compiled {len(compiled)} graphs, and Dynamo's guards choose among them"
    if learned is None:
        return "no call through Dynamo ran to learn from"
    if not isinstance(learned, str) and learned.model is not compiled[0]:
        return "the calls went to another compiled model"
    return learned


def run_dummy(model, setup, n: int, use_graphs: bool = True, **batch) -> None:
    """One dummy step of ``n`` tokens of ``setup`` (every KV write to the pad slot)
    through ``model``'s graph directly, under a forward context of its own; ``batch``:
    the dummy batch's ``graph_rows`` and ``metadata`` (a FULL step's)."""
    with set_forward_context(setup.context(setup.dummy_batch(n, **batch), use_graphs=use_graphs)):
        model.graph_call.dummy(n)
