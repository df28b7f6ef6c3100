"""A graphed step's inputs in fixed buffers: captured graphs read fixed addresses, so
every step's token inputs are copied into one buffer each, padded with zero rows (token
0 at position 0, whose writes go to the pad slot), and its 0-dim device tensors into
fixed ones.

Python numbers are another matter. Dynamo passes them (under ``dynamic=True``) afresh
on every call: a float as a 0-dim host tensor, which a kernel takes by value when it is
launched or which the graph turns into a host number (``.item()``), an int as a
symbolic int. Either way a captured graph holds the value it saw at capture, whatever
the step passes. So the first call's values are pinned, every graph reads them (one
fixed tensor each, the ints as they are), and a step that passes another value cannot
run graphs (:meth:`StepInputs.changed_number`)."""
from __future__ import annotations

import torch

from .trim_op import pad_rows


class StepInputs:
    """The fixed buffers of one compiled model's step arguments. ``token_inputs``: the
    arguments whose first dimension is the token count; ``sym_inputs``: the token count
    itself; ``number_inputs``: the Python numbers Dynamo passes as fresh 0-dim tensors
    (compat.dynamo.number_inputs; None: not known from the trace); ``rows``: the most
    rows a graphed step pads to, each token buffer's length; ``int_inputs``: the Python
    ints of the call (symbolic ints other than the token count); ``names``: each input's
    name in the traced graph, for messages."""

    def __init__(self, token_inputs: list[int], sym_inputs: list[int],
                 number_inputs: tuple[int, ...] | None = None, rows: int = 0,
                 int_inputs: tuple[int, ...] = (), names: tuple[str, ...] = ()) -> None:
        self.token_inputs, self.sym_inputs, self.rows = token_inputs, sym_inputs, rows
        self.int_inputs, self.names = int_inputs, names
        self.buffers: dict[int, torch.Tensor] = {}
        self._written: dict[int, int] = {}  # per buffer: the rows past this one are zero
        # Never a model's own 0-dim buffer: a step that updates it in place (a step
        # counter) must update the buffer itself, not a copy.
        self.numbers = number_inputs
        self.scalar_inputs: tuple[int, ...] = ()  # 0-dim device tensors, copied per step
        self.scalars: dict[int, torch.Tensor] = {}
        self.pinned: dict[int, torch.Tensor | int] = {}  # the first call's numbers: a host tensor or an int
        self._pinned_values: tuple = ()

    def find_scalars(self, args) -> None:
        """The 0-dim arguments from the first call's: the trace's numbers (host values,
        pinned), or where the trace does not say, every 0-dim tensor but a parameter (on
        the host pinned, on a device copied per step)."""
        known = self.numbers
        zero_dim = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.dim() == 0
                    and (i in known if known is not None else not isinstance(a, torch.nn.Parameter))]
        self.pinned = {i: args[i].clone() for i in zero_dim if args[i].device.type == "cpu"}
        self.pinned.update({i: args[i] for i in self.int_inputs})
        self._pinned_values = tuple(_value(v) for v in self.pinned.values())
        self.scalar_inputs = tuple(i for i in zero_dim if i not in self.pinned)

    def check_rows(self, batch, args) -> None:
        """The token inputs hold the context's batch: attention and the trim op read
        that batch's rows, so inputs of another step would run against its layout."""
        if self.token_inputs and batch is not None:
            t = args[self.token_inputs[0]].shape[0]
            if t != batch.num_tokens:
                raise ValueError(f"dsv41_replay: the token inputs have {t} rows, the forward context's batch "
                                 f"{batch.num_tokens} tokens: call the model with that batch's input_ids and "
                                 "positions under its own context")

    def changed_number(self, args) -> str | None:
        """Where a host number of ``args`` differs from its pinned value, which every
        graph holds: the first such input and both values (None: all as pinned)."""
        if not self.pinned:
            return None
        values = tuple(_value(args[i]) for i in self.pinned)
        if values == self._pinned_values:
            return None
        k = next(k for k, (a, b) in enumerate(zip(values, self._pinned_values)) if a != b)
        i = list(self.pinned)[k]
        name = f" ({self.names[i]})" if i < len(self.names) else ""
        return f"input {i}{name}: {self._pinned_values[k]!r} -> {values[k]!r}"

    def _pin(self, new: list) -> None:
        for i, fixed in self.pinned.items():
            new[i] = fixed

    def padded(self, args, t: int, tp: int) -> list:
        """``args`` with the token inputs (``t`` rows) in their buffers of ``rows`` rows,
        padded to ``tp``, the 0-dim device tensors in fixed ones and the pinned numbers."""
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
        if self.pinned:
            self._pin(new)
        return new

    def eager_padded(self, args, tp: int, pin: bool) -> list:
        """``args`` with zero rows appended to the token inputs, up to ``tp`` rows: a step
        whose main layers run without graphs, padded to the data-parallel ranks' agreed
        size; ``pin``: with the pinned numbers (the step's own equal them)."""
        new = list(args)
        for i in self.token_inputs:
            if args[i].shape[0] != tp:
                new[i] = pad_rows(args[i], tp)
        for i in self.sym_inputs:
            new[i] = tp
        if pin and self.pinned:
            self._pin(new)
        return new


def _value(x):
    """A pinned number's value: a host tensor's item, an int as it is."""
    return x.item() if isinstance(x, torch.Tensor) else x
