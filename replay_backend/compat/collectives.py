"""Functional collectives (private torch): collectives that Dynamo traces as graph ops
and Inductor lowers, so they run inside captured pieces.

``torch.distributed._functional_collectives`` is not public API, and its names move:
torch 2.13 renamed the single-tensor gather and reduce-scatter ``*_single``, warning on
every eager call of the old names. Each name is looked up once, the new before the old,
and a torch that has neither is told at import, not in a step.
"""
from __future__ import annotations

import torch


def _pick(module, *names: str):
    for name in names:
        fn = getattr(module, name, None)
        if fn is not None:
            return fn
    raise ImportError(f"dsv41_replay needs torch's functional collective {names[0]} (or {', '.join(names[1:])}): "
                      f"torch {torch.__version__} has none of them")


def _load():
    import torch.distributed._functional_collectives as funcol

    return (_pick(funcol, "all_reduce"), _pick(funcol, "all_gather_single", "all_gather_tensor"),
            _pick(funcol, "reduce_scatter_single", "reduce_scatter_tensor"))


_all_reduce, _all_gather, _reduce_scatter = _load()


def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    """The sum of ``x`` over ``group``."""
    return _all_reduce(x, "sum", group)


def all_gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's ``x`` stacked along dimension 0, in rank order."""
    return _all_gather(x, 0, group)


def reduce_scatter_rows(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` summed over ``group`` and split along dimension 0: this rank's share."""
    return _reduce_scatter(x, "sum", 0, group)
