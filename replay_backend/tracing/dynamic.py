"""Handing a model to Dynamo so that it traces once, dynamic only in the token count.

Dynamo specialises every size on a first call and makes a dimension dynamic only when
a later call changes it, and it specialises sizes 0 and 1: left alone, a model compiled
with this backend traces a static graph first (nothing trims, no graphs), a dynamic one
second and maybe a one-token one later. :func:`compile` wraps a model so that every call
marks the token dimension of the named inputs dynamic and traces size-obliviously:
one graph from the first call, whatever its token count, and once the backend serves,
any further trace is an error (SPEC §7). The same idea as vLLM's
``support_torch_compile``, as a wrapper instead of a class decorator.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import torch
from torch import nn

from .. import torch_compat
from ..backend import ReplayBackend
from ..lifecycle import Phase
from ..config import ReplayConfig


def mark_token_dims(*tensors: torch.Tensor) -> None:
    """Mark dim 0 (the token count) of each tensor dynamic for the next Dynamo trace."""
    torch_compat.mark_tokens_dynamic(*tensors)


def call_dynamic(fn: Callable, tokens: Sequence[torch.Tensor], serving: bool, *args, **kwargs):
    """Call ``fn`` (compiled with this backend) with dim 0 of ``tokens`` dynamic. Before
    serving it traces size-obliviously (no one-token specialisation); once serving, a
    trace is a recompile, an error, so the size-oblivious knob, whose config patch is
    host time on every step, is left out."""
    torch_compat.mark_tokens_dynamic(*tokens)
    if serving:
        with torch_compat.no_recompile():
            return fn(*args, **kwargs)
    with torch_compat.size_oblivious():
        return fn(*args, **kwargs)


class ReplayCompiled(nn.Module):
    """``model`` compiled with one :class:`ReplayBackend`, called like the model.

    ``token_args`` names the forward arguments whose first dimension is the token
    count (by name or position). The lifecycle is the backend's: run warm-up steps,
    :meth:`capture` with your own dummy step, :meth:`start_serving`."""

    def __init__(self, model: nn.Module, token_args: Sequence[str | int], backend: ReplayBackend,
                 fullgraph: bool = True) -> None:
        super().__init__()
        if not token_args:
            raise ValueError("token_args: name at least one input whose first dimension is the token count")
        self.model = model
        self.backend = backend
        self.token_args = tuple(token_args)
        self._signature = inspect.signature(model.forward)
        names = list(self._signature.parameters)
        for a in self.token_args:
            if isinstance(a, str) and a not in names or isinstance(a, int) and not 0 <= a < len(names):
                raise ValueError(f"token_args: {a!r} is not an argument of {type(model).__name__}.forward{self._signature}")
        self._names = tuple(names[a] if isinstance(a, int) else a for a in self.token_args)
        self.compiled = torch.compile(model, backend=backend, fullgraph=fullgraph)

    def _token_tensors(self, args, kwargs) -> list[torch.Tensor]:
        bound = self._signature.bind(*args, **kwargs).arguments
        out = []
        for name in self._names:
            t = bound.get(name)
            if not isinstance(t, torch.Tensor) or t.dim() == 0:
                raise ValueError(f"token_args: argument {name!r} must be a tensor whose first dimension is the "
                                 f"token count, got {type(t).__name__}")
            out.append(t)
        rows = {t.shape[0] for t in out}
        if len(rows) > 1:
            raise ValueError(f"token_args: {', '.join(self._names)} disagree on the token count: {sorted(rows)}")
        return out

    def forward(self, *args, **kwargs):
        tokens = self._token_tensors(args, kwargs)
        return call_dynamic(self.compiled, tokens, self.backend.lifecycle.serving, *args, **kwargs)

    # ---- lifecycle (ReplayBackend's) -----------------------------------------------
    @property
    def phase(self) -> Phase:
        return self.backend.phase

    def capture(self, run_step: Callable[[int], Any], replay_view_for: Callable[[int], Any], metadata=None) -> dict:
        """Capture every graph after the warm-up steps (:meth:`ReplayBackend.capture`):
        ``run_step(n)`` runs a dummy step of ``n`` tokens through this model,
        ``replay_view_for(n)`` gives the ``AttnView`` of ``n`` dummy replay rows; call it
        inside a forward context whose ``kv`` is your cache."""
        return self.backend.capture(run_step, replay_view_for, metadata)

    def start_serving(self) -> None:
        """No capture and no new graph from now on (:meth:`ReplayBackend.start_serving`)."""
        self.backend.start_serving()

    @property
    def plan(self):
        from ..plan import plan_of

        return plan_of(self.backend)


def compile(model: nn.Module, token_args: Sequence[str | int] = (0,), *, options: dict | None = None,
            mode: str | None = None, backend: ReplayBackend | None = None) -> ReplayCompiled:
    """``torch.compile(model, backend="dsv41_replay", options=options)`` that traces the
    token dimension of ``token_args`` dynamic from the first call and keeps one backend
    state for the model (its lifecycle, recompiles counted and refused once serving).
    Options are checked here, before any trace."""
    if backend is not None and (options or mode):
        raise ValueError("pass either backend or options/mode, not both")
    backend = backend if backend is not None else ReplayBackend(ReplayConfig.from_options(options, mode))
    return ReplayCompiled(model, token_args, backend)
