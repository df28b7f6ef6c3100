"""Functional collectives (private torch): collectives that Dynamo traces as graph ops
and Inductor lowers, so they run inside captured pieces.

``torch.distributed._functional_collectives`` is not public API, and its names move:
torch 2.13 renamed the single-tensor gather and reduce-scatter ``*_single``, warning on
every eager call of the old names. Each name is looked up once, at import, the new
before the old; a torch that has neither is told so by name.

Called eagerly (an eager step, or inside a custom op's implementation, which Inductor's
pieces call eagerly) a functional collective returns an ``AsyncCollectiveTensor``: a
wrapper with no storage of its own that waits when a torch op first reads it. A kernel
handed its pointer directly (a Triton kernel, one of Inductor's generated kernels) reads
address 0 instead. So every collective here is waited for before it is returned; traced,
the collectives return plain tensors already (their waits are in the graph).
"""
from __future__ import annotations

import torch


def _pick(module, *names: str):
    for name in names:
        fn = getattr(module, name, None)
        if fn is not None:
            return fn
    raise ImportError(f"dsv41_replay needs torch's functional collective {' or '.join(names)}: torch "
                      f"{torch.__version__} has none")


def _load() -> tuple:
    """The three collectives and the eager result's wrapper type, looked up at import
    (names fixed from then on, which Dynamo reads as constants); a torch without
    ``torch.distributed`` gets functions that say so when called, so a model that runs
    none imports as before."""
    if not torch.distributed.is_available():
        def missing(*args, **kwargs):
            raise RuntimeError(f"dsv41_replay: torch {torch.__version__} was built without torch.distributed, "
                               "which tensor and data parallelism need")
        return missing, missing, missing, ()
    import torch.distributed._functional_collectives as funcol

    return (_pick(funcol, "all_reduce"), _pick(funcol, "all_gather_single", "all_gather_tensor"),
            _pick(funcol, "reduce_scatter_single", "reduce_scatter_tensor"), _pick(funcol, "AsyncCollectiveTensor"))


_ALL_REDUCE, _ALL_GATHER, _REDUCE_SCATTER, _ASYNC = _load()


def _ready(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a tensor with its own storage (module docstring)."""
    return t.wait() if isinstance(t, _ASYNC) else t


def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    """The sum of ``x`` over ``group``."""
    return _ready(_ALL_REDUCE(x, "sum", group))


def all_gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's ``x`` stacked along dimension 0, in rank order."""
    return _ready(_ALL_GATHER(x, 0, group))


def reduce_scatter_rows(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` summed over ``group`` and split along dimension 0: this rank's share."""
    return _ready(_REDUCE_SCATTER(x, "sum", 0, group))
