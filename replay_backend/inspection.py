"""Looking inside a compiled model: dumps, TORCH_TRACE artifacts, graph-code logs, depyf.

The backend calls three hooks: ``on_traced`` (before the region pass edits the traced
graph in place), ``on_built`` (after the split and compile) and ``on_captured`` (after
``capture()``). Each does nothing costly unless a dump path is set, TORCH_TRACE is on,
the ``graph_code`` log artifact is enabled, or depyf is dumping.
"""
from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Iterator

from torch import fx

from . import dump
from .compat import dumps as compat_dumps
from .compat import dynamo as compat_dynamo

log = logging.getLogger("replay_backend")


@dataclass
class GraphSources:
    """The graphs as they were before the backend rewrote them, for dumps."""

    before_split: str | None  # readable code; None when nothing asked for it at compile time
    replay_region: fx.GraphModule | None  # the region as cut out (its split is ReplayRuntime.region)


def _log_code(name: str, gm: fx.GraphModule) -> bool:
    """Graph-code logging (and depyf's hook on it). A failure there must not fail the
    compile: log it and tell the caller to stop trying for this graph."""
    try:
        compat_dumps.log_graph_code(name, gm)
        return True
    except Exception as e:  # a foreign hook (depyf) choked on our graph
        log.warning("dsv41_replay: graph-code logging / depyf failed on %s (%s: %s); the rest of this "
                    "graph's pieces are not logged. debug_dump_path writes the same code.",
                    name, type(e).__name__, e)
        return False


def on_traced(gm: fx.GraphModule, cfg) -> str | None:
    """Emit the graph as Dynamo traced it; returns its readable code when a dump or the
    trace will want it later."""
    compat_dumps.adapt_depyf()  # a user's depyf.prepare_debug may be active around this compile
    text = None
    if cfg.debug_dump_path or compat_dumps.trace_enabled():
        text = dump.readable(gm)
        compat_dumps.trace_structured("dsv41_replay_graph_before_split", lambda: text)
    _log_code("dsv41_replay_graph_before_split", gm)
    return text


def dump_dir_for(path: str, graph_index: int) -> str:
    """The first graph of a backend dumps into ``path``; a recompile into ``path/graph_N``."""
    return path if graph_index == 0 else os.path.join(path, f"graph_{graph_index}")


def on_built(compiled) -> None:
    """Emit every artifact of a freshly built model; write its dump when asked to."""
    arts = [a for a in dump.artifacts(compiled) if a.rel != "graph_before_split.py"]  # on_traced did it
    if compat_dumps.trace_enabled():
        for a in arts:
            if a.traced:
                compat_dumps.trace_structured(a.trace_name, lambda a=a: a.text, a.encoding)
    logging_ok = True
    for a in arts:
        if a.gm is not None and logging_ok:
            logging_ok = _log_code(a.trace_name, a.gm)
    if compiled.dump_dir:
        path = compiled.dump_dir
        try:
            dump.dump_compiled(compiled, path)
        except OSError as e:  # a debugging aid must not fail the compile
            log.warning("dsv41_replay: could not write the dump to %s (%s)", path, e)
        else:
            log.info("dsv41_replay: graphs dumped to %s (start at index.md)", path)


def on_captured(compiled) -> None:
    """After ``capture()``: the capture summary into the trace and the dump."""
    if compat_dumps.trace_enabled():
        art = dump.capture_artifact(compiled)
        compat_dumps.trace_structured(art.trace_name, lambda: art.text, art.encoding)
    if compiled.dump_dir:
        try:
            dump.dump_capture(compiled, compiled.dump_dir)
        except OSError as e:
            log.warning("dsv41_replay: could not write capture.json to %s (%s)", compiled.dump_dir, e)


_NO_DEPYF = ("dsv41_replay: depyf is not installed, so nothing is dumped to %s (pip install "
             "'dsv41-replay[inspect]'). The backend's own dump holds the same graphs: set the option "
             "debug_dump_path or the env var DSV41_REPLAY_DUMP.")


@contextlib.contextmanager
def depyf_debug(dump_src_dir: str, **kwargs) -> Iterator[bool]:
    """``depyf.prepare_debug(dump_src_dir)`` made to work on torch 2.11-2.14, or a clear
    fallback. Wrap the code that compiles and runs the model; yields whether depyf is
    dumping. Our pieces appear in depyf's directory as ``__compiled_fn_N.dsv41_replay_*``.
    """
    try:
        import depyf
    except ImportError:
        log.warning(_NO_DEPYF, dump_src_dir)
        yield False
        return
    cm = depyf.prepare_debug(dump_src_dir, **kwargs)
    try:
        cm.__enter__()
    except Exception as e:
        log.warning("dsv41_replay: depyf.prepare_debug failed on torch %s (%s: %s); running without "
                    "depyf. debug_dump_path writes the backend's graphs instead.",
                    compat_dynamo.torch_version(), type(e).__name__, e)
        yield False
        return
    compat_dumps.adapt_depyf()
    try:
        yield True
    except BaseException as e:
        if not cm.__exit__(type(e), e, e.__traceback__):
            raise
    else:
        try:
            cm.__exit__(None, None, None)
        except Exception as e:  # depyf's own post-processing: the user's run already succeeded
            log.warning("dsv41_replay: depyf could not finish its dump in %s (%s: %s)",
                        dump_src_dir, type(e).__name__, e)
