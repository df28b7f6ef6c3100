"""Fallbacks: where the backend runs something less than asked (eager instead of a graph,
a feature off), counted in ``counters.fallbacks`` by reason, logged once with the
reason, and an error with ``strict=True``.

:class:`Fallback` lists the core's reasons and what each means; a model may count
reasons of its own (the reference model's FlashInfer attention does).
"""
from __future__ import annotations

import enum
import logging

from .counters import counters

log = logging.getLogger("replay_backend")


class Fallback(str, enum.Enum):
    """The core's fallback reasons (the keys of ``counters.fallbacks``)."""

    def __str__(self) -> str:
        return self.value

    REPLAY_REGION_UNSUPPORTED = "replay_region_unsupported"  # the region stays in the main graph: no trimming
    MAIN_GRAPHS_PADDING_UNSAFE = "main_graphs_padding_unsafe"  # padding could change real rows: no main graphs
    UNCAPTURED_SIZE = "uncaptured_size"  # a served step's size has no graph: its pieces run eagerly (once a level)
    NOTHING_CAPTURED = "nothing_captured"  # capture() captured no graph although graphs are on
    DIRECT_DISPATCH = "direct_dispatch"  # calls go through Dynamo's entry, not straight to the graph
    METADATA_IN_PLACE = "metadata_in_place"  # served steps' metadata is built in fresh memory
    TRIM_INDEX_IN_PLACE = "trim_index_in_place"  # the trim op's index is copied per step
    TOKEN_GUARDS = "token_guards"  # the token count's guards could not be checked and relaxed
    PER_CALL_STATE = "per_call_state"  # the backend was called outside torch.compile's wrapper
    ROW_MOVES_KERNEL = "row_moves_kernel"  # the trim op's gathers run as torch ops, not the kernel
    TRITON_LAUNCH_LAYOUT = "triton_launch_layout"  # kernels launch through Triton's own path
    CUDAGRAPH_MODE = "cudagraph_mode"  # fewer FULL graphs than the mode asks: the attention cannot run in them
    NUMBER_CHANGED = "number_changed"  # a Python number differs from the one the graphs hold: no graphs
    PEER_FALLBACK = "peer_fallback"  # a data-parallel peer fell back to no graphs: so does every rank


class StrictFallbackError(RuntimeError):
    """A fallback happened while ``strict=True``."""


def process_fallback(reason: str, detail: str, strict: bool = False, logged: set | None = None) -> None:
    """A fallback: raise :class:`StrictFallbackError` when ``strict``, else count it and
    log it once, once per ``logged`` (the reasons one backend's resources have logged)
    or, for one decided once per process, when the process-wide count first reaches one."""
    reason = str(getattr(reason, "value", reason))  # the counters' key: the reason's name
    if strict:
        raise StrictFallbackError(f"{reason}: {detail} (strict=True turns fallbacks into errors)")
    counters.fallbacks[reason] += 1
    if logged is None:
        first = counters.fallbacks[reason] == 1
    else:
        first = reason not in logged
        logged.add(reason)
    if first:
        log.warning("dsv41_replay fallback [%s]: %s", reason, detail)
