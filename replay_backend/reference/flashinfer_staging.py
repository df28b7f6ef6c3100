"""How FlashInfer plans reach the GPU without the host waiting for it.

A plan is host memory that copies queued on the stream read later: the slot's arrays
(request pointers, page tables, row permutations) and each wrapper's work list
(flashinfer_compat.py). Writing a plan into memory whose previous copy is still queued
would hand the earlier step the later step's plan, and waiting for that copy would make
every plan a wait for the GPU. So a slot's plans take turns over ``turns`` sets of that
memory: a plan waits only for the copies of the plan ``turns`` plans before it, which a
host at most ``turns - 1`` steps ahead of the GPU never does.

Each planning call of a slot (``FlashInferAttention._plan``) takes one turn, whatever
parts it plans, and its event covers the call's arrays and its wrappers' work lists
alike: any earlier use of a turn's memory, by any wrapper of the slot, was queued
before the latest event of that turn.
"""
from __future__ import annotations

import torch

from . import flashinfer_compat

# Planning calls of one slot that may be queued at once: the one the GPU is about to
# run, and the next one, which the host makes while the GPU runs the first (the next
# step's, or this step's second where the whole batch's slot takes two).
TURNS = 2


class SlotStaging:
    """One slot's host memory for its arrays, per turn, and the event after each turn's
    copies. On the CPU (``cuda`` False) copies are done when queued: no pinning, no
    events."""

    def __init__(self, turns: int, cuda: bool) -> None:
        self.turns, self.cuda = turns, cuda
        self.next = 0
        self.host: list[torch.Tensor | None] = [None] * turns
        # an event never recorded is waited for at once
        self.done = [torch.cuda.Event() for _ in range(turns)] if cuda else []

    def begin(self) -> int:
        """The turn of the next plan, once its memory's previous copies have run."""
        turn = self.next
        self.next = (turn + 1) % self.turns
        if self.cuda:
            self.done[turn].synchronize()
        return turn

    def hold(self, turn: int, arrays: torch.Tensor) -> torch.Tensor:
        """``arrays`` in the turn's host memory (pinned on CUDA, so that their copies do
        not wait for the stream), grown by doubling."""
        if not self.cuda:
            return arrays
        buf, n = self.host[turn], arrays.numel()
        if buf is None or buf.numel() < n:
            # begin() waited for the copies queued from the buffer let go here
            size = max(n, 2 * buf.numel()) if buf is not None else n
            buf = self.host[turn] = torch.empty(size, dtype=arrays.dtype, pin_memory=True)
        return buf[:n].copy_(arrays)

    def end(self, turn: int) -> None:
        """Mark the turn's copies, all queued by now (also after a plan that failed part
        way: those queued before it read the turn's memory too)."""
        if self.cuda:
            self.done[turn].record()


class Wrapper:
    """A FlashInfer prefill wrapper, whether its plans may split their keys, the plan it holds
    now (``holds``), and one staging buffer per turn where there is more than one turn
    (the first its own, the others zeroed). A wrapper whose plans do not split starts
    with its own plan memory cleared too, as flashinfer_compat requires. Its calls go
    straight to its kernels once learned (flashinfer_compat.DirectCalls, which reports
    a plan that keeps ``run()`` through ``fallback(detail)``)."""

    def __init__(self, inner, split: bool, turns: int, pinned: bool, fallback) -> None:
        self.inner, self.split = inner, split
        self.holds = None
        self.calls = flashinfer_compat.DirectCalls(inner, fallback)
        if not split and not flashinfer_compat.clear_plan_memory(inner):
            flashinfer_compat.staging_buffer(inner)  # raises: the start-up probe's wrapper had it
        self.staging: list[torch.Tensor] = []
        if turns > 1:
            own = flashinfer_compat.staging_buffer(inner)
            self.staging = [own] + [torch.zeros(own.numel(), dtype=torch.uint8, pin_memory=pinned)
                                    for _ in range(turns - 1)]

    def plan(self, turn: int, split: bool, **kw) -> None:
        """Plan in the turn's staging buffer; ``split``: whether this plan may split its
        keys, never where the wrapper's plans must not (``self.split`` false)."""
        if self.staging:
            flashinfer_compat.stage_plans_in(self.inner, self.staging[turn])
        self.calls.planned()
        self.inner.plan(disable_split_kv=not (split and self.split), **kw)

    def run(self, q, kv, out, lse) -> None:
        self.calls(q, kv, out, lse)
