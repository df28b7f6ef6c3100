"""A model step served by its backend: ``replay_backend.compile`` and its compiled model.

The compiled model owns the serving lifecycle. Its first call traces the step once
(dynamic in the token count, ``tracing/generic.py``); from then on every call reaches
the compiled graph directly, without Dynamo's entry, as that first call taught
(``dispatch/direct.py``). Given a :class:`StepSetup` it runs capture's dummy steps
itself, builds each served step's metadata in the backend's one fixed buffer
(:meth:`ReplayCompiled.build_batch`) and reports what each step did
(:attr:`ReplayCompiled.last_step`). A runner is a client of this API.
"""
from __future__ import annotations

import inspect
import logging
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from .compat import dynamo as compat_dynamo
from .fallbacks import Fallback
from .backend import ReplayBackend
from .batch import StepBatch
from .config import ReplayConfig
from .dispatch import direct
from .forward_context import get_forward_context, has_forward_context
from .lifecycle import Phase
from .parallel import check_same_model
from .recompiles import why_recompile
from .step_setup import StepSetup
from .tracing.dynamic import call_dynamic

log = logging.getLogger("replay_backend")


class ReplayCompiled(nn.Module):
    """``model`` compiled with one :class:`ReplayBackend`, called like the model.

    ``token_args`` names the forward arguments whose first dimension is the token count
    (by name or position). The lifecycle: run one step (the trace), :meth:`capture`,
    :meth:`start_serving`, then serve steps built by :meth:`build_batch`."""

    def __init__(self, model: nn.Module, token_args: Sequence[str | int], backend: ReplayBackend,
                 fullgraph: bool = True, traced: Callable | None = None, setup: StepSetup | None = None) -> None:
        """``traced``: a ``torch.compile``-d callable that routes the model's trace into
        ``backend`` (several backends sharing one Dynamo trace); by default
        ``torch.compile(model, backend=backend)``. ``setup``: the model's StepSetup, if
        known now (else give it to :meth:`capture` or :meth:`start_serving`)."""
        super().__init__()
        if not token_args:
            raise ValueError("token_args: name at least one input whose first dimension is the token count")
        self.model = model
        self.backend = backend
        self.token_args = tuple(token_args)
        self._signature = inspect.signature(model.forward)
        self._params = tuple(self._signature.parameters)
        for a in self.token_args:
            if isinstance(a, str) and a not in self._params or isinstance(a, int) and not 0 <= a < len(self._params):
                raise ValueError(f"token_args: {a!r} is not an argument of "
                                 f"{type(model).__name__}.forward{self._signature}")
        self._names = tuple(self._params[a] if isinstance(a, int) else a for a in self.token_args)
        self.compiled = traced if traced is not None else torch.compile(model, backend=backend, fullgraph=fullgraph)
        if setup is not None:
            backend.use(setup)
        for group in (backend.dp_group, backend.tp_group):  # before the first step runs a collective
            if group is not None:
                check_same_model(model, setup, group)
        # The direct entry learned from the first call through Dynamo, or why none was.
        self._learned: direct.DirectEntry | str | None = None
        self._fixed: set[int] | None = None

    # ---- calls ----------------------------------------------------------------------
    def _token_tensors(self, bound: Mapping[str, Any]) -> list[torch.Tensor]:
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

    @property
    def direct(self) -> bool:
        """Calls reach the compiled graph directly (learned, and one graph compiled)."""
        return isinstance(self._learned, direct.DirectEntry) and len(self.backend.compiled) == 1

    def forward(self, *args, **kwargs):
        entry = self._learned
        if isinstance(entry, direct.DirectEntry) and len(self.backend.compiled) == 1:
            if entry.model.needs_context and not has_forward_context():
                try:
                    get_forward_context()  # raises, naming the missing context
                except RuntimeError as e:  # data-parallel ranks raise too, rather than wait for this one
                    self.backend.fail_step(e)
            try:
                bound = entry.bind(args, kwargs)
            except TypeError as e:
                self.backend.fail_step(e)
            why = entry.mismatch(bound)
            if why is None:
                return entry(bound)
            if self.backend.lifecycle.serving:
                self.backend.fail_step(ValueError(f"dsv41_replay: {why}: that needs a new trace, which is an error "
                                                  "once serving"))
        return self._through_dynamo(args, kwargs)

    def _through_dynamo(self, args, kwargs):
        try:  # refused before the step: data-parallel ranks raise too, rather than wait for this one
            bound = self._signature.bind(*args, **kwargs)
            bound.apply_defaults()
            tokens = self._token_tensors(bound.arguments)
        except (TypeError, ValueError) as e:
            self.backend.fail_step(e)
        be = self.backend
        serving = be.lifecycle.serving
        if serving:
            started = be.model.started
            try:
                return call_dynamic(self.compiled, tokens, True, *args, **kwargs)
            except compat_dynamo.RECOMPILE_ERRORS as e:
                err = RuntimeError(f"dsv41_replay: recompile after warm-up (while serving): {why_recompile(be)}")
                err.__cause__ = e
                if be.model.started == started:  # Dynamo refused the call before the step began
                    be.fail_step(err)  # data-parallel ranks raise too, rather than wait for this one
                raise err from e
        if self._learned is not None or not be.config.direct_dispatch:
            return call_dynamic(self.compiled, tokens, False, *args, **kwargs)
        with be.calls.watch():
            result = call_dynamic(self.compiled, tokens, False, *args, **kwargs)
        call = be.calls.take()
        if call is None:  # the call reached no model of this backend (another backend's trace)
            return result
        if self._fixed is None:
            self._fixed = {id(t) for t in (*self.model.parameters(), *self.model.buffers())}
        self._learned = direct.learn(*call, bound.arguments, self._params, result, self._fixed)
        if isinstance(self._learned, str):
            call[0].res.fallback(Fallback.DIRECT_DISPATCH, f"calls go through Dynamo's entry: {self._learned}")
        else:
            log.info("dsv41_replay: calls reach the compiled model directly (%d graph arguments, %d fixed)",
                     len(self._learned.template), sum(a is not None for a in self._learned.template))
        return result

    # ---- lifecycle (the backend's) ---------------------------------------------------
    @property
    def phase(self) -> Phase:
        return self.backend.phase

    def capture(self, setup, replay_view_for=None, metadata=None) -> dict:
        """Capture every graph after the warm-up steps (:meth:`ReplayBackend.capture`)."""
        return self.backend.capture(setup, replay_view_for, metadata)

    def estimate_graph_memory(self, setup: StepSetup):
        return self.backend.estimate_graph_memory(setup)

    def start_serving(self, setup: StepSetup | None = None) -> None:
        """No capture and no new graph from now on (:meth:`ReplayBackend.start_serving`)."""
        self.backend.start_serving(setup)
        if self.backend.config.direct_dispatch:
            learned = direct.for_serving(self._learned, self.backend.compiled)
            if isinstance(learned, str) and not isinstance(self._learned, str):  # not counted yet
                self.backend.model.res.fallback(Fallback.DIRECT_DISPATCH, f"served steps go through Dynamo's entry: {learned}")

    def build_batch(self, requests, token_ids, blocks, max_num_batched_tokens: int | None = None, *,
                    owner=None) -> StepBatch:
        """A step's batch, built as the backend serves it (:meth:`ReplayBackend.build_batch`);
        its token ids and positions travel in the metadata copy when calls are direct.
        ``owner``: who builds it, whose blocks ``blocks`` are (``StepBatch.owner``)."""
        return self.backend.build_batch(requests, token_ids, blocks, max_num_batched_tokens,
                                        inputs_in_metadata=self.direct, owner=owner)

    def idle_step(self) -> None:
        """A data-parallel rank with no requests takes part in the step (:meth:`ReplayBackend.idle_step`)."""
        self.backend.idle_step()

    def fail_step(self, error: Exception):
        """Give up this step with ``error`` (:meth:`ReplayBackend.fail_step`): the other
        data-parallel ranks raise naming this one instead of waiting for it."""
        self.backend.fail_step(error)

    @property
    def last_step(self):
        """What the last step did (a ``StepResult``), or None before any step."""
        return self.backend.last_step

    @property
    def plan(self):
        from .plan import plan_of

        return plan_of(self.backend)


def compile(model: nn.Module, token_args: Sequence[str | int] = (0,), *, options: dict | None = None,
            mode: str | None = None, backend: ReplayBackend | None = None,
            setup: StepSetup | None = None) -> ReplayCompiled:
    """``torch.compile(model, backend="dsv41_replay", options=options)`` that traces the
    token dimension of ``token_args`` dynamic from the first call, keeps one backend
    state for the model (its lifecycle, recompiles counted and refused once serving)
    and serves every later call directly. Options are checked here, before any trace.
    ``setup``: the model's StepSetup, where known now."""
    if backend is not None and (options or mode):
        raise ValueError("pass either backend or options/mode, not both")
    backend = backend if backend is not None else ReplayBackend(ReplayConfig.from_options(options, mode))
    return ReplayCompiled(model, token_args, backend, setup=setup)
