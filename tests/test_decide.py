"""The step's one decision as a table: ``plan_step`` against the rules
written out here independently, for every token count and replay-row count of a small
configuration, and its special cases (no graphs, main capture, data-parallel ranks)."""
from __future__ import annotations

import itertools

import pytest

from replay_backend.dispatch.agree import Agreement
from replay_backend.dispatch.decide import Sizes, StepKind, TrimRecord, plan_step

MAIN = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
REPLAY = (16, 32, 48, 64)
THRESHOLD = 48
# The region's graphs: every replay size, and the main sizes below the threshold (where
# graphed steps run the region on every row inside their own size).
REGION = frozenset(REPLAY) | frozenset(s for s in MAIN if s < THRESHOLD)
IO = frozenset(itertools.product((48, 56, 64), REPLAY))
SIZES = Sizes(MAIN, REPLAY, REGION, THRESHOLD, IO, has_region=True)


def ceil(sizes, n):
    return min((s for s in sizes if s >= n), default=None)


def expected(t: int, rows: int, trimmable: bool):
    """(kind, padded, trim, replay padded, io graphs, record rows) by the dispatch rules."""
    tp = ceil(MAIN, t)
    if tp is not None:  # a graphed step trims from the threshold on, trimmable or not
        kind, padded, trim = "piecewise", tp, tp >= THRESHOLD
    else:  # a step above the largest size trims when a prefill is longer than W
        kind, padded, trim = "eager", t, trimmable
    if trim:
        rpad = ceil(REPLAY, rows)
    else:
        rpad = padded if kind == "piecewise" and padded in REGION else None
    io = kind == "piecewise" and trim and rpad is not None and (padded, rpad) in IO
    return kind, padded, trim, rpad, io, rows if trim else t


@pytest.mark.parametrize("t", [1, 2, 3, 15, 16, 17, 40, 47, 48, 49, 57, 64, 65, 70, 100, 200])
def test_every_step_shape_is_decided_as_the_rules_say(t):
    for rows in sorted({1, 2, min(t, 16), min(t, 17), min(t, 33), min(t, 65), t}):
        for trimmable in ((rows < t), False) if rows < t else (False,):
            p = plan_step(SIZES, t, rows, trimmable)
            got = (p.kind.value, p.padded_tokens, p.trim, p.replay_padded, p.io_graphs, p.record.rows)
            assert got == expected(t, rows, trimmable), (t, rows, trimmable)
            assert p.step == (p.kind.value, t, p.padded_tokens)
            assert p.record == TrimRecord(p.trim, got[-1], p.replay_padded, p.replay_padded is not None, p.io_graphs)


def test_steps_without_graphs_and_during_main_capture_run_the_region_directly():
    p = plan_step(SIZES, 40, 16, True, use_graphs=False)
    assert (p.kind, p.padded_tokens, p.trim, p.replay_padded) == (StepKind.EAGER, 40, True, None)
    p = plan_step(SIZES, 50, 16, True, region_graphs=False)  # the main graph at 56 is being captured
    assert (p.kind, p.padded_tokens, p.trim, p.replay_padded, p.io_graphs) == (StepKind.PIECEWISE, 56, True, None,
                                                                               False)


@pytest.mark.parametrize("t, rows, trimmable", [(20, 20, False), (50, 16, True), (3, 3, False), (1, 1, False)])
def test_data_parallel_ranks_take_the_largest_ranks_sizes(t, rows, trimmable):
    """Whatever this rank holds, the agreed step is the largest rank's: its main size,
    whether it trims, its replay size; this rank's own rows are its own."""
    for other_tokens, other_rows, other_trimmable in [(50, 40, True), (100, 30, True), (2, 2, False)]:
        agreement = Agreement(True, max(t, other_tokens), trimmable or other_trimmable, max(rows, other_rows))
        p = plan_step(SIZES, t, rows, trimmable, agreement=agreement)
        want = plan_step(SIZES, max(t, other_tokens), max(rows, other_rows), trimmable or other_trimmable)
        assert (p.kind, p.padded_tokens, p.trim, p.replay_padded, p.io_graphs) == \
               (want.kind, want.padded_tokens, want.trim, want.replay_padded, want.io_graphs)
        assert p.num_tokens == t and p.region_rows == (rows if p.trim else p.padded_tokens)
        assert p.region_padded >= p.region_rows  # the region pads to the largest rank's rows too


def test_one_rank_without_graphs_makes_every_rank_run_without():
    p = plan_step(SIZES, 20, 20, False, agreement=Agreement(False, 20, False, 20))
    assert (p.kind, p.padded_tokens, p.replay_padded) == (StepKind.EAGER, 20, None)
    p = plan_step(SIZES, 100, 30, True, agreement=Agreement(True, 130, True, 70))  # eager region, padded
    assert (p.kind, p.padded_tokens, p.trim, p.replay_padded, p.region_padded) == (StepKind.EAGER, 130, True,
                                                                                   None, 70)


def test_without_replay_graphs_or_a_region_graphed_steps_never_trim():
    no_replay = Sizes(MAIN, (), frozenset(s for s in MAIN), None, frozenset(), has_region=True)
    p = plan_step(no_replay, 50, 16, True)
    assert (p.kind, p.trim, p.replay_padded) == (StepKind.PIECEWISE, False, 56)
    assert plan_step(no_replay, 100, 16, True).trim  # an eager step still trims
    bare = Sizes(MAIN)
    p = plan_step(bare, 50, 16, True)
    assert (p.trim, p.record) == (False, None)
