"""Whether a backend state takes another graph from Dynamo, and, when it refuses one,
the likely reason, named for the user.

A backend serves one model traced once. During warm-up a further graph is either code
Dynamo reaches first after a graph break (not a recompile) or a recompile (counted);
once capture or serving began, it is an error.
"""
from __future__ import annotations

import logging

import torch

from .compat import dynamo as compat_dynamo
from .counters import counters
from .forward_context import has_forward_context
from .lifecycle import Phase

log = logging.getLogger("replay_backend")


def admit_graph(backend):
    """Count the graph Dynamo hands ``backend`` (a ``ReplayBackend``) and log what it is;
    raise where the backend no longer takes one. Returns the frame being compiled
    (``compat.dynamo.compiling_frame``: its code and whether Dynamo compiles that code a
    first time), or None where torch does not tell."""
    counters.graphs_seen += 1
    if backend.phase not in (Phase.TRACING, Phase.WARMING):
        counters.recompiles += 1
        # Refused before the step ran: data-parallel ranks are told, rather than left
        # waiting in the step's collectives for this one.
        backend.fail_step(RuntimeError(f"dsv41_replay: recompile after warm-up (while {backend.phase.value}): "
                                       f"{why_recompile(backend)}"))
    frame = compat_dynamo.compiling_frame()
    n = len(backend.compiled) + 1
    if backend.compiled and frame is not None and frame[1]:
        log.info("dsv41_replay: graph %d for this backend, of code after a graph break", n)
    elif backend.compiled:
        counters.recompiles += 1
        log.warning("dsv41_replay: graph %d for this backend (a recompile)", n)
    else:  # once per backend, not per graph
        log.info("dsv41_replay config: %s", backend.config.as_dict())
    return frame


def why_recompile(backend) -> str:
    """Dynamo traced the model of ``backend`` anew: the likely reason."""
    if not has_forward_context():
        return ("the compiled model was called outside replay_backend.set_forward_context(...): every step "
                "runs inside the forward context of its batch")
    first = backend.compiled[0] if backend.compiled else None
    if first is not None and torch.is_grad_enabled() != first.grad_enabled:
        return (f"the model was traced with grad mode {'on' if first.grad_enabled else 'off'} and is "
                "now called with it " + ("on" if torch.is_grad_enabled() else "off")
                + ": run every step under torch.no_grad() or torch.inference_mode()")
    frame = compat_dynamo.compiling_frame()
    # A first compile of code one of these graphs was traced from: Dynamo's caches were emptied.
    if frame is not None and frame[1] and frame[0] in backend.traced_code:
        return ("Dynamo compiled the model's code as if for the first time: torch._dynamo.reset() (or "
                "torch.compiler.reset()) discarded its compiled code. A backend serves one model traced once: "
                "after a reset, compile the model again with a new backend")
    if frame is not None and frame[1]:
        return ("Dynamo reached code it had not compiled before: another path after a graph break (a branch on "
                "a tensor's value, say; TORCH_LOGS=graph_breaks names it) or another function compiled with "
                "this backend. The model must trace once, one graph for every step")
    return ("one of Dynamo's guards failed (an input's dtype, device or rank, a model attribute, global "
            "state): the model must trace once, dynamic only in the token count; TORCH_LOGS=recompiles "
            "names the guard (docs/debugging.md)")
