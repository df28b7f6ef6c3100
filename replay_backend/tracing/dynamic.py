"""Handing a model to Dynamo so that it traces once, dynamic only in the token count.

Dynamo specialises every size on a first call and makes a dimension dynamic only when
a later call changes it, and it specialises sizes 0 and 1: left alone, a model compiled
with this backend traces a static graph first (nothing trims, no graphs), a dynamic one
second and maybe a one-token one later. ``replay_backend.compile`` (serving.py) calls
the model through :func:`call_dynamic`, which marks the token dimension of the named
inputs dynamic and traces size-obliviously: one graph from the first call, whatever its
token count, and once the backend serves, any further trace is an error. The same idea
as vLLM's ``support_torch_compile``, as a wrapper instead of a class decorator.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..compat import dynamo as compat_dynamo
def mark_token_dims(*tensors: torch.Tensor) -> None:
    """Mark dim 0 (the token count) of each tensor dynamic for the next Dynamo trace."""
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            what = "a 0-dim tensor" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"mark_token_dims: argument {i} must be a tensor whose first dimension is the token "
                             f"count, got {what}")
    compat_dynamo.mark_tokens_dynamic(*tensors)


def call_dynamic(fn: Callable, tokens: Sequence[torch.Tensor], serving: bool, *args, **kwargs):
    """Call ``fn`` (compiled with this backend) with dim 0 of ``tokens`` dynamic. Before
    serving it traces size-obliviously (no one-token specialisation); once serving, a
    trace is a recompile, an error, so the size-oblivious knob, whose config patch is
    host time on every step, is left out."""
    compat_dynamo.mark_tokens_dynamic(*tokens)
    if serving:
        with compat_dynamo.no_recompile():
            return fn(*args, **kwargs)
    with compat_dynamo.size_oblivious():
        return fn(*args, **kwargs)
