"""The ``dsv41_replay`` torch.compile backend's state and entry point.

``torch.compile(model, backend="dsv41_replay", options={...})`` finds
:func:`dsv41_replay` through the ``torch_dynamo_backends`` entry point, which keeps one
:class:`ReplayBackend` per ``torch.compile`` call; passing a ``ReplayBackend`` as the
backend does the same with an object in hand. It holds the graphs compiled for that
call (each built by ``pipeline.build``: split -> compile -> graphs -> dispatch), their
piece cache and their lifecycle: capture, start of serving, recompiles counted and
refused once serving.
"""
from __future__ import annotations

import logging
import sys
from typing import Any, Callable

import torch
from torch import fx

from . import inspection, torch_compat
from .capture.graphs import StrictFallbackError, process_fallback  # noqa: F401  (StrictFallbackError: re-exported)
from .compiling.piece_cache import PieceCache
from .config import ReplayConfig
from .counters import counters
from .dispatch.compiled import CompiledReplayModel
from .dispatch.direct import CallLog
from .forward_context import has_forward_context
from .lifecycle import Lifecycle, Phase
from .pipeline import build

log = logging.getLogger("replay_backend")

class ReplayBackend:
    """One backend state: the graphs one ``torch.compile`` call compiled, their shared
    piece cache, and the lifecycle (:class:`Phase`) that capture and serving follow.

    ``torch.compile(model, backend=ReplayBackend(...))`` uses it directly;
    ``torch.compile(model, backend="dsv41_replay", options=...)`` makes one per call,
    which :func:`backend_of` finds from the compiled model."""

    def __init__(self, config: ReplayConfig | None = None, piece_cache: PieceCache | None = None,
                 dp_group=None, **options: Any) -> None:
        if config is not None and options:
            raise ValueError("pass either a ReplayConfig or options, not both")
        self.config = config if config is not None else ReplayConfig.from_options(options)
        # Identical pieces compile once; pass one cache to several backends to share.
        self.piece_cache = piece_cache if piece_cache is not None else PieceCache()
        # A torch.distributed group of data-parallel ranks: they agree on replaying.
        self.dp_group = dp_group
        self.compiled: list[CompiledReplayModel] = []
        self.lifecycle = Lifecycle()  # shared by every graph compiled for this state
        # Calls of the compiled model while a runner watches (its warm-up steps): the
        # runner learns from them how to call the model without Dynamo (dispatch/direct.py).
        self.calls = CallLog()

    @property
    def model(self) -> CompiledReplayModel:
        if not self.compiled:
            raise RuntimeError("nothing compiled yet: run one step through the compiled model first")
        return self.compiled[-1]

    @property
    def replays_in_region(self) -> bool:
        """Whether the replay layers run only in a replay region, so that every step's
        trim op points attention at the view they read (``ForwardContext.activate``):
        one graph compiled, and it has a region. False before the first compile."""
        return len(self.compiled) == 1 and self.compiled[0].replay is not None

    @property
    def phase(self) -> Phase:
        return self.lifecycle.phase

    @property
    def frozen(self) -> bool:
        """True once serving: a further graph (a recompile) is an error."""
        return self.phase is Phase.SERVING

    def capture(self, run_step: Callable[[int], Any], replay_view_for: Callable[[int], Any],
                metadata=None) -> dict:
        """Capture the main graphs, then the replay graphs, each largest size first (SPEC
        §7), after the warm-up steps. ``run_step(n)`` runs one dummy step of ``n`` tokens
        through the compiled model (under the caller's forward context);
        ``replay_view_for(n)`` gives the attention view of ``n`` dummy replay rows.
        Returns the per-runner capture summary; :meth:`start_serving` comes next."""
        life = self.lifecycle
        life.expect("capture", Phase.WARMING)
        if not has_forward_context():
            raise RuntimeError("dsv41_replay: capture() needs a forward context around it: the replay graphs "
                               "are captured outside any model step, so wrap the call in "
                               "set_forward_context(ForwardContext(dummy_step_batch(...), kv=your_cache))")
        life.advance(Phase.CAPTURING_MAIN)
        try:
            # Graphs serve inference; the replay graphs run the region outside any model
            # step, where the caller's grad mode does not reach. no_grad, not
            # inference_mode: the static buffers made here are written in place by every
            # later step, whichever of the two that step runs under.
            with torch.no_grad():
                return self.model.capture(run_step, replay_view_for, metadata)
        except BaseException:
            life.advance(Phase.WARMING)
            raise

    def start_serving(self) -> None:
        """Warm-up (and capture) is over: no capture from now on, an uncaptured size is a
        counted fallback, and a recompile is an error."""
        life = self.lifecycle
        if life.serving:
            return
        life.expect("start_serving", Phase.WARMING, Phase.CAPTURING_MAIN, Phase.CAPTURING_REPLAY)
        self.model.start_serving()
        life.advance(Phase.SERVING)

    def freeze(self) -> None:
        """The former name of :meth:`start_serving`."""
        self.start_serving()

    def __call__(self, gm: fx.GraphModule, example_inputs: list) -> CompiledReplayModel:
        counters.graphs_seen += 1
        if self.phase not in (Phase.TRACING, Phase.WARMING):
            counters.recompiles += 1
            raise RuntimeError(
                f"dsv41_replay: recompile after warm-up (while {self.phase.value}). The model must trace once, "
                "dynamic only in the token count (mark the token dimension dynamic; see docs/debugging.md)")
        if self.compiled:
            counters.recompiles += 1
            log.warning("dsv41_replay: graph %d for this backend (a recompile)", len(self.compiled) + 1)
        else:  # once per backend, not per graph
            log.info("dsv41_replay config: %s", self.config.as_dict())
        model = build(gm, example_inputs, self.config, self.piece_cache, self.dp_group, self.calls,
                      len(self.compiled), self.lifecycle)
        inspection.on_built(model)
        self.compiled.append(model)
        self.lifecycle.advance(Phase.WARMING)
        return model


def dsv41_replay(gm: fx.GraphModule, example_inputs: list, mode: str | None = None,
                 options: dict | None = None) -> CompiledReplayModel:
    """Entry point registered as ``torch_dynamo_backends: dsv41_replay``: every graph of
    one ``torch.compile`` call goes to that call's one :class:`ReplayBackend`."""
    call = torch_compat.torch_compile_call(sys._getframe(1))
    config = ReplayConfig.from_options(options, mode)
    if call is None:
        why = ("not called through torch.compile's wrapper, so each graph gets a backend of its own and "
               "recompiles are not counted; pass backend=ReplayBackend(...) to keep one")
        process_fallback("per_call_state", why, config.strict)
        return ReplayBackend(config)(gm, example_inputs)
    return torch_compat.compile_call_state(call, lambda: ReplayBackend(config))(gm, example_inputs)


def backend_of(compiled) -> ReplayBackend:
    """The :class:`ReplayBackend` behind a model compiled with ``backend="dsv41_replay"``
    (or given one): its plan, capture and start of serving."""
    if isinstance(compiled, ReplayBackend):
        return compiled
    state = torch_compat.compile_call_state_of(compiled)
    if state is None:
        raise ValueError("backend_of: no dsv41_replay backend state behind this object: compile a module with "
                         "torch.compile(model, backend='dsv41_replay') and run one step through it first")
    return state
