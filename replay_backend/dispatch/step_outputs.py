"""A step's outputs as the model's caller gets them: cut to the step's real tokens."""
from __future__ import annotations

import torch


class StepOutputs:
    """What a compiled model returns of a step run padded. ``token_dims``: per output,
    the dimensions the token count sizes, as traced (None: the first of each tensor)."""

    def __init__(self, token_dims: tuple[tuple[int, ...], ...] | None) -> None:
        self.token_dims = token_dims

    def _dims(self, out) -> tuple:
        return self.token_dims or ((0,),) * len(out)

    def own(self, out, t: int, graphed: bool) -> tuple:
        """The token-indexed outputs cut to the ``t`` real tokens in every dimension the
        token count sizes, each a tensor of its own. Out of graphs, whose memory the next
        step overwrites, copies; never a view either, which another graph of the model
        (past a graph break) would be guarded on as a view, so that an eager step's and a
        graphed step's outputs would recompile it."""
        return tuple(_own(_cut(o, ds, t), graphed) if isinstance(o, torch.Tensor) else o
                     for o, ds in zip(out, self._dims(out)))

    def row_bytes(self, out) -> int:
        """Bytes per token of the token-indexed outputs: what a FULL graph keeps per row
        (capture/memory.py)."""
        return sum(o.nbytes // max(1, o.shape[ds[0]]) for o, ds in zip(out, self._dims(out))
                   if isinstance(o, torch.Tensor) and ds and ds[0] < o.dim())


def _cut(x: torch.Tensor, dims: tuple[int, ...], t: int) -> torch.Tensor:
    for d in dims:
        if d < x.dim() and x.shape[d] != t:  # d past the last: the untraced default on a 0-dim output
            x = x.narrow(d, 0, t)
    return x


def _own(x: torch.Tensor, copy: bool) -> torch.Tensor:
    return x.clone() if copy or x._base is not None else x
