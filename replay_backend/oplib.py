"""Custom ops defined by schema, for the ops that run eagerly on every step.

``torch.library.custom_op`` wraps every call in Python layers (argument binding,
mutation bookkeeping), several times the cost of an op defined by its schema with
``torch.library.Library``. The attention
ops run 40 times per step between graph pieces, the trim op once, and the grouped MoE
and the fused Sinkhorn inside every piece run without graphs, so that difference is
host time on the step's path. To Dynamo, fake tensors and Inductor both kinds of op
are the same: a schema (with its mutated arguments), a kernel and a fake kernel.
"""
from __future__ import annotations

from typing import Callable

import torch


def no_output(*args, **kwargs) -> None:
    """The fake kernel of an op that returns nothing (it writes into its arguments)."""
    return None


def define_op(qualname: str, schema: str, impl: Callable, fake: Callable, tags: tuple = ()):
    """Define ``namespace::name`` with ``schema`` (its arguments and returns, e.g.
    ``"(Tensor x, Tensor(a!) out) -> ()"``), ``impl`` for every device and ``fake`` for
    fake tensors. Returns the op packet (``torch.ops.namespace.name``)."""
    ns, name = qualname.split("::")
    lib = torch.library.Library(ns, "FRAGMENT")
    lib.define(name + schema, tags=tags)
    lib.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(qualname, fake, lib=lib)
    # A Library removes its registrations when it is collected: the implementation,
    # a module-level function, keeps it alive as long as the module.
    impl.op_library = lib
    return getattr(getattr(torch.ops, ns), name)
