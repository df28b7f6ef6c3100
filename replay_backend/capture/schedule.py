"""The capture schedule: which graphs a compiled model captures, in which order.

FULL graphs first, then the main pieces' graphs, then the replay region's, each
largest size first: graphs share one pool, and a graph's memory is reused by the
graphs captured after it (capture/graphs.py says when that is safe).
"""
from __future__ import annotations

import logging
import time

import torch

from ..compat import graphs as compat_graphs
from ..lifecycle import Phase

log = logging.getLogger("replay_backend")


def capture_all(model, run_main_step, replay_view_for, metadata=None, run_full_step=None) -> dict:
    """Capture every FULL size, then every main size, then every replay size, each
    largest first, while the backend's phase is capturing (``ReplayBackend.capture``
    moves it). ``run_full_step(n)``: one dummy step of ``n`` tokens laid out for
    FULL graphs (with a FULL policy set: ``use_full_policy``).

    ``run_main_step(n)`` runs one dummy step of ``n`` tokens through the compiled
    model (the runner knows how to build one); ``replay_view_for(n)`` builds a dummy
    replay batch view of ``n`` rows. ``metadata``: the MetadataBuffer served steps'
    batches will be built in, whose head the trim op's gather graphs read in place.
    Returns a per-runner summary.
    """
    life = model.res.lifecycle
    life.expect("capture", Phase.CAPTURING_MAIN)
    if metadata is not None and model.replay is not None:
        model.replay.use_metadata_buffer(metadata)
    summary = {}
    # Non-owning graph outputs need the capture order below (main, then replay) for
    # every graph in the pool: not when graphs were already captured lazily.
    fresh = not any(r.graphs for level in ("main", "replay") for r in model.runners(level))
    model.res.weak_outputs = model.res.use_cuda and fresh and compat_graphs.has_non_owning_alias()
    stages = [("main", model.main_level.sizes, run_main_step)]
    if model.full_policy is not None and run_full_step is not None:
        stages.insert(0, ("full", list(model.full_policy.sizes), run_full_step))
    if model.replay is not None and model.replay.level.sizes:
        stages.append(("replay", model.replay.level.sizes, model.replay.capture))
    try:
        for name, sizes, fn in stages:
            if name == "replay":
                life.advance(Phase.CAPTURING_REPLAY)
            free0 = _gpu_free()
            t0 = time.perf_counter()
            io_graphs = 0
            for n in _progress(sorted(sizes, reverse=True), name):
                if name == "replay":
                    io_graphs += fn(n, replay_view_for(n))
                else:
                    fn(n)
            secs = time.perf_counter() - t0
            gib = max(0.0, (free0 - _gpu_free()) / 2 ** 30)
            graphs = len(model.full.graphs) if name == "full" else sum(len(r.graphs) for r in model.runners(name))
            summary[name] = {"sizes": len(sizes), "graphs": graphs, "seconds": secs, "gib": gib}
            if name == "replay":
                summary[name]["trim_io_graphs"] = io_graphs
            log.info("captured %s graphs: %d sizes, %d graphs (+%d trim gather/scatter), %.2f s, %.3f GiB",
                     name, len(sizes), graphs, io_graphs, secs, gib)
    finally:
        model.res.weak_outputs = False
    model.capture_summary = summary
    for c in model.dispatch.values():
        c.clear()  # count served steps only, not the warm-up and capture steps
    from ..inspection import on_captured

    on_captured(model)
    return summary


def _gpu_free() -> int:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        return torch.cuda.mem_get_info()[0]
    return 0


def _progress(items, name):
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        return items
    return tqdm(items, desc=f"capture {name} graphs", unit="size", leave=False,
                disable=not torch.cuda.is_available())
