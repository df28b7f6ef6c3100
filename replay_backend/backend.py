"""The ``dsv41_replay`` torch.compile backend: trace -> split -> compile -> graphs -> dispatch.

``torch.compile(model, backend="dsv41_replay", options={...})`` finds this module
through the ``torch_dynamo_backends`` entry point. :class:`ReplayBackend` is the same
thing as an object, for runners that need to reach the compiled model (capture,
inspection) and to make recompiles after warm-up an error.
"""
from __future__ import annotations

import logging
import sys
from typing import Any, Callable

import torch
from torch import fx

from .passes.region import BEGIN, END, TRIM, ReplayRegionError, extract_replay_region, marked_window
from .passes.roles import OpRole, declared_in
from .passes.row_local import padding_unsafe
from .passes.split import live_across, split_at_ops, step_dependent_ops

from . import inspection, torch_compat
from .config import ReplayConfig
from .counters import counters
from .forward_context import has_forward_context
from .lifecycle import Lifecycle, Phase
from .compiling.piece_cache import PieceCache
from .compiling.pieces import PieceCompiler, wrap_uncompiled
from .plan import SplitPlan
from .dispatch.compiled import CompiledReplayModel
from .dispatch.direct import CallLog
from .capture.graphs import GraphLevel, GraphResources, StrictFallbackError
from .dispatch.trim_op import ReplayRuntime

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
        # runner learns from them how to call the model without Dynamo (runtime/direct.py).
        self.calls = CallLog()

    @property
    def model(self) -> CompiledReplayModel:
        if not self.compiled:
            raise RuntimeError("nothing compiled yet: run one step through the compiled model first")
        return self.compiled[-1]

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
                "dynamic only "
                "in the token count (mark the token dimension dynamic; see docs/debugging.md)")
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
        if config.strict:
            raise StrictFallbackError(f"per_call_state: {why} (strict=True turns fallbacks into errors)")
        counters.fallbacks["per_call_state"] += 1
        if counters.fallbacks["per_call_state"] == 1:
            log.warning("dsv41_replay fallback [per_call_state]: %s", why)
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


def _token_inputs(gm: fx.GraphModule, fake_inputs: list) -> tuple[list[int], list[int]]:
    tokens, syms = [], []
    for i, x in enumerate(fake_inputs):
        if torch_compat.is_symint(x):
            syms.append(i)
        elif isinstance(x, torch.Tensor):
            dims = torch_compat.symbolic_dims(x)
            if dims and dims != [0]:
                raise ValueError(f"graph input {i} is dynamic in dims {dims}: dsv41_replay supports "
                                 "graphs dynamic only in the token count (dim 0)")
            if dims:
                tokens.append(i)
    return tokens, syms


def _refuse_step_dependent_in_graphs(gm: fx.GraphModule, splitting: tuple[str, ...]) -> None:
    """An op that reads per-step state (tagged ``cudagraph_unsafe``) must be a splitting op
    when pieces are captured. The boundary markers are exempt: a graphed step runs them
    as the identity they are in compiled models; so is the trim op, a splitting op."""
    found = step_dependent_ops(gm, splitting, torch_compat.step_dependent_tags(), frozenset((BEGIN, END, TRIM)))
    if found:
        raise ValueError(f"option splitting_ops: {', '.join(found)} read(s) per-step state (tagged cudagraph_unsafe) "
                         "but would be captured inside a graph piece: declare them attention ops "
                         "(replay_backend.declare_attention), add them to splitting_ops, or run with "
                         "cudagraph_mode='none'")


def build(gm: fx.GraphModule, example_inputs: list, cfg: ReplayConfig,
          cache: PieceCache | None = None, dp_group=None, calls: CallLog | None = None,
          graph_index: int = 0, lifecycle: Lifecycle | None = None) -> CompiledReplayModel:
    if cfg.decoder_replay and (marked := marked_window(gm)) is not None:
        # Before anything else: the first graph must refuse a threshold the window makes
        # useless, even where this graph could not trim (e.g. one traced with static shapes).
        cfg.check_window(marked)
    cache = cache if cache is not None else PieceCache()
    before_split = inspection.on_traced(gm, cfg)  # before the region pass edits gm in place
    fake_mode = torch_compat.detect_fake_mode(example_inputs)
    fake_inputs = torch_compat.fakeify(fake_mode, example_inputs) if fake_mode else list(example_inputs)
    token_inputs, sym_inputs = _token_inputs(gm, fake_inputs)
    graphs = cfg.graphs_enabled and bool(token_inputs)
    use_cuda = graphs and any(isinstance(x, torch.Tensor) and x.device.type == "cuda" for x in fake_inputs)
    res = GraphResources(use_cuda=use_cuda, strict=cfg.strict, check_every_replay=cfg.debug_check_addresses,
                         lifecycle=lifecycle if lifecycle is not None else Lifecycle())
    main_sizes = cfg.capture_sizes() if graphs else []

    # Attention breaks and KV sources as the model declared them (passes/roles.py),
    # unless the options name the splitting ops.
    splitting = cfg.splitting_ops if cfg.splitting_ops is not None else declared_in(gm, OpRole.ATTENTION)
    kv_sources = declared_in(gm, OpRole.KV_SOURCE)
    region, off_reason = None, None
    if not cfg.decoder_replay:
        off_reason = "decoder_replay=false"
    else:
        try:
            region = extract_replay_region(gm, splitting, kv_sources)
            if region is None:
                off_reason = "no replay boundary markers in the graph"
        except ReplayRegionError as e:
            off_reason = str(e)
            res.fallback("replay_region_unsupported", off_reason)
    window = region.window if region is not None else None
    if region is not None:
        cfg.check_window(window)

    if main_sizes:
        _refuse_step_dependent_in_graphs(gm, splitting)
    if main_sizes and (why := padding_unsafe(gm, splitting)) is not None:
        res.fallback("main_graphs_padding_unsafe",
                     f"steps run without main graphs, which would pad them: {why}")
        main_sizes = []
    main_level = GraphLevel("main", main_sizes)
    split, main_infos = split_at_ops(gm, splitting, TRIM if region is not None else None)
    # Pieces whose outputs the trim op's region outlives: their graphs own their outputs.
    keep = frozenset(live_across(split, next(p.name for p in main_infos if p.kind == "replay"))) \
        if region is not None else frozenset()
    replay = None
    replay_infos = []
    replay_sizes = cfg.replay_capture_sizes(window) if region is not None and graphs else []
    if region is not None:
        rsplit, replay_infos = split_at_ops(region.graph, splitting)
        if replay_sizes or main_sizes:  # the region's pieces are captured at these sizes
            _refuse_step_dependent_in_graphs(region.graph, splitting)
        below = [s for s in main_sizes if s < cfg.decoder_replay_trim_threshold] \
            if cfg.cudagraph_decoder_replay else main_sizes
        rlevel = GraphLevel("replay", [*replay_sizes, *below])  # sorted and deduplicated there
        replay = ReplayRuntime(rsplit, cfg, window, rlevel, replay_sizes, res, dp_group, main_sizes)

        def compile_region(trim_args):
            rows, consts = trim_args
            PieceCompiler(rsplit, replay_infos, cfg, rlevel, res, cache).run(rows[0].shape[0], *rows, *consts)
    else:
        compile_region = None

    if cfg.compiler == "eager":
        wrap_uncompiled(split, main_infos, main_level, res, keep)
        if region is not None:
            wrap_uncompiled(rsplit, replay_infos, rlevel, res)
    else:
        ctx = fake_mode if fake_mode is not None else torch._subclasses.fake_tensor.FakeTensorMode()
        with ctx:
            PieceCompiler(split, main_infos, cfg, main_level, res, cache, compile_region, keep).run(*fake_inputs)

    if region is not None and main_sizes and cfg.cudagraph_decoder_replay \
            and cfg.decoder_replay_trim_threshold > max(main_sizes):
        log.warning("dsv41_replay: decoder_replay_trim_threshold=%d exceeds the largest main capture "
                    "size %d: PIECEWISE steps never trim (eager steps still do)",
                    cfg.decoder_replay_trim_threshold, max(main_sizes))
    replay_layers = sorted(set().union(*(p.layers for p in replay_infos))) if replay_infos else []
    for p in main_infos:
        if p.kind == "replay":
            p.layers = replay_layers
    plan = SplitPlan(window, cfg.decoder_replay_trim_threshold,
                     [replay_layers[0], replay_layers[-1]] if replay_layers else None,
                     main_sizes, replay_sizes, main_infos, replay_infos, off_reason,
                     {**cfg.as_dict(), "splitting_ops": list(splitting)})
    log.info("dsv41_replay split plan:\n%s", plan.render())
    sources = inspection.GraphSources(before_split, region.graph if region is not None else None)
    dump_dir = inspection.dump_dir_for(cfg.debug_dump_path, graph_index) if cfg.debug_dump_path else None
    return CompiledReplayModel(split, cfg, plan, main_level, replay, token_inputs, sym_inputs, res,
                               calls=calls, sources=sources, dump_dir=dump_dir)
