"""The pytest plugin, run the way users run it: an installed ``pytest11``
entry point, exercised with pytest's own ``pytester`` on a user-style test file.
"""
from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest

from replay_backend.counters import Counters
from replay_backend.passes.split import PieceInfo
from replay_backend.plan import RunnerStats, SplitPlan
from replay_backend.testing import CounterWatch, assert_split_plan

pytest_plugins = ["pytester"]

DOCS = Path(__file__).resolve().parent.parent / "docs" / "testing.md"


def _doc_example() -> str:
    """The example test file of docs/testing.md (so the documented code is what runs)."""
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S)
    (example,) = [b for b in blocks if b.startswith("# test_graph_shape.py")]
    return example


# Appended to the example: a failing expectation, to see pytest show the diff. It checks
# a plan given as JSON (what `inspect --json` prints), so nothing compiles twice.
WRONG = textwrap.dedent('''

    def test_wrong_expectations_read_well(dsv41_assert_plan):
        dsv41_assert_plan(json.loads(PLAN_JSON), main={"graph": 22, "attention": 21, "replay": 1},
                          replay_layers=[21, 39], capture_sizes=[8, 16])
''')


@pytest.fixture
def one_thread(monkeypatch):
    # The tiny model runs faster on one thread, far faster when another process shares
    # the cores. pytester runs in a process of its own: in this one it would unload the
    # torch modules its run imported, whose operator registrations would then collide
    # with a later test's import of them.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def test_user_test_with_the_plugin(pytester, one_thread):
    plan_json = json.dumps(_plan().as_dict())
    pytester.makepyfile(test_user=f"import json\nPLAN_JSON = {plan_json!r}\n" + _doc_example() + WRONG)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([
        "dsv41-replay *: fixtures dsv41_backend, dsv41_counters, dsv41_plan, dsv41_assert_plan",
        "*AssertionError: split plan does not match (2 differences):",
        "*main pieces by kind: expected {'graph': 22, 'attention': 21, 'replay': 1}",
        "*got {'graph': 1, 'attention': 1, 'replay': 1}",
        "*(attention: expected 21, got 1; graph: expected 22, got 1)",
        "*replay_layers: expected [[]21, 39], got [[]1, 2]",
        "*the plan:",
        "*main graph: 3 pieces (1 graph, 1 attention, 1 replay)",
    ])


def test_plugin_is_an_entry_point_and_can_be_disabled(pytester):
    pytester.makepyfile(test_x="def test_x(dsv41_counters):\n    assert dsv41_counters.delta() == {}\n")
    pytester.runpytest_subprocess().assert_outcomes(passed=1)
    result = pytester.runpytest_subprocess("-p", "no:dsv41_replay")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*fixture 'dsv41_counters' not found*"])


# ---- the helpers on their own (no compile) --------------------------------------------
def _plan() -> SplitPlan:
    main = [PieceInfo("submod_0", "graph", [0], 10), PieceInfo("submod_1", "attention", [0], 1, "dsv41::swa"),
            PieceInfo("submod_2", "replay", [1, 2], 1, "dsv41_replay::trim_and_redispatch")]
    return SplitPlan(16, 48, [1, 2], [8, 16], [16], main, [PieceInfo("submod_0", "graph", [1, 2], 5)],
                     runners={"main": RunnerStats(1, [8, 16], 2, {16: 3, "eager": 1})})


def test_assert_split_plan_passes_and_returns_the_plan():
    plan = _plan()
    assert assert_split_plan(plan, main=["graph", "attention", "replay"], replay={"graph": 1},
                             replay_layers=(1, 2), capture_sizes=[8, 16], replay_capture_sizes=[16],
                             window=16, trim_threshold=48, replay_off=False, captured={"main": [16, 8]},
                             dispatch={"main": {16: 3, "eager": 1}}) is plan
    assert assert_split_plan(plan.as_dict(), replay_layers=[1, 2]).as_dict() == plan.as_dict()  # JSON


@pytest.mark.parametrize("kwargs, message", [
    (dict(main=["graph", "replay"]), "main pieces in order: expected 2 pieces, got 3; first difference "
                                     "at piece 1: expected replay, got attention"),
    (dict(replay_layers=None), "replay_layers: expected None, got [1, 2]"),
    (dict(replay_off=True), "replay_off: expected True, got False"),
    (dict(replay_off="no markers"), "replay_off: expected a reason containing 'no markers', got None"),
    (dict(captured={"replay": [16]}), "captured['replay']: expected [16], got None"),
    (dict(dispatch={"main": {16: 2}}), "dispatch['main']: expected {16: 2}, got {16: 3, 'eager': 1}"),
])
def test_assert_split_plan_messages(kwargs, message):
    with pytest.raises(AssertionError) as e:
        assert_split_plan(_plan(), **kwargs)
    assert message in str(e.value) and "the plan:\n  window W=16" in str(e.value)


def test_counter_watch_sees_deltas_without_resetting():
    c = Counters(trims=5)
    c.fallbacks["old"] += 1
    watch = CounterWatch(c)
    c.trims += 2
    c.fallbacks["x"] += 1
    assert watch.delta() == {"trims": 2, "fallbacks": {"x": 1}}
    assert c.trims == 7  # the shared counters were not reset
    watch.assert_delta(trims=2, fallbacks={"x": 1}, recompiles=0)
    with pytest.raises(AssertionError, match=r"trims: expected \+1, got \+2"):
        watch.assert_delta(trims=1)
    with pytest.raises(ValueError, match="unknown counter"):
        watch.assert_delta(nope=1)
    with watch.expect(strict=False, trims=1):
        c.trims += 1
    ran = []
    for wrong in ({"fallbacks": 1}, {"trims": "1"}):  # refused before the block runs
        with pytest.raises(ValueError, match=f"counters.expect\\({next(iter(wrong))}=...\\)"):
            with c.expect(strict=False, **wrong):
                ran.append(wrong)
    assert not ran
