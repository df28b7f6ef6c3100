"""Capture and the graph memory estimate, driven for one backend state: the FULL
policy decided, the ranks' schedules compared, the dummy steps run, the lifecycle
advanced, and a capture that captured nothing counted with its reason."""
from __future__ import annotations

import logging

import torch

from ..dispatch.direct import run_dummy
from ..dispatch.full_policy import resolve_policy
from ..fallbacks import Fallback
from ..forward_context import has_forward_context, set_forward_context
from ..lifecycle import Phase
from ..dispatch.agree import meet_to_capture
from ..parallel import check_same_schedule
from .full import full_capture_step

log = logging.getLogger("replay_backend")


def capture(be, setup, replay_view_for=None, metadata=None) -> dict:
    """``ReplayBackend.capture`` (its docstring says what each form takes)."""
    be.lifecycle.expect("capture", Phase.WARMING)
    if not callable(setup):
        if replay_view_for is not None or metadata is not None:
            raise TypeError("capture(setup) takes the StepSetup alone")
        # The FULL sizes first: they are part of the schedule the ranks compare.
        setup, model, metadata, run_full = _prepared(be, setup, "capture")
        _check_same_schedule(be)
        with set_forward_context(setup.context(setup.dummy_batch(setup.window))):
            summary = _capture(be, lambda n: run_dummy(model, setup, n), setup.replay_view, metadata, run_full)
    else:
        if be.config.full_graphs:
            be.model.res.fallback(Fallback.CUDAGRAPH_MODE, f"cudagraph_mode={be.config.cudagraph_mode!r}: "
                                  "capture(run_step, replay_view_for) captures no FULL graph; pass the model's "
                                  "StepSetup to capture() for them")
            be.model.use_full_policy(None)
        _check_same_schedule(be)
        if replay_view_for is None:
            raise TypeError("capture(run_step, replay_view_for): the replay view builder is missing")
        if not has_forward_context():
            raise RuntimeError("dsv41_replay: capture() needs a forward context around it: the replay graphs "
                               "are captured outside any model step, so wrap the call in "
                               "set_forward_context(ForwardContext(dummy_step_batch(...), kv=your_cache)), or "
                               "pass a StepSetup and let the backend run its dummy steps")
        summary = _capture(be, setup, replay_view_for, metadata)
    graphs = sum(level.get("graphs", 0) for level in summary.values())
    if graphs == 0 and be.config.graphs_enabled:
        be.model.res.fallback(Fallback.NOTHING_CAPTURED, f"capture() captured no graph: {why_no_graphs(be)}")
    elif graphs == 0:
        log.info("dsv41_replay: capture() captured no graph: cudagraph_mode='none'")
    return summary


def estimate_graph_memory(be, setup):
    """``ReplayBackend.estimate_graph_memory``: the dummy steps of ``setup`` run in the
    measuring phase, as capture would run them."""
    be.lifecycle.expect("estimate_graph_memory", Phase.WARMING)
    setup, model, metadata, run_full = _prepared(be, setup, "estimate_graph_memory")
    with set_forward_context(setup.context(setup.dummy_batch(setup.window))), torch.no_grad():
        return model.estimate_graph_memory(lambda n: run_dummy(model, setup, n, use_graphs=False),
                                           setup.replay_view, run_full)


def _prepared(be, setup, what: str):
    """For the dummy steps of ``setup``: the setup taken, the compiled model, the
    metadata buffer, and capture's FULL step (its policy decided now; None: none)."""
    setup = be.use(setup)
    model = be.learned_model(what)
    metadata = be.metadata_buffer(setup)
    return setup, model, metadata, full_capture_step(model, setup, metadata,
                                                     resolve_policy(be.config, model, setup, metadata))


def _check_same_schedule(be) -> None:
    if be.dp_group is not None:  # first, in the shape of a step's agreement: a rank serving meanwhile meets it
        meet_to_capture(be.dp_group)
    for group in (be.dp_group, be.tp_group):
        if group is not None:
            check_same_schedule(be.model, group)


def _capture(be, run_step, replay_view_for, metadata, run_full=None) -> dict:
    life = be.lifecycle
    life.advance(Phase.CAPTURING_MAIN)
    try:
        # Graphs serve inference; the replay graphs run the region outside any model
        # step, where the caller's grad mode does not reach. no_grad, not
        # inference_mode: the static buffers made here are written in place by every
        # later step, whichever of the two that step runs under.
        with torch.no_grad():
            summary = be.model.capture(run_step, replay_view_for, metadata, run_full)
    except BaseException:
        life.advance(Phase.WARMING)
        raise
    life.advance(Phase.CAPTURED)
    return summary


def why_no_graphs(be) -> str:
    """Why a capture with graphs on captured none, for its fallback."""
    model, cfg = be.model, be.config
    if not model.token_inputs:
        return "the model step was traced without a dynamic token count"
    if not cfg.piecewise_graphs:  # FULL graphs alone; a policy with sizes captures them all
        mode = f"cudagraph_mode={cfg.cudagraph_mode!r} takes FULL graphs alone"
        if not cfg.full_capture_sizes(model.replay is not None):
            return (f"{mode}, which run only steps that never trim, and every capture size {cfg.capture_sizes()} "
                    f"is at or above decoder_replay_trim_threshold={cfg.decoder_replay_trim_threshold}: give "
                    "capture sizes below it")
        if not model.full_sizes:  # the build refused every graph size
            return f"{mode}, and no graph size was kept (the main_graphs_padding_unsafe fallback says why)"
        return f"{mode}, and none of its sizes was kept (the cudagraph_mode fallback says why)"
    if not model.main_level.sizes:
        return f"no main graph size (the plan: {model.plan.replay_off_reason or 'main graphs refused'})"
    return "every piece ran eagerly"
