"""A graphed step's inputs in fixed buffers: captured graphs read fixed addresses, so
every step's token inputs are copied into one buffer each, padded with zero rows (token
0 at position 0, whose writes go to the pad slot), and its 0-dim tensor arguments into
fixed scalars."""
from __future__ import annotations

import torch

from .trim_op import pad_rows


class StepInputs:
    """The fixed buffers of one compiled model's step arguments. ``token_inputs``: the
    arguments whose first dimension is the token count; ``sym_inputs``: the token count
    itself; ``number_inputs``: the Python numbers Dynamo passes as fresh 0-dim tensors
    (compat.dynamo.number_inputs; None: not known from the trace); ``rows``: the most
    rows a graphed step pads to, each token buffer's length."""

    def __init__(self, token_inputs: list[int], sym_inputs: list[int],
                 number_inputs: tuple[int, ...] | None = None, rows: int = 0) -> None:
        self.token_inputs, self.sym_inputs, self.rows = token_inputs, sym_inputs, rows
        self.buffers: dict[int, torch.Tensor] = {}
        self._written: dict[int, int] = {}  # per buffer: the rows past this one are zero
        # Python numbers as fresh 0-dim tensors on every call, copied into fixed ones per
        # graphed step. Never a model's own 0-dim buffer: a step that updates it in place
        # (a step counter) must update the buffer itself, not a copy.
        self.numbers = number_inputs
        self.scalar_inputs: tuple[int, ...] = ()
        self.scalars: dict[int, torch.Tensor] = {}

    def find_scalars(self, args) -> None:
        """The 0-dim tensor arguments copied per step, from the first call's: the trace's
        numbers, or where the trace does not say, every 0-dim tensor but a parameter."""
        known = self.numbers
        self.scalar_inputs = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.dim() == 0
                                   and (i in known if known is not None else not isinstance(a, torch.nn.Parameter)))

    def padded(self, args, t: int, tp: int) -> list:
        """``args`` with the token inputs (``t`` rows) in their buffers of ``rows`` rows,
        padded to ``tp``, and the fixed scalars."""
        new = list(args)
        for i in self.token_inputs:
            x = args[i]
            if x.shape[0] != t:
                raise ValueError(f"input {i} has {x.shape[0]} rows, expected the token count {t}")
            buf = self.buffers.get(i)
            if buf is None:
                buf = self.buffers[i] = torch.zeros((self.rows, *x.shape[1:]), dtype=x.dtype, device=x.device)
                self._written[i] = 0
            buf[:t].copy_(x)
            # Rows from ``_written`` on are zero already, so only rows that an earlier,
            # longer step wrote are cleared: none in a run of equal steps.
            written = self._written[i]
            if written > t:
                buf[t:min(tp, written)].zero_()
            self._written[i] = written if written > tp else t
            new[i] = buf[:tp]
        for i in self.sym_inputs:
            new[i] = tp
        for i in self.scalar_inputs:
            fixed = self.scalars.get(i)
            if fixed is None:
                fixed = self.scalars[i] = args[i].clone()
            else:
                fixed.copy_(args[i])
            new[i] = fixed
        return new

    def eager_padded(self, args, tp: int) -> list:
        """``args`` with zero rows appended to the token inputs, up to ``tp`` rows: a step
        without graphs padded to the data-parallel ranks' agreed size."""
        new = list(args)
        for i in self.token_inputs:
            new[i] = pad_rows(args[i], tp)
        for i in self.sym_inputs:
            new[i] = tp
        return new
