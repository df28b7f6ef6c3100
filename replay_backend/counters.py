"""Counters of what the backend did, for tests and debugging.

``counters.expect(trims=1, captures={"replay": 2})`` is a context manager that checks
the counters moved by exactly those deltas inside its block (keys not named must not
move unless ``strict=False``).
"""
from __future__ import annotations

import contextlib
import copy
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator


@dataclass
class Counters:
    graphs_seen: int = 0  # FX graphs handed to the backend
    compilations: int = 0  # pieces compiled (Inductor)
    piece_cache_hits: int = 0  # pieces that reused an identical piece's compiled code
    recompiles: int = 0  # graphs after the first one of a backend instance
    pieces: Counter = field(default_factory=Counter)  # by kind: graph / attention / replay
    captures: Counter = field(default_factory=Counter)  # by runner: main / replay
    trims: int = 0  # steps whose trim op ran the replay region on the replay rows
    untrimmed: int = 0  # steps whose trim op ran the region on the whole batch
    replay_dispatch: Counter = field(default_factory=Counter)  # by padded size ("eager" above)
    # Graphed trimming steps whose replay rows were copied to the gather graphs' index:
    # their batch was not built in its backend's metadata buffer (dispatch/trim_io.py).
    trim_index_copies: int = 0
    fallbacks: Counter = field(default_factory=Counter)  # by reason

    def reset(self) -> None:
        self.__init__()

    def snapshot(self) -> dict:
        return {k: (dict(v) if isinstance(v, Counter) else v) for k, v in vars(self).items()}

    def state(self) -> dict:
        """A deep copy of every counter, to diff against later with :meth:`moved_since`."""
        return copy.deepcopy(vars(self))

    def moved_since(self, before: dict) -> dict:
        """The counters that moved since ``before`` (a :meth:`state`), by how much."""
        out = {}
        for name, now in vars(self).items():
            was = before[name]
            if isinstance(now, Counter):
                moved = {k: v for k, v in (now - was).items() if v}
                if moved:
                    out[name] = moved
            elif now != was:
                out[name] = now - was
        return out

    @contextlib.contextmanager
    def expect(self, strict: bool = True, **deltas) -> Iterator[None]:
        unknown = set(deltas) - set(vars(self))
        if unknown:
            raise ValueError(f"unknown counter(s) {sorted(unknown)}; known: {sorted(vars(self))}")
        for name, want in deltas.items():  # before the block runs: a typo costs no run
            keyed = isinstance(getattr(self, name), Counter)
            if keyed and not isinstance(want, dict) or not keyed and (isinstance(want, bool) or
                                                                       not isinstance(want, int)):
                raise ValueError(f"counters.expect({name}=...): {name} counts per key, so give a dict of key -> "
                                 f"count; got {want!r}" if keyed else
                                 f"counters.expect({name}=...): an integer, got {want!r}")
        before = self.state()
        yield
        moved = self.moved_since(before)
        problems = []
        for name, now in vars(self).items():
            got = moved.get(name, {} if isinstance(now, Counter) else 0)
            want = deltas.get(name, {} if isinstance(now, Counter) else 0)
            if isinstance(now, Counter):
                want = {k: v for k, v in dict(want).items() if v}
            if (name in deltas or strict) and got != want:
                problems.append(f"{name}: expected +{want}, got +{got}")
        if problems:
            raise AssertionError("counter mismatch: " + "; ".join(problems))


counters = Counters()
