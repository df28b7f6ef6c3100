"""Assertion helpers for users' graph-shape tests. No pytest import here: the
pytest plugin (``replay_backend.pytest_plugin``) exposes these through fixtures, and
any test framework can call them directly.

    from .testing import assert_split_plan
    assert_split_plan(backend, main={"graph": 22, "attention": 21, "replay": 1},
                      replay_layers=[21, 39], capture_sizes=[...])
"""
from __future__ import annotations

from typing import Any

from .plan import SplitPlan, plan_of

_UNSET: Any = object()  # "do not check" (None is a meaningful expectation: replay off)


def _kinds(pieces) -> list[str]:
    return [p.kind for p in pieces]


def _compare_pieces(what: str, pieces, by_kind: dict, want) -> str | None:
    if isinstance(want, dict):
        got = by_kind
        if got == want:
            return None
        diff = "; ".join(f"{k}: expected {want.get(k, 0)}, got {got.get(k, 0)}"
                         for k in sorted(set(want) | set(got)) if want.get(k, 0) != got.get(k, 0))
        return f"{what} by kind: expected {want}\n{' ' * (len(what) + 17)}got {got}\n    ({diff})"
    got_list, want_list = _kinds(pieces), list(want)
    if got_list == want_list:
        return None
    at = next((i for i, (a, b) in enumerate(zip(got_list, want_list)) if a != b), min(len(got_list), len(want_list)))
    return (f"{what} in order: expected {len(want_list)} pieces, got {len(got_list)}; first difference at "
            f"piece {at}: expected {want_list[at] if at < len(want_list) else '(none)'}, got "
            f"{got_list[at] if at < len(got_list) else '(none)'}")


def assert_split_plan(obj, *, main=_UNSET, replay=_UNSET, replay_layers=_UNSET, capture_sizes=_UNSET,
                      replay_capture_sizes=_UNSET, window=_UNSET, trim_threshold=_UNSET,
                      replay_off=_UNSET, captured=_UNSET, dispatch=_UNSET) -> SplitPlan:
    """Check the split plan of ``obj`` (anything ``plan_of`` accepts, or a plan / its JSON
    dict); only the expectations given are checked. Every mismatch is reported at once,
    followed by the rendered plan. Returns the plan.

    main / replay: pieces by kind (``{"graph": 5, "attention": 4, "replay": 1}``) or the
        exact sequence of kinds (``["graph", "attention", ...]``).
    replay_layers: ``[first, last]``, or None when the replay region is off.
    capture_sizes / replay_capture_sizes: the configured schedules.
    replay_off: False (region in use), True (off for any reason) or a substring of the reason.
    captured: ``{"main": [sizes], "replay": [sizes]}`` graphs captured per runner.
    dispatch: ``{"main": {64: 2, "eager": 1}}`` steps per size since capture.
    """
    plan = SplitPlan.from_dict(obj) if isinstance(obj, dict) else plan_of(obj)
    problems: list[str] = []

    def check(name: str, got, want) -> None:
        if want is not _UNSET and got != want:
            problems.append(f"{name}: expected {want!r}, got {got!r}")

    if main is not _UNSET:
        p = _compare_pieces("main pieces", plan.main_pieces, plan.pieces_by_kind("main"), main)
        problems += [p] if p else []
    if replay is not _UNSET:
        p = _compare_pieces("replay pieces", plan.replay_pieces, plan.pieces_by_kind("replay"), replay)
        problems += [p] if p else []
    check("replay_layers", plan.replay_layers, _as_list(replay_layers))
    check("capture_sizes", plan.capture_sizes, _as_list(capture_sizes))
    check("replay_capture_sizes", plan.replay_capture_sizes, _as_list(replay_capture_sizes))
    check("window", plan.window, window)
    check("trim_threshold", plan.trim_threshold, trim_threshold)
    if replay_off is not _UNSET:
        reason = plan.replay_off_reason
        if isinstance(replay_off, str):
            if reason is None or replay_off not in reason:
                problems.append(f"replay_off: expected a reason containing {replay_off!r}, got {reason!r}")
        elif bool(replay_off) != (reason is not None):
            problems.append(f"replay_off: expected {bool(replay_off)}, got {reason is not None}"
                            + (f" (reason: {reason})" if reason else ""))
    for runner, want in (captured.items() if captured is not _UNSET else ()):
        got = plan.runners[runner].captured_sizes if runner in plan.runners else None
        check(f"captured[{runner!r}]", got, sorted(want))
    for runner, want in (dispatch.items() if dispatch is not _UNSET else ()):
        got = dict(plan.runners[runner].dispatch) if runner in plan.runners else None
        check(f"dispatch[{runner!r}]", got, dict(want))
    if problems:
        raise AssertionError(f"split plan does not match ({len(problems)} difference"
                             f"{'s' if len(problems) > 1 else ''}):\n  " + "\n  ".join(problems)
                             + "\nthe plan:\n  " + plan.render().replace("\n", "\n  "))
    return plan


def _as_list(v):
    return v if v is _UNSET or v is None else list(v)


class CounterWatch:
    """The package counters seen from one test: deltas since the watch started, without
    resetting the process-wide counters (other tests and runners share them)."""

    def __init__(self, counters) -> None:
        self.counters = counters
        self.start = counters.state()

    def expect(self, strict: bool = True, **deltas):
        """``counters.expect``: exact deltas inside a ``with`` block."""
        return self.counters.expect(strict=strict, **deltas)

    def delta(self) -> dict:
        """What moved since the watch started (only the counters that moved)."""
        return self.counters.moved_since(self.start)

    def assert_delta(self, **want) -> None:
        """The named counters moved by exactly these amounts since the watch started."""
        unknown = set(want) - set(self.start)
        if unknown:
            raise ValueError(f"unknown counter(s) {sorted(unknown)}; known: {sorted(self.start)}")
        got = self.delta()
        problems = []
        for name, v in want.items():
            moved = got.get(name, {} if isinstance(v, dict) else 0)
            expected = {a: b for a, b in v.items() if b} if isinstance(v, dict) else v
            if moved != expected:
                problems.append(f"{name}: expected +{expected!r}, got +{moved!r}")
        if problems:
            raise AssertionError("counters moved differently:\n  " + "\n  ".join(problems)
                                 + f"\nall moves since the start: {got}")
