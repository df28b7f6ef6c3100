"""The eager ``off`` (oracle) and ``parent`` (trimmed) modes agree.

``off`` runs the replay layers on the whole batch with the floor applied; ``parent``
runs them on the replay rows only. Trimming is a dead-row elimination, so each
request's last-row logits and the SWA KV the replay layers wrote for kept rows must
agree up to float reassociation.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from replay_backend.batch import RequestChunk, kept_len
from replay_backend.reference.compare import max_abs_err, max_abs_err_kv, replay_kv_slots
from replay_backend.reference import attention_reference
from replay_backend.reference.prompts import schedule_prefill
from replay_backend.reference.runner import StepRunner

from conftest import MAX_MODEL_LEN, MAX_NUM_SEQS

R = RequestChunk
ATOL = 1e-5


def _trimmed_ranges(runner: StepRunner, reqs):
    """(block base, first, end) of the rows each request of a step did NOT keep."""
    W = runner.cfg.window
    out = []
    for r in reqs:
        k = kept_len(r, W)
        if k < r.query_len:
            base = runner.layout.base(runner.block_of(r.req_id))
            out.append((r.req_id, base + r.context_len, base + r.seq_len - k))
    return out


def assert_really_trimmed(off: StepRunner, par: StepRunner, reqs) -> int:
    """Parent must not have written the replay layers' SWA KV of trimmed rows; off must."""
    ranges = _trimmed_ranges(par, reqs)
    off_ranges = _trimmed_ranges(off, reqs)
    for (rid, a, b), (_, oa, ob) in zip(ranges, off_ranges):
        assert b > a
        for layer in par.cfg.replay_layers:
            assert (par.kv.swa[layer][a:b] == 0).all(), f"parent wrote trimmed rows of {rid} in layer {layer}"
            assert (off.kv.swa[layer][oa:ob] != 0).any(-1).all(), f"off skipped rows of {rid} in layer {layer}"
        # the layers before the cut always run on the whole batch
        assert (par.kv.swa[par.cfg.cut][a:b] != 0).any(-1).all()
    return len(ranges)


def compare_step(off: StepRunner, par: StepRunner, reqs, atol=ATOL):
    o = off.step(reqs, eager_replay="off")
    p = par.step(reqs, eager_replay="parent")
    assert o.logits.shape == (len(reqs), off.cfg.vocab_size)
    assert torch.isfinite(o.logits).all()
    err = max_abs_err(o.logits, p.logits)
    assert err <= atol, f"logits differ by {err}"
    kv_err = max_abs_err_kv(off.kv, par.kv, o.batch)
    assert kv_err <= atol, f"replay KV differs by {kv_err}"
    # the compared KV is real: kept rows were written in both runners
    slots = replay_kv_slots(o.batch)
    for layer in off.cfg.replay_layers:
        assert (par.kv.swa[layer][slots] != 0).any(-1).all()
    ntrim = assert_really_trimmed(off, par, reqs)
    return o, p, ntrim


def run_both(make_runner, reqs, **kw):
    off, par = make_runner(**kw), make_runner(**kw)
    off.prefill_context(reqs, eager_replay="off")
    par.prefill_context(reqs, eager_replay="parent")
    o, p, ntrim = compare_step(off, par, reqs)
    return off, par, o, p, ntrim


# --------------------------------------------------------------------------------------
# Fixed compositions (W = 16)
# --------------------------------------------------------------------------------------
COMPOSITIONS = {
    "single long prefill": ([R("a", 90, 90)], 1),
    "decode + trimmed prefill + short chunk": ([R("d", 1, 70), R("p", 50, 50), R("c", 10, 40)], 1),
    "decode + prefill + long chunk": ([R("d", 1, 33), R("p", 17, 17), R("c", 40, 100)], 2),
    "all decodes": ([R("a", 1, 30), R("b", 1, 2), R("c", 1, 100), R("d", 1, 17)], 0),
    "keep-all requests": ([R("k", 60, 60, keep_all=True), R("p", 60, 60), R("k2", 30, 80, keep_all=True)], 1),
    "speculative decodes": ([R("s", 3, 50), R("t", 3, 20), R("p", 30, 30), R("u", 2, 9)], 1),
    "prefix-cache later floor": ([R("a", 40, 100, kv_start=90), R("b", 1, 20), R("c", 35, 35, kv_start=25)], 2),
    "exactly the window": ([R("a", 16, 16), R("b", 16, 40)], 0),
}


@pytest.mark.parametrize("name", list(COMPOSITIONS))
def test_off_and_parent_agree(make_runner, name):
    reqs, expect_trimmed = COMPOSITIONS[name]
    off, par, o, p, ntrim = run_both(make_runner, reqs)
    assert ntrim == expect_trimmed
    assert o.batch.has_trimmable_rows == (expect_trimmed > 0)


def test_chunked_prefill_then_decodes(make_runner):
    budget = 48
    prompts = {"a": 100, "b": 70, "c": 10}
    off, par = make_runner(max_num_batched_tokens=budget), make_runner(max_num_batched_tokens=budget)
    lo = off.prefill(prompts, eager_replay="off")
    lp = par.prefill(prompts, eager_replay="parent")
    assert set(lo) == set(lp) == set(prompts)
    for rid in prompts:
        assert max_abs_err(lo[rid], lp[rid]) <= ATOL, rid
    # every trimmed chunk of the prefill left its dead rows unwritten in parent mode
    ids, lengths = list(prompts), list(prompts.values())
    trimmed = 0
    for plan in schedule_prefill(lengths, budget):
        trimmed += assert_really_trimmed(off, par, [R(ids[j], q, s) for j, q, s in plan])
    assert trimmed == 4  # a: 48, 48; b: 44, 26 (c and a's last 4 tokens keep every row)
    # the chunks really spanned several steps
    assert len(schedule_prefill(lengths, budget)) == 4

    # decodes after the trimmed prefill read only kept rows; a new trimmed prefill joins
    compare_step(off, par, [R("a", 1, 101), R("b", 1, 71), R("c", 1, 11), R("e", 40, 40)])
    compare_step(off, par, [R("a", 1, 102), R("b", 3, 74), R("c", 1, 12), R("e", 1, 41)])
    # and a second chunk of a long prompt after decodes
    compare_step(off, par, [R("a", 1, 103), R("e", 30, 71)])


def test_parent_without_trimmable_rows_runs_whole_batch(make_runner):
    reqs = [R("a", 1, 30), R("b", 3, 40), R("c", 16, 16)]
    off, par, o, p, ntrim = run_both(make_runner, reqs)
    assert ntrim == 0 and not o.batch.has_trimmable_rows
    torch.testing.assert_close(o.logits, p.logits, atol=0, rtol=0)


# --------------------------------------------------------------------------------------
# Random compositions
# --------------------------------------------------------------------------------------
@st.composite
def compositions(draw):
    n = draw(st.integers(1, 4))
    reqs = []
    for i in range(n):
        kind = draw(st.sampled_from(["decode", "spec", "prefill", "chunk", "keep"]))
        kv_start = None
        keep = False
        if kind == "decode":
            q = 1
            s = draw(st.integers(1, 120))
        elif kind == "spec":
            q = draw(st.integers(2, 4))
            s = draw(st.integers(q, 120))
        elif kind == "prefill":
            q = draw(st.integers(1, 80))
            s = q
        elif kind == "chunk":
            q = draw(st.integers(1, 60))
            s = q + draw(st.integers(1, 80))
        else:
            q = draw(st.integers(1, 60))
            s = q + draw(st.integers(0, 40))
            keep = True
        if kind in ("prefill", "chunk") and q > 16 and draw(st.booleans()):
            kv_start = draw(st.integers(s - 16, s - 1))
        reqs.append(R(f"r{i}", q, s, keep_all=keep, kv_start=kv_start))
    return reqs


@settings(max_examples=15, deadline=None, derandomize=True)
@given(reqs=compositions())
def test_off_and_parent_agree_on_random_compositions(model, reqs):
    def make():
        return StepRunner(model, max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN)

    off, par = make(), make()
    off.prefill_context(reqs, eager_replay="off")
    par.prefill_context(reqs, eager_replay="parent")
    compare_step(off, par, reqs)


# --------------------------------------------------------------------------------------
# The floor is what makes trimming exact, and the oracle is batch-independent
# --------------------------------------------------------------------------------------
def _without_floor(monkeypatch):
    real = attention_reference.attend_request

    def unfloored(q, swa, glob, ratio, seq_len, floor, window, sink, scale):
        return real(q, swa, glob, ratio, seq_len, 0, window, sink, scale)

    monkeypatch.setattr(attention_reference, "attend_request", unfloored)


def test_removing_the_floor_changes_the_result(make_runner, monkeypatch):
    reqs = [R("a", 80, 80), R("b", 1, 10)]  # b: its 9-token context has no floor either
    floored = run_both(make_runner, reqs)[2].logits
    _without_floor(monkeypatch)
    off, par = make_runner(), make_runner()
    par.prefill_context(reqs, eager_replay="parent")
    off.prefill_context(reqs, eager_replay="off")
    unfloored = off.step(reqs, eager_replay="off").logits
    # the long prefill's last row changes (through the replay layers' SWA keys of the
    # rows its window covers); the decode, with no floor of its own, does not
    assert max_abs_err(unfloored[0], floored[0]) > 1e-3
    assert max_abs_err(unfloored[1], floored[1]) <= 1e-5
    # without the floor, trimming would no longer be exact (the vLLM behaviour)
    trimmed = par.step(reqs, eager_replay="parent").logits
    assert max_abs_err(unfloored[0], trimmed[0]) > 1e-3


def test_kv_start_later_floor_is_honoured_by_the_oracle(make_runner):
    a = make_runner()
    b = make_runner()
    for r in (a, b):
        r.prefill_context([R("x", 40, 100)])
    plain = a.step([R("x", 40, 100)]).logits
    later = b.step([R("x", 40, 100, kv_start=95)]).logits
    assert max_abs_err(plain, later) > 1e-3


@pytest.mark.parametrize("target", [R("x", 60, 60), R("x", 25, 90), R("x", 1, 77), R("x", 40, 40, keep_all=True)])
def test_oracle_independent_of_batch_composition(make_runner, target):
    others = [R("d", 1, 50), R("p", 70, 70), R("k", 30, 30, keep_all=True), R("c", 20, 40)]
    alone_r, mixed_r = make_runner(), make_runner()
    alone_r.prefill_context([target])
    alone = alone_r.step([target]).logits[0]
    batch = others[:2] + [target] + others[2:]
    mixed_r.prefill_context(batch)
    # give the target a different cache block than when alone
    assert mixed_r.block_of("x") != alone_r.block_of("x")
    mixed = mixed_r.step(batch).logits[2]
    assert max_abs_err(alone, mixed) <= 1e-4
