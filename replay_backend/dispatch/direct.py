"""Served steps without Dynamo's entry: the compiled model called directly.

After warm-up the model never traces again (a recompile is an error, SPEC §7), so on
every served step Dynamo's entry does the same work to reach the same compiled model
with the same arguments: it evaluates its guards (over every parameter of the model)
and runs the prologue that loads each parameter as a graph argument: a large share of
the host time before a graphed step's first kernel. A :class:`DirectEntry` makes that
call itself.

It is learned from calls made through Dynamo while the runner warms up
(:class:`CallLog` sees what Dynamo passes and what the model returns): which graph
arguments are the forward's inputs, which are the token count, and which are fixed
objects. A fixed argument must be a parameter or buffer of the model, and the forward
must return one of the graph's outputs as it is; any other shape of call is not
learned (a counted fallback: the runner then steps through Dynamo).

What the guards checked and the entry checks per step: each input's dtype, device and
rank, and that the inputs agree in length. What it does not see: a parameter replaced
by another object (the captured graphs read the old one's memory regardless: update
weights in place), module flags such as ``training``, and global state (the runner
steps in inference mode). ``direct_dispatch=false`` keeps Dynamo's entry on every step.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


class CallLog:
    """The last call a backend's compiled model received while watched: the arguments
    as Dynamo passed them and the outputs the model returned. Only warm-up steps are
    watched, so a served step pays one attribute test."""

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
class DirectEntry:
    """One served step's call of the compiled model, as Dynamo made it."""

    model: Callable  # the compiled model (CompiledReplayModel)
    template: tuple  # the graph's arguments, None where they change per step
    inputs: tuple[int, ...]  # the argument slot of each forward input (-1: not a graph input)
    tokens: tuple[int, ...]  # slots of the token count (symbolic sizes of the inputs' dim 0)
    output: int  # the graph output the forward returns
    specs: tuple[tuple[torch.dtype, torch.device, int], ...]  # each input's dtype, device, rank
    names: tuple[str, ...]  # the inputs' names, for errors

    def check(self, inputs: Sequence[torch.Tensor]) -> int:
        """Raise on inputs Dynamo's guards would have refused (a recompile, an error
        after warm-up), naming the input; else return the token count."""
        n = inputs[0].shape[0]
        for name, x, (dtype, device, rank) in zip(self.names, inputs, self.specs):
            if x.dtype != dtype or x.device != device or x.dim() != rank or x.shape[0] != n:
                raise ValueError(
                    f"direct dispatch: input {name} is {x.dtype} {tuple(x.shape)} on {x.device}, but the "
                    f"model was traced with {dtype} of rank {rank} on {device}, as many rows as "
                    f"{self.names[0]} ({n}): that needs a recompile, which is an error after warm-up")
        return n

    def __call__(self, *inputs: torch.Tensor) -> Any:
        n = self.check(inputs)
        args = list(self.template)
        for slot, x in zip(self.inputs, inputs):
            if slot >= 0:
                args[slot] = x
        for slot in self.tokens:
            args[slot] = n
        return self.model(*args)[self.output]


def learn(model, args: tuple, outputs: tuple, inputs: Sequence[torch.Tensor], result,
          names: Sequence[str], fixed_ids: set[int]) -> DirectEntry | str:
    """The direct entry for ``model`` (a CompiledReplayModel) from one call Dynamo made
    to it (its ``args`` and ``outputs``) for the forward's ``inputs``, which returned
    ``result``; or why it cannot be learned. ``fixed_ids``: the ids of the model's
    parameters and buffers, the only objects a served step may pass unchanged."""
    n = inputs[0].shape[0]
    token, sym = set(model.token_inputs), set(model.sym_inputs)
    slots = [-1] * len(inputs)
    where = {id(x): k for k, x in enumerate(inputs)}
    for i, a in enumerate(args):
        k = where.get(id(a))
        if k is not None:
            if i not in token:
                return f"graph argument {i} is input {names[k]}, which is not dynamic in the token count"
            slots[k] = i
        elif i in token:
            return f"graph argument {i} is token-indexed but none of the forward's inputs"
        elif i in sym:
            if a != n:
                return f"graph argument {i} is a symbolic size {a!r}, not the token count {n}"
        elif not (isinstance(a, torch.Tensor) and id(a) in fixed_ids):
            return (f"graph argument {i} ({type(a).__name__}) is neither a forward input, the token "
                    "count, nor a parameter or buffer of the model")
    hits = [j for j, o in enumerate(outputs) if o is result]
    if len(hits) != 1:
        return "the forward does not return exactly one of the compiled graph's outputs as it is"
    per_step = set(slots) | sym
    template = tuple(None if i in per_step else a for i, a in enumerate(args))
    return DirectEntry(model, template, tuple(slots), tuple(sorted(sym)), hits[0],
                       tuple((x.dtype, x.device, x.dim()) for x in inputs), tuple(names))


def for_serving(learned: DirectEntry | str | None, compiled: Sequence) -> DirectEntry | str:
    """The entry served steps take, given what the warm-up steps taught (``learned``)
    and the backend's compiled models; or why they go through Dynamo."""
    if len(compiled) > 1:
        return f"the backend compiled {len(compiled)} graphs, and Dynamo's guards choose among them"
    if learned is None:
        return "no warm-up step of this runner ran through Dynamo to learn from"
    if not isinstance(learned, str) and learned.model is not compiled[0]:
        return "the warm-up steps called another compiled model"
    return learned
