"""The stages that turn one traced graph into a compiled model, in order:
find and check the replay region, decide the main graphs' sizes, split at the
attention ops, compile and wrap the pieces, and record the split plan. Each stage is
one function; :func:`build` runs them.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import fx

from .fallbacks import Fallback
from . import inspection
from .compat import dynamo as compat_dynamo
from .capture.graphs import GraphLevel, GraphResources
from .compiling.piece_cache import PieceCache
from .compiling.pieces import PieceCompiler, wrap_uncompiled
from .config import ReplayConfig
from .dispatch.compiled import CompiledReplayModel
from .dispatch.direct import CallLog
from .dispatch.region_attention import RegionAttention
from .dispatch.trim_op import ReplayRuntime
from .forward_context import get_forward_context, has_forward_context
from .lifecycle import Lifecycle
from .ops import BEGIN, END, TRIM
from .passes.common import node_value
from .passes.floats import float_per_use
from .passes.region import ExtractedRegion, ReplayRegionError, extract_replay_region, marked_window, replay_spans
from .passes.roles import OpRole, declared_in
from .passes.row_local import padding_unsafe, reads_rows_together
from .passes.split import input_sources, live_across, split_at_ops, step_dependent_ops, unsplit_attention
from .plan import SplitPlan
from .tracing.generic import admit_every_token_count

log = logging.getLogger("replay_backend")

STATIC_TRACE = (
    "dsv41_replay: the model step was traced with a static token count, so it could neither trim nor pad "
    "to its graphs, and the next step's count would recompile. Trace it dynamic in the token count: "
    "replay_backend.compile(model, token_args, options=...) (which also serves one-token steps directly), "
    "torch.compile(model, backend='dsv41_replay', dynamic=True) with a first step of at least 2 tokens, or "
    "replay_backend.mark_token_dims(input_ids, positions, ...) before the first call. Traced that way, the model "
    "itself fixed the count: an op that needs it as a number (unbind or a Python loop over the token rows, "
    "say) specialized it; TORCH_LOGS=+dynamic names the line")


@dataclass(frozen=True)
class Traced:
    """What the stages read of the traced graph's inputs."""

    fake_mode: object
    fake_inputs: list
    token_inputs: list[int]  # tensors whose first dimension is the token count
    sym_inputs: list[int]  # the symbolic token count itself
    int_inputs: list[int]  # other symbolic ints: Python ints of the call, passed afresh each step
    names: tuple[str, ...]  # each input's placeholder name, for messages
    use_cuda: bool  # graphs on CUDA (else emulated on the CPU)
    token_outputs: tuple[tuple[int, ...], ...] | None  # for each output, the dimensions the token count sizes

    @property
    def token_sizes(self) -> list:
        """The token-count symbols of the graph's inputs."""
        return ([self.fake_inputs[i].shape[0] for i in self.token_inputs]
                + [self.fake_inputs[i] for i in self.sym_inputs])

    @property
    def int_sizes(self) -> list:
        """The symbols of the Python ints of the call."""
        return [self.fake_inputs[i] for i in self.int_inputs]


@dataclass
class RegionParts:
    """The replay region split and wrapped, with its runtime (the trim op's target)."""

    split: fx.GraphModule
    infos: list
    level: GraphLevel
    runtime: ReplayRuntime
    sizes: list[int]  # replay capture sizes


def build(gm: fx.GraphModule, example_inputs: list, cfg: ReplayConfig,
          cache: PieceCache | None = None, dp_group=None, calls: CallLog | None = None,
          graph_index: int = 0, lifecycle: Lifecycle | None = None) -> CompiledReplayModel:
    if cfg.decoder_replay and (marked := marked_window(gm)) is not None:
        # Before anything else: the first graph must refuse a threshold the window makes
        # useless, even where this graph could not trim (e.g. one traced with static shapes).
        cfg.check_window(marked)
    cache = cache if cache is not None else PieceCache()
    before_split = inspection.on_traced(gm, cfg)  # before the region pass edits gm in place
    float_per_use(gm)  # before any pass cuts the graph: no symbolic float crosses a cut
    traced = _traced(gm, example_inputs, cfg)
    numbers = compat_dynamo.number_inputs(gm)
    if not traced.token_inputs and (marked_window(gm) is not None or declared_in(gm, OpRole.ATTENTION)):
        raise ValueError(STATIC_TRACE)
    res = GraphResources(use_cuda=traced.use_cuda, strict=cfg.strict, check_every_replay=cfg.debug_check_addresses,
                         lifecycle=lifecycle if lifecycle is not None else Lifecycle())
    graphs = cfg.graphs_enabled and bool(traced.token_inputs)
    # A trace that holds for one token count only fails here, before the passes read its
    # shapes: a token dimension fixed by the trace is no token dimension to them.
    admit_every_token_count(traced.fake_mode, traced.token_sizes, cfg.max_num_batched_tokens, res.fallback,
                            relax=False, int_sizes=traced.int_sizes)
    # Attention breaks and KV sources as the model declared them (passes/roles.py),
    # unless the options name the splitting ops.
    splitting = cfg.splitting_ops if cfg.splitting_ops is not None else declared_in(gm, OpRole.ATTENTION)
    _refuse_unsplit_attention_in_replay_layers(gm, splitting)
    together = _after_regions_of_the_step(gm, splitting)
    region, off_reason = _find_region(gm, cfg, splitting, res)
    graph_sizes = _main_sizes(gm, cfg, splitting, res) if graphs else []
    main_sizes = graph_sizes if cfg.piecewise_graphs else []
    # FULL graph sizes: those of the capture sizes whose steps never trim.
    full_sizes = [s for s in cfg.full_capture_sizes(region is not None) if s in graph_sizes]
    main_level = GraphLevel("main", main_sizes)
    split, main_infos = split_at_ops(gm, splitting, TRIM if region is not None else None,
                                     replay_spans(gm) if region is None else frozenset())
    parts = _region_parts(region, cfg, splitting, main_sizes, graphs, res) if region is not None else None
    _compile(split, main_infos, main_level, parts, cfg, res, cache, traced)
    for info in main_infos:
        if info.in_region:
            split._modules[info.name] = RegionAttention(getattr(split, info.name))
    for gm, infos in ((split, main_infos), *(((parts.split, parts.infos),) if parts else ())):
        for name, sources in input_sources(gm, infos).items():
            gm.get_submodule(name).input_sources = sources
    # Last: compiling the pieces records guards on the token count too.
    admit_every_token_count(traced.fake_mode, traced.token_sizes, cfg.max_num_batched_tokens, res.fallback,
                            int_sizes=traced.int_sizes)
    plan = _split_plan(cfg, region, main_sizes, main_infos, parts, off_reason, splitting)
    sources = inspection.GraphSources(before_split, region.graph if region is not None else None)
    dump_dir = inspection.dump_dir_for(cfg.debug_dump_path, graph_index) if cfg.debug_dump_path else None
    return CompiledReplayModel(split, cfg, plan, main_level, parts.runtime if parts else None, traced.token_inputs,
                               traced.sym_inputs, res, calls=calls, sources=sources, dump_dir=dump_dir,
                               dp_group=dp_group, full_sizes=full_sizes, number_inputs=numbers,
                               int_inputs=tuple(traced.int_inputs), input_names=traced.names,
                               token_outputs=traced.token_outputs, reads_rows_together=together)


def _traced(gm: fx.GraphModule, example_inputs: list, cfg: ReplayConfig) -> Traced:
    fake_mode = compat_dynamo.detect_fake_mode(example_inputs)
    fake_inputs = compat_dynamo.fakeify(fake_mode, example_inputs) if fake_mode else list(example_inputs)
    names = tuple(n.name for n in gm.graph.nodes if n.op == "placeholder")
    tokens = []
    for i, x in enumerate(fake_inputs):
        if isinstance(x, torch.Tensor):
            dims = compat_dynamo.symbolic_dims(x)
            if dims and dims != [0]:
                raise ValueError(f"graph input {i} is dynamic in dims {dims}: dsv41_replay supports "
                                 "graphs dynamic only in the token count (dim 0)")
            if layout := compat_dynamo.symbolic_layout(x):
                raise ValueError(f"graph input {i} ({names[i]}) was traced as a view into a larger tensor "
                                 f"({', '.join(layout)} symbolic): give the model's first call tensors of their "
                                 "own (a slice's .clone()); later calls may pass views")
            if dims:
                tokens.append(i)
    # A symbolic int is the token count where it is the token inputs' row count; any
    # other is a Python int of the call (dynamic=True makes every int symbolic).
    counts = [fake_inputs[i].shape[0] for i in tokens]
    syms, ints = [], []
    for i, x in enumerate(fake_inputs):
        if compat_dynamo.is_symint(x):
            (syms if any(compat_dynamo.same_size(x, c) for c in counts) else ints).append(i)
    use_cuda = cfg.graphs_enabled and bool(tokens) and any(
        isinstance(x, torch.Tensor) and x.device.type == "cuda" for x in fake_inputs)
    out = gm.graph.output_node().args[0]  # Dynamo's graphs return a tuple; a graph built by hand may not
    token_outputs = None if not isinstance(out, (tuple, list)) else tuple(
        tuple(d for d, size in enumerate(v.shape) if compat_dynamo.is_symint(size)
              and compat_dynamo.same_size(size, counts[0])) if isinstance(v, torch.Tensor) and counts else ()
        for v in (node_value(n) if isinstance(n, fx.Node) else n for n in out))
    return Traced(fake_mode, fake_inputs, tokens, syms, ints, names, use_cuda, token_outputs)


def _find_region(gm: fx.GraphModule, cfg: ReplayConfig, splitting, res: GraphResources
                 ) -> tuple[ExtractedRegion | None, str | None]:
    """The replay region moved out of ``gm`` (which now holds the trim op), or None
    and why not; a region the passes refuse is a counted fallback."""
    if not cfg.decoder_replay:
        return None, "decoder_replay=false"
    try:
        region = extract_replay_region(gm, splitting, declared_in(gm, OpRole.KV_SOURCE))
    except ReplayRegionError as e:
        res.fallback(Fallback.REPLAY_REGION_UNSUPPORTED, str(e))
        return None, str(e)
    if region is None:
        return None, "no replay boundary markers in the graph"
    cfg.check_window(region.window)
    return region, None


def _after_regions_of_the_step(gm: fx.GraphModule, splitting) -> str | None:
    """A graph built in a step after other graphs of it ran their replay regions (the
    model has graph breaks) and that reads rows together reads their results, whose
    rows a trim leaves unwritten but the kept ones: those regions trim no more. Returns
    why it reads rows together, for its own steps' check (None: it reads each row alone,
    or no region ran before it). (What follows replay_end in the region's own graph,
    passes/region.py checks.)"""
    regions = get_forward_context().regions_run if has_forward_context() else []
    together = reads_rows_together(gm, splitting) if regions else None
    if together is not None:
        for runtime, _ in regions:
            runtime.refuse_trim(together)
    return together


def _refuse_unsplit_attention_in_replay_layers(gm: fx.GraphModule, splitting) -> None:
    """Attention in the replay layers applies each request's replay floor in every step,
    which it learns from the view a splitting op is pointed at (the trim op's, or
    RegionAttention's where the region stays in the main graph). Left inside a piece it
    would read the whole batch's view and attend below the floor: wrong, in every mode."""
    found = unsplit_attention(replay_spans(gm), splitting)
    if found:
        raise ValueError(f"option splitting_ops leaves out {', '.join(found)}, declared attention in the replay "
                         "layers (between replay_begin and replay_end): attention there applies the replay floor "
                         f"only as a splitting op. Add it to splitting_ops (now {list(splitting)}), or leave the "
                         "option unset (every declared attention op)")


def _main_sizes(gm: fx.GraphModule, cfg: ReplayConfig, splitting, res: GraphResources) -> list[int]:
    """The main graphs' sizes: none where padding a step could change its real rows."""
    sizes = cfg.capture_sizes()
    if sizes:
        _refuse_step_dependent_in_graphs(gm, splitting)
    if sizes and (why := padding_unsafe(gm, splitting)) is not None:
        res.fallback(Fallback.MAIN_GRAPHS_PADDING_UNSAFE, f"steps run without main graphs, which would pad them: {why}")
        return []
    return sizes


def _region_parts(region: ExtractedRegion, cfg: ReplayConfig, splitting, main_sizes: list[int], graphs: bool,
                  res: GraphResources) -> RegionParts:
    sizes = cfg.replay_capture_sizes(region.window) if graphs else []
    if main_sizes and cfg.cudagraph_decoder_replay and cfg.decoder_replay_trim_threshold > max(main_sizes):
        log.warning("dsv41_replay: decoder_replay_trim_threshold=%d exceeds the largest main capture "
                    "size %d: PIECEWISE steps never trim (eager steps still do)",
                    cfg.decoder_replay_trim_threshold, max(main_sizes))
    split, infos = split_at_ops(region.graph, splitting)
    if sizes or main_sizes:  # the region's pieces are captured at these sizes
        _refuse_step_dependent_in_graphs(region.graph, splitting)
    # Graphed steps below the threshold run the region on every row at their own size.
    below = [s for s in main_sizes if s < cfg.decoder_replay_trim_threshold] \
        if cfg.cudagraph_decoder_replay else main_sizes
    level = GraphLevel("replay", [*sizes, *below])  # sorted and deduplicated there
    runtime = ReplayRuntime(split, cfg, region.window, level, sizes, res, main_sizes, region.computed_consts)
    return RegionParts(split, infos, level, runtime, sizes)


def _compile(split: fx.GraphModule, infos, level: GraphLevel, parts: RegionParts | None, cfg: ReplayConfig,
             res: GraphResources, cache: PieceCache, traced: Traced) -> None:
    """Compile and wrap every graph piece of the main graph and of the region."""
    # Pieces whose outputs the trim op's region outlives: their graphs own their outputs.
    keep = frozenset(live_across(split, next(p.name for p in infos if p.kind == "replay"))) \
        if parts is not None else frozenset()
    if cfg.compiler == "eager":
        wrap_uncompiled(split, infos, level, res, keep)
        if parts is not None:
            wrap_uncompiled(parts.split, parts.infos, parts.level, res)
        return

    def compile_region(trim_args):  # with the rows and constants the trim op receives
        rows, consts = trim_args
        PieceCompiler(parts.split, parts.infos, cfg, parts.level, res, cache).run(rows[0].shape[0], *rows, *consts)

    mode = traced.fake_mode if traced.fake_mode is not None else torch._subclasses.fake_tensor.FakeTensorMode()
    with mode:
        PieceCompiler(split, infos, cfg, level, res, cache, compile_region if parts else None, keep
                      ).run(*traced.fake_inputs)


def _split_plan(cfg: ReplayConfig, region, main_sizes, main_infos, parts: RegionParts | None, off_reason,
                splitting) -> SplitPlan:
    replay_infos = parts.infos if parts is not None else []
    layers = sorted(set().union(*(p.layers for p in replay_infos))) if replay_infos else []
    for p in main_infos:
        if p.kind == "replay":
            p.layers = layers
    plan = SplitPlan(region.window if region is not None else None, cfg.decoder_replay_trim_threshold,
                     [layers[0], layers[-1]] if layers else None, main_sizes, parts.sizes if parts else [],
                     main_infos, replay_infos, off_reason, {**cfg.as_dict(), "splitting_ops": list(splitting)})
    log.info("dsv41_replay split plan:\n%s", plan.render())
    return plan


def _refuse_step_dependent_in_graphs(gm: fx.GraphModule, splitting: tuple[str, ...]) -> None:
    """An op that reads per-step state (tagged ``cudagraph_unsafe``) must be a splitting op
    when pieces are captured. The boundary markers are exempt: a graphed step runs them
    as the identity they are in compiled models; so is the trim op, a splitting op."""
    found = step_dependent_ops(gm, splitting, compat_dynamo.step_dependent_tags(), frozenset((BEGIN, END, TRIM)))
    if found:
        raise ValueError(f"option splitting_ops: {', '.join(found)} read(s) per-step state (tagged cudagraph_unsafe) "
                         "but would be captured inside a graph piece: declare them attention ops "
                         "(replay_backend.declare_attention), add them to splitting_ops, or run with "
                         "cudagraph_mode='none'")
