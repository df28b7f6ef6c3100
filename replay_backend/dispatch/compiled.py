"""The callable the backend returns: pads each step, dispatches main graphs, captures.

Inputs whose first dimension is the token count are copied into persistent buffers
sliced to the padded size, so captured pieces read stable addresses; symbolic
token-count arguments are replaced by the padded size.
"""
from __future__ import annotations

import dataclasses
from collections import Counter

from torch import fx

from ..config import ReplayConfig
from ..fallbacks import Fallback, StrictFallbackError
from ..forward_context import get_forward_context, has_forward_context
from ..lifecycle import Phase
from ..capture.full import FullGraphs
from ..capture.graphs import GraphLevel, GraphResources, PieceRunner
from .decide import Sizes, StepKind, StepPlan, plan_step
from ..parallel import check_same_plan
from .agree import agree_step, give_up_step
from .direct import GraphCall
from .step_inputs import StepInputs
from .step_outputs import StepOutputs
from .trim_op import ReplayRuntime


# Dynamo compiles per code object: two instances of one module class compiled by name
# share the compiled code, so the second's calls reach the first's graphs, whose
# captured pieces read the first's weights. Its parameters arrive in the graph's
# arguments, which is how this is caught.
ANOTHER_INSTANCE = (
    "dsv41_replay: this compiled model was traced for another instance of the module: Dynamo shares compiled "
    "code between instances of one class compiled by name, so these steps would run the first instance's "
    "captured graphs and weights. Compile each instance with replay_backend.compile(...) or "
    "torch.compile(model, backend=ReplayBackend(...))")


class CompiledReplayModel:
    def __init__(self, split_gm: fx.GraphModule, cfg: ReplayConfig, plan, main_level: GraphLevel,
                 replay: ReplayRuntime | None, token_inputs: list[int], sym_inputs: list[int],
                 res: GraphResources, calls=None, sources=None, dump_dir: str | None = None,
                 dp_group=None, full_sizes: list[int] | None = None,
                 number_inputs: tuple[int, ...] | None = None, int_inputs: tuple[int, ...] = (),
                 input_names: tuple[str, ...] = (), token_outputs: tuple[tuple[int, ...], ...] | None = None,
                 reads_rows_together: str | None = None) -> None:
        self.split_gm, self.cfg, self.plan = split_gm, cfg, plan
        self.dp_group = dp_group  # data-parallel ranks that agree on every step (agree.py)
        self.tp_group = None  # with debug_check_ranks: tensor-parallel ranks that check every plan
        self.main_level, self.replay, self.res = main_level, replay, res
        self.token_inputs, self.sym_inputs = token_inputs, sym_inputs
        self.outputs = StepOutputs(token_outputs)
        # Why this graph reads rows together (passes/row_local.py), or None: run after a
        # trimmed region of the same step it would read rows the trim left unwritten.
        self.reads_rows_together = reads_rows_together
        # What a model without a replay region decides steps by (with one, the region's
        # runtime holds the full record).
        self.sizes = Sizes(main=tuple(main_level.sizes))
        # FULL graphs (capture/full.py) and what decides which steps take them, set when
        # capture resolves the attention's support (full_policy.py); None: no FULL step.
        self.full = FullGraphs(res)
        self.full_sizes = sorted(full_sizes or [])  # the mode's, before the attention's support is known
        self.full_policy = None
        self.full_resolved = False  # the policy was decided (a downgrade is counted once)
        self.output_row_bytes = 0  # the step's outputs per token row, measured with the memory estimate
        # The fixed buffers graphed steps read, as long as the largest graph's rows.
        self.inputs = StepInputs(token_inputs, sym_inputs, number_inputs,
                                 max((*main_level.sizes, *self.full_sizes), default=0), int_inputs, input_names)
        # For inspection (plan_of, dumps), never read by dispatch: steps per padded size of
        # each runner since capture, the last capture summary, the graphs as traced
        # (inspection.GraphSources) and this model's dump directory (None: no dump).
        self.dispatch: dict[str, Counter] = {"main": Counter(), "replay": Counter(), "full": Counter()}
        self.capture_summary: dict = {}
        self.sources, self.dump_dir = sources, dump_dir
        self.calls = calls  # the backend's CallLog (direct.py): calls through Dynamo to learn from
        # The arguments of the first call, the token count left open (direct.GraphCall):
        # how the backend runs dummy steps itself. The plan of the last step run.
        self.graph_call: GraphCall | None = None
        self.started = 0  # calls that reached this model: a step under way, maybe agreed
        self.last_plan: StepPlan | None = None
        self.grad_enabled = False  # the grad mode it was traced under (the backend sets it)
        self.needs_context = replay is not None or any(p.kind == "attention" for p in plan.main_pieces)

    @property
    def serving(self) -> bool:
        return self.res.lifecycle.serving

    # ---- pieces ---------------------------------------------------------------------
    def runners(self, level: str) -> list[PieceRunner]:
        gm = self.split_gm if level == "main" else (self.replay.region if self.replay else None)
        return [m for m in gm.children() if isinstance(m, PieceRunner)] if gm is not None else []

    def captured_sizes(self, level: str) -> list[int]:
        return sorted({size for r in self.runners(level) for size in r.graphs})

    @property
    def __code__(self):
        """depyf takes what a backend returns for a function and reads its ``__code__``
        when it writes ``full_code_for_*``: show it this class's step."""
        return type(self).__call__.__code__

    def plan_snapshot(self):
        """The split plan with each runner's captured sizes and dispatch counts now, and
        why no step trims where a later graph turned trimming off after the split."""
        from ..plan import runner_stats

        plan = dataclasses.replace(self.plan, runners=runner_stats(self))
        if self.replay is not None and self.replay.trim_refused is not None and plan.replay_off_reason is None:
            plan = dataclasses.replace(plan, replay_off_reason=f"no step trims: a later graph of the step reads the "
                                                              f"region's rows together ({self.replay.trim_refused})")
        return plan

    # ---- one step -------------------------------------------------------------------
    def __call__(self, *args):
        self.started += 1
        call = self.graph_call
        if call is None:
            call = self.graph_call = GraphCall.of(self, args)
            self.inputs.find_scalars(args)
        try:  # a step refused before it ran: data-parallel ranks are told (fail_step)
            if call.anchor is not None and args[call.anchor] is not call.template[call.anchor]:
                raise RuntimeError(ANOTHER_INSTANCE)
            # Attention and the trim op read the step from its context: without one, say
            # so before any piece runs.
            ctx = get_forward_context() if has_forward_context() or self.needs_context else None
            if ctx is not None:
                ctx.batch.check_current()  # a batch whose metadata a later build overwrote
                self.inputs.check_rows(ctx.batch, args)
        except (RuntimeError, ValueError) as e:
            self.fail_step(e)
        if ctx is None:
            out, plan = self._step(ctx, args)
        else:
            ctx.compiled_step = True
            try:
                out, plan = self._step(ctx, args)
            finally:
                ctx.compiled_step = False
        self.last_plan = plan
        if self.res.lifecycle.measuring:  # what a FULL graph keeps per row (capture/memory.py)
            self.output_row_bytes = self.outputs.row_bytes(out)
        if plan is not None:
            self.res.lifecycle.last_plan = plan
        if self.res.lifecycle.phase is Phase.CAPTURED:
            # Only a served batch is laid out where FULL graphs read (backend.build_batch).
            full = ", and no step runs as a FULL graph" if self.full_policy is not None else ""
            self.res.lifecycle.phase_note("steps run after capture() without start_serving(): a recompile is not an "
                                          f"error yet, a size without a graph is captured in the step{full}; call "
                                          "start_serving() once warm-up is over")
        if plan is not None and plan.kind is StepKind.FULL:
            self.dispatch["full"][plan.padded_tokens] += 1
        elif plan is not None:
            self.dispatch["main"][plan.padded_tokens if plan.kind is StepKind.PIECEWISE else "eager"] += 1
            if plan.has_region:
                self.dispatch["replay"][plan.replay_padded if plan.replay_padded is not None else "eager"] += 1
        if self.calls is not None and self.calls.active:
            self.calls.record(self, args, out)
        return out

    def decide(self, ctx, num_tokens: int, args) -> StepPlan:
        """The step's one decision (dispatch/decide.py), made before it runs, agreed with
        the data-parallel ranks (agree.py); while the main graphs are captured every rank
        captures the same size, and nothing needs agreeing. ``args``: the step's, whose
        Python numbers must be the ones its graphs hold (step_inputs.py)."""
        use_graphs = ctx is None or ctx.use_graphs
        batch = ctx.batch if ctx is not None else None
        policy = self.full_policy
        full = policy is not None and batch is not None and batch.graph is not None
        if full and not policy.reads(batch):
            self._fallback(Fallback.METADATA_IN_PLACE, "a batch laid out for FULL graphs but not where they read "
                           "(built outside the backend's metadata buffer, or for another number of rows) runs in "
                           "pieces: build it with the compiled model's build_batch")
            full = False
        elif policy is not None and batch is not None and batch.graph is None and self.res.lifecycle.serving \
                and policy.wants_layout(batch.requests):
            # The backend's build_batch lays out every served batch a FULL graph may run.
            self._fallback(Fallback.METADATA_IN_PLACE, "a batch that could run as a FULL graph was built without "
                           "the graph layout (with build_step_batch, not the compiled model's build_batch), so it "
                           "runs in pieces: build served batches with the compiled model's build_batch")
        full = full and policy.takes(batch.requests)
        fell_back = False
        if use_graphs and self.cfg.graphs_enabled and (changed := self.inputs.changed_number(args)):
            use_graphs, fell_back = False, True
            # Counted where a graph would have run; over data-parallel ranks whether one
            # would is the agreed step's, not known here.
            if self._agrees or self._plan(ctx, num_tokens, True, None, full).runs_graphs:
                self._fallback(Fallback.NUMBER_CHANGED, f"a Python number the model is called with changed since "
                               f"the first call ({changed}); captured graphs hold its first value, so this step "
                               "runs without graphs. Keep it constant, or make it a 0-dim tensor on the model's "
                               "device that you update in place")
        agreement = agree_step(self.dp_group if self._agrees else None, self.tp_group, use_graphs, num_tokens,
                               batch is not None and (self.replay.trimmable(batch) if self.replay is not None
                                                      else batch.has_trimmable_rows),
                               batch.replay.num_rows if batch is not None else num_tokens, full, fell_back)
        if agreement is not None and agreement.fell_back and use_graphs and self.cfg.graphs_enabled and \
                self._plan(ctx, num_tokens, True, dataclasses.replace(agreement, graphs=True), full).runs_graphs:
            # Counted where a graph would have run, and only counted: every rank has the
            # same options, so under ``strict`` the rank that fell back failed the step
            # before the agreement, and none gets here.
            self.res.fallback(Fallback.PEER_FALLBACK, "a data-parallel rank fell back to running this step "
                              "without graphs (its own warning says why), so every rank runs it without graphs: "
                              "the collectives inside the graphs would not meet")
        plan = self._plan(ctx, num_tokens, use_graphs, agreement, full)
        if self.tp_group is not None:
            check_same_plan(plan, self.tp_group)
        return plan

    def _plan(self, ctx, num_tokens: int, use_graphs: bool, agreement, full: bool) -> StepPlan:
        if self.replay is not None and ctx is not None:
            return self.replay.plan(ctx.batch, num_tokens, use_graphs, agreement, full)
        return plan_step(self.sizes, num_tokens, 0, False, use_graphs=use_graphs, agreement=agreement, full=full)

    def _fallback(self, reason: Fallback, detail: str) -> None:
        """A fallback of this step; under ``strict`` it fails the step (``fail_step``)."""
        try:
            self.res.fallback(reason, detail)
        except StrictFallbackError as e:
            self.fail_step(e)

    @property
    def _agrees(self) -> bool:
        """Whether this model's steps are agreed with data-parallel ranks (a step with
        token inputs, not while the main graphs are captured: every rank captures the
        same size then)."""
        return self.dp_group is not None and bool(self.token_inputs) and not self.res.lifecycle.capturing_main

    def fail_step(self, error: Exception):
        """Raise ``error``, this rank's own before the step's agreement: with
        data-parallel ranks after telling them in the agreement, so that each raises
        too rather than wait in a collective of the step this rank will not join; with
        ``debug_check_ranks``, the tensor-parallel ranks too, in an exchange ahead of it.
        Without that check a tensor-parallel rank is not told: the ranks share one batch,
        so a refusal on one of them alone means their servers diverged."""
        give_up_step(self.dp_group if self._agrees else None, self.tp_group if self.token_inputs else None, error)
        raise error

    def _step(self, ctx, args) -> tuple:
        """Run one step; returns (outputs, its plan, or None for a graph without tokens)."""
        if not self.token_inputs:
            return self.split_gm(*args), None
        t = args[self.token_inputs[0]].shape[0]
        if ctx is not None and self.reads_rows_together and any(trimmed for _, trimmed in ctx.regions_run):
            # Only in the step that first reached this graph: building it turned that
            # region's trimming off for the steps after (pipeline.py).
            self.fail_step(ValueError(
                f"dsv41_replay: this graph reads rows together ({self.reads_rows_together}) after a graph of the same "
                "step trimmed its replay region, which leaves all but the kept rows unwritten: this step's results "
                "would be wrong. Trimming is off from now on; keep what follows replay_end in the markers' graph "
                "(no graph break there)"))
        plan = self.decide(ctx, t, args)
        if ctx is not None:
            ctx.plan, ctx.replay_runtime = plan, self.replay
            if self.replay is not None:
                ctx.regions_run.append((self.replay, plan.trim))
        if plan.kind is StepKind.EAGER:
            return self._eager_padded(args, t, plan), plan
        tp = plan.padded_tokens
        new = self.inputs.padded(args, t, tp)
        graph = ctx.batch.graph if ctx is not None else None
        if graph is None or tp > graph.rows:
            out = self._run_at(tp, new, plan)
        else:
            # Attention reads the batch's graph layout at this size, in a FULL step and
            # in pieces alike: one computation, whichever graphs run it.
            ctx.use_views(*graph.views(ctx.batch.view, tp))
            try:
                out = self._run_at(tp, new, plan, ctx)
            finally:
                ctx.use_views(ctx.batch.view, ctx.batch.region_view)
        return self.outputs.own(out, t, graphed=True), plan

    def _run_at(self, tp: int, new: list, plan: StepPlan, ctx=None) -> tuple:
        """The step at ``tp`` padded tokens: its FULL graph, or the pieces' graphs."""
        if plan.kind is StepKind.FULL:
            if ctx.prepare_view is not None:  # the model's host planning, before the graph reads it
                ctx.prepare_view(ctx.active, tp)
                # the replay layers' view, which they read inside the graph in a region
                # or, where none was cut out, between the main layers (RegionAttention)
                ctx.prepare_view(ctx.region_view, tp)
            return self.full.run(tp, lambda: self._pieces_at(None, new), ctx, new,
                                 lambda: self._pieces_at(tp if tp in self.main_level.sizes else None, new))
        return self._pieces_at(tp, new)

    def _pieces_at(self, size: int | None, new: list) -> tuple:
        with self.main_level.at(size):
            return self.split_gm(*new)

    def _eager_padded(self, args, t: int, plan: StepPlan) -> tuple:
        """A step whose main layers run without graphs, on the plan's padded rows, ``t``
        of them real. The pinned numbers go in wherever the step's own still equal them:
        whatever the trim op keeps of this step (capture's replay graphs are captured on
        the last step's) must be what every graph reads."""
        pin = plan.replay_padded is not None or self.inputs.changed_number(args) is None
        new = self.inputs.eager_padded(args, plan.padded_tokens, pin)
        return self.outputs.own(self.split_gm(*new), t, graphed=False)

    # ---- capture --------------------------------------------------------------------
    def estimate_graph_memory(self, run_step_without_graphs, replay_view_for, run_full_step=None):
        """What :meth:`capture` will take from the GPU, measured without capturing
        (a :class:`~replay_backend.capture.memory.GraphMemoryEstimate`).
        ``run_step_without_graphs(n)`` runs a dummy step of ``n`` tokens with a forward
        context whose ``use_graphs`` is False; ``run_full_step(n)``, capture's dummy
        FULL step of ``n`` tokens (capture/full.py), runs as its graph will hold it."""
        from ..capture.memory import estimate_graph_memory

        return estimate_graph_memory(self, run_step_without_graphs, replay_view_for, run_full_step=run_full_step)

    def attention_ops(self) -> list[str]:
        """The attention ops the step runs (``namespace::name``), once each."""
        return list(dict.fromkeys(p.op for p in (*self.plan.main_pieces, *self.plan.replay_pieces)
                                  if p.kind == "attention" and p.op))

    def use_full_policy(self, policy) -> None:
        """Which steps run as FULL graphs from now on (full_policy.py; None: none)."""
        self.full_policy = policy
        full = policy.sizes if policy is not None else ()
        self.sizes = dataclasses.replace(self.sizes, full=full)
        if self.replay is not None:
            self.replay.sizes = dataclasses.replace(self.replay.sizes, full=full)

    def capture(self, run_main_step, replay_view_for, metadata=None, run_full_step=None) -> dict:
        """Capture every graph, in the order capture/schedule.py gives; returns the
        per-level summary."""
        from ..capture.schedule import capture_all

        return capture_all(self, run_main_step, replay_view_for, metadata, run_full_step)

    def start_serving(self) -> None:
        """Serving starts (the backend's phase says so): keep what served steps look up.
        A FULL size without a graph leaves the policy, so that no served step plans one
        it cannot run (its steps run in pieces, as the counted fallback)."""
        if self.replay is not None:
            self.replay.start_serving()
        policy = self.full_policy
        if policy is not None:
            missing = sorted(set(policy.sizes) - set(self.full.graphs))
            if missing:
                self.res.fallback(Fallback.UNCAPTURED_SIZE, f"FULL graphs for sizes {missing} were not captured "
                                  "before serving; their steps run in pieces")
                kept = tuple(s for s in policy.sizes if s in self.full.graphs)
                self.use_full_policy(dataclasses.replace(policy, sizes=kept) if kept else None)
