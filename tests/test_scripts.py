"""The measuring scripts' own logic, on the CPU (their GPU runs are in docs)."""
from __future__ import annotations

import sys
from pathlib import Path

SCRIPTS = Path(__file__).parents[1] / "scripts"


class CountingPhases:
    """step_phases.Phases' timed variants, counting the steps each one runs."""

    def __init__(self) -> None:
        self.isl = self.conc = None
        self.steps: list[tuple] = []

    def full(self, tag: str) -> dict:
        self.steps.append(("full", self.isl, self.conc))
        return {"full": 0.002, "to_launch": 0.0}

    def prebuilt(self, tag: str, planned: bool) -> dict:
        self.steps.append(("prebuilt", self.isl, self.conc))
        return {"prebuilt": 0.002, "ret": 0.001}


def test_step_ab_profiles_one_step_per_floor(monkeypatch):
    """A floor is the kernel time of every step its callable runs: step_ab's callable
    runs exactly one step of its point, timed as the bench times it."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    monkeypatch.delitem(sys.modules, "step_ab", raising=False)
    import step_ab

    phases = CountingPhases()
    assert step_ab.floor_step(phases, 1024, 8) == 2.0
    assert phases.steps == [("full", 1024, 8)]
