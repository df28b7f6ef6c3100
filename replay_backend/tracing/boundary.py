"""The decoder-replay boundary markers: a small API any model can use.

A model marks its replay region with two calls::

    hidden, residual, positions = replay_begin(hidden, residual, positions, window=W)
    ... replay layers: row-local work and attention ops only ...
    (out,) = replay_end(out)

Every tensor passed to ``replay_begin`` has the token count as its first dimension,
and the region may read nothing else that is row-indexed (weights are fine). The
region's results leave through ``replay_end``, again one row per token.

The markers are custom ops (``replay_backend/ops.py``) so that Dynamo keeps them in
the traced graph, where the backend's pass finds the region and replaces it with the
trim-and-redispatch op. In an uncompiled run they point attention at the replay
layers' view of the batch (``AttnView.replay``: the floor applies); with
``ForwardContext(eager_replay="parent")`` the replay layers run on the replay rows.
"""
from __future__ import annotations

import torch

from ..kv_cache import MAX_MODEL_LEN
from .. import ops  # noqa: F401  (defines the markers' ops)


def replay_begin(*tensors: torch.Tensor, window: int) -> tuple[torch.Tensor, ...]:
    """Mark the entry of the replay region; returns the region's row-indexed inputs.

    ``window`` is the model's sliding window W, an int in ``[1, MAX_MODEL_LEN]``: the
    backend needs it for the replay capture sizes and to validate the trim threshold.
    It is checked here, so that a bad one names itself instead of surfacing as an
    empty replay batch while graphs are captured.
    """
    if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= MAX_MODEL_LEN:
        raise ValueError(f"replay_begin: window must be the model's sliding window, an int in [1, {MAX_MODEL_LEN}] "
                         f"(MAX_MODEL_LEN), got {type(window).__name__} {window!r}")
    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise ValueError(f"replay_begin: needs the region's row-indexed tensors, got "
                         f"{[type(t).__name__ for t in tensors]}")
    return tuple(torch.ops.dsv41_replay.replay_begin(list(tensors), window))


def replay_end(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Mark the exit of the replay region; returns its row-indexed outputs."""
    return tuple(torch.ops.dsv41_replay.replay_end(list(tensors)))
