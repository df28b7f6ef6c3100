"""Where one backend state (one ``torch.compile`` call) is in its life: one explicit phase.

Every object that behaves differently by phase reads it here: a piece captures its
size lazily only before serving, the trim op runs the region without graphs while the
main graphs are captured, a piece records its kept outputs' bytes while the memory
estimate measures. Each transition is checked, so an out-of-order call is a clear
error naming the phase instead of a silently wrong state.
"""
from __future__ import annotations

import enum
import logging

log = logging.getLogger("replay_backend")


class Phase(enum.Enum):
    TRACING = "tracing"  # no graph compiled yet
    WARMING = "warming"  # compiled; warm-up steps may run, recompiles are counted
    MEASURING = "measuring"  # the graph memory estimate runs steps without graphs
    CAPTURING_MAIN = "capturing main graphs"  # the region runs without graphs meanwhile
    CAPTURING_REPLAY = "capturing replay graphs"
    CAPTURED = "captured"  # capture() is done; start_serving() comes next
    SERVING = "serving"  # no new graph and no capture from now on


# Each phase's possible next ones.
_NEXT = {
    Phase.TRACING: {Phase.WARMING},
    Phase.WARMING: {Phase.WARMING, Phase.MEASURING, Phase.CAPTURING_MAIN, Phase.SERVING},
    Phase.MEASURING: {Phase.WARMING},
    Phase.CAPTURING_MAIN: {Phase.CAPTURING_REPLAY, Phase.CAPTURED, Phase.SERVING, Phase.WARMING},
    Phase.CAPTURING_REPLAY: {Phase.CAPTURED, Phase.SERVING, Phase.WARMING},
    Phase.CAPTURED: {Phase.SERVING},
    Phase.SERVING: set(),
}
# What an out-of-order call should have done first.
_HINT = {Phase.TRACING: "run one step through the compiled model first", Phase.SERVING: "serving has started"}


class Lifecycle:
    """The phase of one backend state, shared by everything compiled for it."""

    def __init__(self) -> None:
        self.phase = Phase.TRACING
        self._noted = False
        # The plan of the last step any graph of this state ran (a recompile's graph or
        # the first one's): what ``last_step`` reports.
        self.last_plan = None

    def phase_note(self, message: str) -> None:
        """Log ``message`` once: a step ran in a phase that is likely a missed call."""
        if not self._noted:
            self._noted = True
            log.warning("dsv41_replay: %s", message)

    def expect(self, what: str, *phases: Phase) -> None:
        """Raise unless the phase is one of ``phases`` (``what`` names the call)."""
        if self.phase not in phases:
            hint = _HINT.get(self.phase)
            raise RuntimeError(f"dsv41_replay: {what}() while {self.phase.value}" + (f": {hint}" if hint else "")
                               + f" (allowed while {' or '.join(p.value for p in phases)})")

    def advance(self, to: Phase) -> None:
        if to not in _NEXT[self.phase]:
            raise RuntimeError(f"dsv41_replay: cannot go from {self.phase.value} to {to.value}")
        self.phase = to

    @property
    def may_capture(self) -> bool:
        """Graphs may still be captured (lazily in warm-up steps, or by capture())."""
        return self.phase is not Phase.SERVING

    @property
    def capturing_main(self) -> bool:
        return self.phase is Phase.CAPTURING_MAIN

    @property
    def measuring(self) -> bool:
        return self.phase is Phase.MEASURING

    @property
    def serving(self) -> bool:
        return self.phase is Phase.SERVING
