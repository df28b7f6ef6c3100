"""The ``dsv41_replay`` torch.compile backend's state and entry point.

``torch.compile(model, backend="dsv41_replay", options={...})`` finds
:func:`dsv41_replay` through the ``torch_dynamo_backends`` entry point, which keeps one
:class:`ReplayBackend` per ``torch.compile`` call; passing a ``ReplayBackend`` as the
backend does the same with an object in hand. It holds the graphs compiled for that
call (each built by ``pipeline.build``: split -> compile -> graphs -> dispatch), their
piece cache and their lifecycle: capture, start of serving, recompiles counted and
refused once serving (recompiles.py).
"""
from __future__ import annotations

import logging
import sys
from typing import Any, Callable

import torch
from torch import fx

from . import inspection
from .compat import dynamo as compat_dynamo
from .fallbacks import Fallback, StrictFallbackError, process_fallback  # noqa: F401  (StrictFallbackError: re-exported)
from .compiling.piece_cache import PieceCache
from .config import ReplayConfig
from .dispatch.agree import tell_failed
from .dispatch.compiled import CompiledReplayModel
from .batch import build_step_batch
from .requests import check_request_types
from .capture import drive
from .dispatch.direct import CallLog, run_dummy
from .lifecycle import Lifecycle, Phase
from .parallel import check_groups
from .passes.region import marked_window
from .pipeline import build
from .recompiles import admit_graph
from .step_metadata import MetadataBuffer, metadata_capacity
from .step_setup import StepSetup


log = logging.getLogger("replay_backend")

class ReplayBackend:
    """One backend state: the graphs one ``torch.compile`` call compiled, their shared
    piece cache, and the lifecycle (:class:`Phase`) that capture and serving follow.

    ``torch.compile(model, backend=ReplayBackend(...))`` uses it directly;
    ``torch.compile(model, backend="dsv41_replay", options=...)`` makes one per call,
    which :func:`backend_of` finds from the compiled model."""

    def __init__(self, config: ReplayConfig | None = None, piece_cache: PieceCache | None = None,
                 dp_group=None, tp_group=None, **options: Any) -> None:
        """``dp_group``: the data-parallel ranks (a CPU group: they agree on every step in
        one host collective, dispatch/agree.py); ``tp_group``: the tensor-parallel ranks
        that share this rank's batch. Every rank of either captures the same graphs, in
        the same order, checked at capture."""
        if config is not None and options:
            raise ValueError("pass either a ReplayConfig or options, not both")
        if config is not None and not isinstance(config, ReplayConfig):
            raise ValueError(f"ReplayBackend(config=...) takes a ReplayConfig, got {type(config).__name__}: pass "
                             "options as keywords, e.g. ReplayBackend(compiler='eager')")
        self.config = config if config is not None else ReplayConfig.from_options(options)
        for note in self.config.notes():  # once per backend state: options a switch makes moot
            log.warning("%s", note)
        # Identical pieces compile once; pass one cache to several backends to share.
        self.piece_cache = piece_cache if piece_cache is not None else PieceCache()
        check_groups(self.config, dp_group, tp_group)
        self.dp_group, self.tp_group = dp_group, tp_group
        self.compiled: list[CompiledReplayModel] = []
        # The code objects these graphs were traced from (compat.dynamo.compiling_frame): a
        # later first compile of one of them means Dynamo's caches were emptied (a reset).
        self.traced_code: set = set()
        self.lifecycle = Lifecycle()  # shared by every graph compiled for this state
        # Calls of the compiled model through Dynamo while watched: the model's front
        # (serving.ReplayCompiled) learns from them to call it directly (dispatch/direct.py).
        self.calls = CallLog()
        # What served steps are built from (a StepSetup), and the fixed device
        # buffer their metadata goes to once serving (step_metadata.py).
        self.setup = None
        self.metadata: MetadataBuffer | None = None

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
    def has_run(self) -> bool:
        """A step ran through the compiled model: the backend can run dummy steps of any
        size itself (capture, the memory estimate)."""
        return bool(self.compiled) and self.compiled[-1].graph_call is not None

    @property
    def phase(self) -> Phase:
        return self.lifecycle.phase

    @property
    def frozen(self) -> bool:
        """True once serving: a further graph (a recompile) is an error."""
        return self.phase is Phase.SERVING

    # ---- serving: capture, start of serving, step batches ---------------------------
    def capture(self, setup, replay_view_for: Callable[[int], Any] | None = None, metadata=None) -> dict:
        """Capture the main graphs, then the replay graphs, each largest size first, after
        the warm-up steps. ``setup`` (a ``StepSetup``): the backend runs the dummy steps
        itself, on zeros in the token inputs, and keeps a fixed metadata buffer for
        the served steps' batches (``build_batch``). The other form, for a runner that
        drives its own dummy steps: ``capture(run_step, replay_view_for, metadata)``,
        ``run_step(n)`` runs one dummy step of ``n`` tokens through the compiled model
        under the forward context of an ``n``-token batch (the caller's, around the
        call, serves the replay graphs' capture), ``replay_view_for(n)`` gives the view of
        ``n`` dummy replay rows. Returns the per-runner capture summary;
        :meth:`start_serving` comes next."""
        return drive.capture(self, setup, replay_view_for, metadata)

    def estimate_graph_memory(self, setup):
        """What :meth:`capture` will take from the GPU, measured without capturing (a
        ``GraphMemoryEstimate``), from the dummy steps of ``setup`` (a ``StepSetup``)."""
        return drive.estimate_graph_memory(self, setup)

    def start_serving(self, setup=None) -> None:
        """Warm-up (and capture) is over: no capture from now on, an uncaptured size is a
        counted fallback, and a recompile is an error. ``setup``: the ``StepSetup`` served
        batches are built from, where :meth:`capture` did not get one."""
        life = self.lifecycle
        if life.serving:
            return
        life.expect("start_serving", Phase.WARMING, Phase.CAPTURING_MAIN, Phase.CAPTURING_REPLAY, Phase.CAPTURED)
        if setup is not None:
            self.use(setup)
        if self.config.full_graphs and life.phase is Phase.WARMING and self.compiled and not self.model.full_resolved:
            # FULL graphs exist only from capture(); after the memory estimate decided their
            # sizes, the compiled model counts those missing itself.
            rest = "steps run in pieces where those are captured, else eagerly" if self.config.piecewise_graphs \
                else "every step runs eagerly"
            self.model.res.fallback(Fallback.UNCAPTURED_SIZE, f"cudagraph_mode={self.config.cudagraph_mode!r}: "
                                    f"serving started without capture(), so no FULL graph was captured; {rest}")
        self.model.start_serving()
        life.advance(Phase.SERVING)

    def freeze(self) -> None:
        """:meth:`start_serving`, by another name."""
        self.start_serving()

    def build_batch(self, requests, token_ids, blocks, max_num_batched_tokens: int | None = None,
                    inputs_in_metadata: bool = False, *, owner=None):
        """A step's ``StepBatch`` from its setup: once serving, in the backend's fixed
        metadata buffer (valid until the next build: run each batch before building the
        next). ``inputs_in_metadata``: only for a caller that reaches the compiled model
        directly (``ReplayCompiled`` does). ``owner``: who builds it, whose blocks
        ``blocks`` are (``StepBatch.owner``). A batch refused fails the step: with
        data-parallel ranks every other rank raises ``RankFailed`` (:meth:`fail_step`)."""
        try:
            if self.setup is None:
                raise RuntimeError("dsv41_replay: build_batch() needs the model's StepSetup: pass it to capture() "
                                   "or start_serving(), or build batches with replay_backend.build_step_batch")
            s = self.setup
            limit = self.config.max_num_batched_tokens
            if max_num_batched_tokens is not None:
                limit = min(limit, max_num_batched_tokens)
            serving = self.lifecycle.serving
            policy = self.model.full_policy if serving and self.compiled else None
            requests = tuple(requests)
            check_request_types(requests)
            graph_rows = policy.rows if policy is not None and policy.wants_layout(requests) else None
            return build_step_batch(requests, token_ids, blocks, s.layout, s.window, s.device, limit,
                                    inputs_in_metadata=inputs_in_metadata,
                                    metadata=self.metadata if serving else None, view_fields=s.view_fields,
                                    owner=owner, graph_rows=graph_rows)
        except Exception as e:  # noqa: BLE001 - whatever refused it, this rank runs no step
            self.fail_step(e)

    def idle_step(self) -> None:
        """A step for a data-parallel rank with no requests: a dummy step of one token
        (one uniform decode's under a uniform-only FULL policy; its KV writes to the pad
        slot), padded to the size the ranks agree on, so that the collectives inside the
        other ranks' steps meet this rank's. Refused (no setup, no step traced yet), it
        fails the step on every rank (:meth:`fail_step`)."""
        try:
            if self.setup is None:
                raise RuntimeError("dsv41_replay: idle_step() needs the model's StepSetup: pass it to capture() or "
                                   "start_serving()")
            model = self.learned_model("idle_step")
        except RuntimeError as e:
            self.fail_step(e)
        policy = model.full_policy
        tokens, batch = 1, {}
        if policy is not None and self.lifecycle.serving:
            # A served decode's layout and length: an idle rank keeps the others' FULL steps FULL.
            tokens = policy.uniform_len or 1
            batch = dict(graph_rows=policy.rows, metadata=self.metadata, per_request=tokens)
        with torch.no_grad():
            run_dummy(model, self.setup, tokens, **batch)

    def fail_step(self, error: Exception):
        """Give up this step with ``error``, raised here: a data-parallel rank whose own
        checks fail before it calls the compiled model calls this instead, so that the
        other ranks raise ``RankFailed`` naming it rather than wait for it in the step's
        collectives. Without data-parallel ranks it only raises ``error``."""
        if self.compiled:
            self.model.fail_step(error)  # raises, after telling the ranks where its steps agree
        if self.dp_group is not None:  # nothing traced yet: the others' first step agrees all the same
            tell_failed(self.dp_group, error)
        raise error

    @property
    def last_step(self):
        """What the last step of the compiled model did (a ``StepResult``), or None."""
        plan = self.lifecycle.last_plan
        return plan.result if plan is not None else None

    def use(self, setup):
        """Build this state's steps from ``setup`` (a ``StepSetup``): its dummy steps for
        capture and its served batches (:meth:`build_batch`). Checked against the window
        the model's markers declare, once traced. Returns it."""
        if not isinstance(setup, StepSetup):
            raise TypeError(f"expected a replay_backend.StepSetup, got {type(setup).__name__}")
        self._check_window(setup, self.model.plan.window if self.compiled else None)
        if self.setup is not None and not setup.same_as(self.setup):
            raise ValueError("a different StepSetup than the one this backend's steps are built from (its layout, "
                             "window, device, kv cache, view fields or prepare_view differ): give one per model")
        self.setup = setup
        return setup

    @staticmethod
    def _check_window(setup, window: int | None) -> None:
        if setup is not None and window is not None and setup.window != window:
            raise ValueError(f"StepSetup.window={setup.window} differs from the window W={window} the model's "
                             "replay_begin declares")

    def learned_model(self, what: str) -> CompiledReplayModel:
        """The compiled model, which must have run a step (``what`` names the caller)."""
        if not self.has_run:
            raise RuntimeError(f"dsv41_replay: {what}() needs one step through the compiled model first")
        return self.model

    def metadata_buffer(self, setup) -> MetadataBuffer | None:
        """The fixed buffer served steps' metadata goes to, whose head the trim op's
        gather graphs and the FULL graphs read in place; None where off or impossible
        (a fallback)."""
        needed = self.model.replay is not None or bool(self.model.full_sizes)
        if self.metadata is not None or not self.config.metadata_in_place or not needed:
            return self.metadata
        cfg = self.config
        capacity = metadata_capacity(cfg.max_num_batched_tokens, setup.layout.num_blocks, setup.view_fields)
        if isinstance(capacity, str):
            self.model.res.fallback(Fallback.METADATA_IN_PLACE, f"served steps' metadata is built in fresh memory: "
                                    f"{capacity}, so no fixed buffer can hold every step's")
            return None
        self.metadata = MetadataBuffer(capacity, setup.device)
        return self.metadata

    def __call__(self, gm: fx.GraphModule, example_inputs: list) -> CompiledReplayModel:
        frame = admit_graph(self)
        self._check_window(self.setup, marked_window(gm))  # before the compile, which may take minutes
        grad_enabled = torch.is_grad_enabled()  # the traced call's grad mode, a guard of the frame
        model = build(gm, example_inputs, self.config, self.piece_cache, self.dp_group, self.calls,
                      len(self.compiled), self.lifecycle)
        if self.config.debug_check_ranks:
            model.tp_group = self.tp_group
        model.grad_enabled = grad_enabled
        inspection.on_built(model)
        self.compiled.append(model)
        if frame is not None:
            self.traced_code.add(frame[0])
        self.lifecycle.advance(Phase.WARMING)
        return model


def dsv41_replay(gm: fx.GraphModule, example_inputs: list, mode: str | None = None,
                 options: dict | None = None) -> CompiledReplayModel:
    """Entry point registered as ``torch_dynamo_backends: dsv41_replay``: every graph of
    one ``torch.compile`` call goes to that call's one :class:`ReplayBackend`."""
    call = compat_dynamo.torch_compile_call(sys._getframe(1))
    config = ReplayConfig.from_options(options, mode)
    if call is None:
        why = ("not called through torch.compile's wrapper, so each graph gets a backend of its own and "
               "recompiles are not counted; pass backend=ReplayBackend(...) to keep one")
        process_fallback(Fallback.PER_CALL_STATE, why, config.strict)
        return ReplayBackend(config)(gm, example_inputs)
    return compat_dynamo.compile_call_state(call, lambda: ReplayBackend(config))(gm, example_inputs)


def backend_of(compiled) -> ReplayBackend:
    """The :class:`ReplayBackend` behind a model compiled with ``backend="dsv41_replay"``
    (or given one): its plan, capture and start of serving."""
    if isinstance(compiled, ReplayBackend):
        return compiled
    if isinstance(getattr(compiled, "backend", None), ReplayBackend):  # replay_backend.compile's, a StepRunner
        return compiled.backend
    state = compat_dynamo.compile_call_state_of(compiled)
    given = compat_dynamo.compile_call_backend(compiled)
    if state is None and isinstance(given, ReplayBackend):  # torch.compile(model, backend=ReplayBackend(...))
        return given
    if state is None:
        raise ValueError("backend_of: no dsv41_replay backend state behind this object: compile a module with "
                         "torch.compile(model, backend='dsv41_replay') and run one step through it first. If it ran "
                         "a step, Dynamo ran another instance's compiled code for it (instances of one class "
                         "compiled by name share it): compile each instance with replay_backend.compile(...) or "
                         "torch.compile(model, backend=ReplayBackend(...))")
    return state
