"""Served steps call the compiled model directly, as the warm-up steps through Dynamo
taught (dispatch/direct.py), against the eager oracle and against Dynamo's own entry."""
from __future__ import annotations

import dataclasses
import logging
import re
from types import SimpleNamespace

import pytest
import torch

from replay_backend.backend import ReplayBackend
from replay_backend.batch import RequestChunk as R
from replay_backend.reference.compare import max_abs_err, max_abs_err_kv
from replay_backend.counters import counters
from replay_backend.reference.runner import StepRunner
from replay_backend.dispatch import direct
from replay_backend.fallbacks import StrictFallbackError
from replay_backend.forward_context import set_forward_context

from conftest import MAX_MODEL_LEN

OPTS = dict(compiler="eager", max_num_seqs=4, max_cudagraph_capture_size=64, decoder_replay_trim_threshold=48)
# piecewise trimmed, piecewise below the threshold, eager trimmed, a lone decode
STEPS = [[R("a", 50, 50)], [R("b", 20, 20), R("c", 9, 9)], [R("d", 100, 100)], [R("e", 1, 1)]]


@pytest.fixture(autouse=True)
def _fresh(fresh_dynamo, one_thread):
    yield


def _runner(model, **options) -> StepRunner:
    return StepRunner(model, max_model_len=MAX_MODEL_LEN, backend=ReplayBackend(**{**OPTS, **options}))


class _NoDynamo(torch.nn.Module):
    """Stands in for the compiled model's Dynamo entry: any call through it fails."""

    def forward(self, *args):
        raise AssertionError("a served step went through Dynamo's entry")


@pytest.mark.parametrize("mode", ["piecewise", "none"])
def test_served_steps_skip_dynamo_and_match_the_oracle(model, mode, caplog):
    caplog.set_level(logging.INFO, logger="replay_backend")
    rc = _runner(model, cudagraph_mode=mode)
    rc.capture()
    assert "calls reach the compiled model directly" in caplog.text
    assert rc.compiled.direct
    entry = rc.compiled._learned
    assert [name for name, slot, token in entry.inputs] == ["input_ids", "positions"]
    assert all(slot >= 0 and token for _, slot, token in entry.inputs) and entry.tokens
    rc.compiled.compiled = _NoDynamo()  # Dynamo's entry: served steps must not call it
    ro = StepRunner(model, max_model_len=MAX_MODEL_LEN)
    for reqs in STEPS:
        got, want = rc.step(reqs), ro.step(reqs)
        assert max_abs_err(got.logits, want.logits) < 1e-4
        assert max_abs_err_kv(rc.kv, ro.kv, got.batch) < 1e-4
    assert rc.step([R("f", 50, 50)]).result.trimmed  # graphed or eager, the step trims


def test_served_steps_take_their_inputs_from_the_metadata_copy(model):
    """Once called directly, a step's token ids and positions are views of its one
    metadata copy (no copies of their own); the trace's step through Dynamo keeps its
    own storage. Served steps still match the oracle (above); here against a runner
    without direct calls, bit for bit."""
    rc = _runner(model)
    warm = rc.build_batch(STEPS[0])
    assert warm.input_ids.untyped_storage().data_ptr() != warm.view.slot_mapping.untyped_storage().data_ptr()
    rc.capture()
    plain = _runner(model, direct_dispatch=False)
    plain.capture()
    for reqs in STEPS:
        batch = rc.build_batch(reqs)
        shared = batch.view.slot_mapping.untyped_storage().data_ptr()
        assert batch.input_ids.untyped_storage().data_ptr() == shared
        assert batch.positions.untyped_storage().data_ptr() == shared
        other = plain.build_batch(reqs)
        assert torch.equal(batch.input_ids, other.input_ids) and torch.equal(batch.positions, other.positions)
        assert torch.equal(rc.run(batch).logits, plain.run(other).logits)


def _caches(kv) -> list[torch.Tensor]:
    return [*kv.swa, *kv.glob.values(), *kv.raw.values()]


def test_direct_and_dynamo_entries_agree_exactly(model):
    """The same steps through both entries: the same logits and caches to the bit, the
    same step records and dispatch counts."""
    runs = []
    for use_direct in (True, False):
        torch._dynamo.reset()
        rc = _runner(model, direct_dispatch=use_direct)
        rc.capture()
        assert rc.compiled.direct is use_direct
        before = counters.state()
        outs = [rc.step(reqs) for reqs in STEPS]
        runs.append(SimpleNamespace(outs=outs, kv=rc.kv, moved=counters.moved_since(before),
                                    dispatch={k: dict(v) for k, v in rc.backend.model.dispatch.items()}))
    a, b = runs
    for x, y in zip(a.outs, b.outs):
        assert torch.equal(x.logits, y.logits)
        assert x.result == y.result
    for x, y in zip(_caches(a.kv), _caches(b.kv)):
        assert torch.equal(x, y)
    assert a.moved == b.moved and a.dispatch == b.dispatch


def test_inputs_dynamo_would_trace_anew_are_refused_once_serving(model):
    rc = _runner(model, cudagraph_mode="none")
    rc.capture()
    batch = rc.build_batch([R("a", 5, 5)])
    with torch.inference_mode():
        odd = dataclasses.replace(batch, input_ids=batch.input_ids.to(torch.int32))
        short = dataclasses.replace(batch, positions=batch.positions[:4])
    with pytest.raises(ValueError, match="input_ids is torch.int32 on cpu, traced as torch.int64.*new trace"):
        rc.run(odd)
    with pytest.raises(ValueError, match="positions has 4 rows, the other token inputs 5"):
        rc.run(short)
    with pytest.raises(ValueError, match="grad mode is on, traced with it off"):
        with set_forward_context(rc.setup.context(batch)):
            rc.compiled(batch.input_ids, batch.positions)
    assert len(rc.backend.compiled) == 1


def test_switched_off_steps_go_through_dynamo(model):
    rc = _runner(model, direct_dispatch=False)
    with counters.expect(strict=False, fallbacks={}):
        rc.capture()
    assert not rc.compiled.direct and rc.compiled._learned is None  # nothing watched, nothing learned
    ro = StepRunner(model, max_model_len=MAX_MODEL_LEN)
    got, want = rc.step(STEPS[0]), ro.step(STEPS[0])
    assert max_abs_err(got.logits, want.logits) < 1e-4


def test_nothing_learned_is_a_counted_fallback_or_an_error_when_strict(model, caplog, monkeypatch):
    monkeypatch.setattr(direct, "learn", lambda *a: "graph argument 7 (Tensor) is neither a forward input, ...")
    for strict in (False, True):
        torch._dynamo.reset()
        rc = _runner(model, cudagraph_mode="none", strict=strict)
        if strict:
            with pytest.raises(StrictFallbackError, match="direct_dispatch: .*graph argument 7"):
                rc.run(rc.dummy_batch(16), use_graphs=False)
            continue
        with counters.expect(strict=False, fallbacks={"direct_dispatch": 1}):
            rc.run(rc.dummy_batch(16), use_graphs=False)
            rc.start_serving()
        assert not rc.compiled.direct and rc.backend.frozen
        assert "calls go through Dynamo's entry: graph argument 7" in caplog.text
        ro = StepRunner(model, max_model_len=MAX_MODEL_LEN)
        assert max_abs_err(rc.step(STEPS[0]).logits, ro.step(STEPS[0]).logits) < 1e-4


def test_a_second_compiled_graph_is_not_served_directly(model):
    rc = _runner(model, cudagraph_mode="none")
    rc.run(rc.dummy_batch(16), use_graphs=False)
    assert rc.compiled.direct
    rc.backend.compiled.append(rc.backend.model)  # as if Dynamo had recompiled once
    assert not rc.compiled.direct
    with counters.expect(strict=False, fallbacks={"direct_dispatch": 1}):
        rc.start_serving()


# --------------------------------------------------------------------------------------
# learn(): what a call must look like to be served directly
# --------------------------------------------------------------------------------------
class _Model:
    """A compiled model's calling convention: token-indexed graph arguments 1 and 3, the
    symbolic token count at 0; it returns (something else, the forward's result)."""

    token_inputs, sym_inputs = [1, 3], [0]

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.result = torch.zeros(6, 2)

    def __call__(self, *args):
        self.calls.append(args)
        return torch.zeros(1), self.result


PARAMS = ("input_ids", "positions")


def _learn(m, args, outputs, ids, pos, result, fixed, **extra):
    bound = {"input_ids": ids, "positions": pos, **extra}
    return direct.learn(m, args, outputs, bound, (*PARAMS, *extra), result, fixed)


def test_learn_maps_inputs_token_counts_and_fixed_arguments():
    m, w = _Model(), torch.ones(3)
    ids, pos = torch.arange(6), torch.arange(6)
    entry = _learn(m, (6, ids, w, pos), m(6, ids, w, pos), ids, pos, m.result, {id(w)})
    assert isinstance(entry, direct.DirectEntry)
    assert entry.inputs == (("input_ids", 1, True), ("positions", 3, True)) and entry.tokens == (0,)
    assert entry.outputs == (1,) and entry.template == (None, None, w, None)
    ids2, pos2 = torch.arange(9), torch.arange(9) + 1
    bound = entry.bind((ids2, pos2), {})
    assert entry.mismatch(bound) is None and entry(bound) is m.result
    n, a, b, c = m.calls[-1]
    assert n == 9 and a is ids2 and b is w and c is pos2


def test_learn_rebuilds_a_structured_result_and_checks_constant_arguments():
    m, w = _Model(), torch.ones(3)
    ids, pos = torch.arange(6), torch.arange(6)
    result = {"hidden": (m.result,), "note": "x"}
    entry = _learn(m, (6, ids, w, pos), m(6, ids, w, pos), ids, pos, result, {id(w)}, scale=2)
    assert isinstance(entry, direct.DirectEntry) and entry.constants == (("scale", 2),)
    out = entry(entry.bind((torch.arange(4), torch.arange(4)), {"scale": 2}))
    assert out == {"hidden": (m.result,), "note": "x"}
    assert "argument scale is 3, traced as 2" in entry.mismatch(entry.bind((ids, pos), {"scale": 3}))


def test_a_tuple_of_constants_is_a_constant_argument_compared_element_by_element():
    m, w = _Model(), torch.ones(3)
    ids, pos = torch.arange(6), torch.arange(6)
    entry = _learn(m, (6, ids, w, pos), m(6, ids, w, pos), ids, pos, m.result, {id(w)}, dims=(1, 2.0, None))
    assert isinstance(entry, direct.DirectEntry) and entry.constants == (("dims", (1, 2.0, None)),)
    assert entry.mismatch(entry.bind((ids, pos), {"dims": (1, 2.0, None)})) is None
    for other in ((1, 2, None), (1, 2.0), (True, 2.0, None)):  # 2 is not 2.0, True is not 1
        assert "argument dims is" in entry.mismatch(entry.bind((ids, pos), {"dims": other})), other


@pytest.mark.parametrize("args, fixed, returned, reason", [
    ([6, "ids", "stray", "pos"], True, True, "graph argument 2 .* neither a forward input"),
    ([6, "ids", "w", "pos"], False, True, "graph argument 2 .* parameter or buffer"),
    ([5, "ids", "w", "pos"], True, True, "symbolic size 5, not the token count 6"),
    ([6, "ids", "w", "stray"], True, True, "graph argument 3 is token-indexed but none"),
    ([6, "ids", "w", "pos"], True, False, "returns a tensor that is not one of the compiled graph's outputs"),
])
def test_learn_refuses_calls_it_cannot_repeat(args, fixed, returned, reason):
    m, w = _Model(), torch.ones(3)
    ids, pos = torch.arange(6), torch.arange(6)
    named = {"ids": ids, "pos": pos, "w": w}
    args = tuple(named[a] if a in named else torch.ones(6) if a == "stray" else a for a in args)
    outputs = m(*args) if returned else (torch.zeros(1), m.result.clone())
    got = _learn(m, args, outputs, ids, pos, m.result, {id(w)} if fixed else set())
    assert isinstance(got, str) and re.search(reason, got), got


def test_for_serving_takes_only_an_entry_of_the_one_compiled_model():
    m, other, w = _Model(), _Model(), torch.ones(3)
    ids, pos = torch.arange(6), torch.arange(6)
    entry = _learn(m, (6, ids, w, pos), m(6, ids, w, pos), ids, pos, m.result, {id(w)})
    assert direct.for_serving(entry, [m]) is entry
    assert "another compiled model" in direct.for_serving(entry, [other])
    assert "compiled 2 graphs" in direct.for_serving(entry, [m, other])
    assert "no call through Dynamo" in direct.for_serving(None, [m])
    assert direct.for_serving("a reason", [m]) == "a reason"


def test_a_graph_call_runs_dummy_steps_of_any_size_on_zeros():
    m, w = _Model(), torch.ones(3)
    call = direct.GraphCall.of(m, (6, torch.arange(6), w, torch.ones(6, 2, dtype=torch.float64)))
    call.dummy(3)
    n, a, b, c = m.calls[-1]
    assert n == 3 and b is w and torch.equal(a, torch.zeros(3, dtype=torch.int64))
    assert c.shape == (3, 2) and c.dtype == torch.float64 and not c.any()


def test_the_entry_refuses_what_dynamo_or_python_would():
    """Another trailing shape of a token input is a new trace, not a broadcast; an unknown
    or repeated keyword is refused as Python refuses it."""
    m, w = _Model(), torch.ones(3)
    ids, pos = torch.zeros(6, 2), torch.arange(6)
    entry = _learn(m, (6, ids, w, pos), m(6, ids, w, pos), ids, pos, m.result, {id(w)})
    assert "input_ids has shape (4, 1), traced with ('T', 2)" in entry.mismatch(
        entry.bind((torch.zeros(4, 1), torch.arange(4)), {}))
    assert entry.mismatch(entry.bind((torch.zeros(9, 2), torch.arange(9)), {})) is None
    with pytest.raises(TypeError, match="unexpected keyword argument 'scale'"):
        entry.bind((ids, pos), {"scale": 3.0})
    with pytest.raises(TypeError, match="multiple values for argument 'input_ids'"):
        entry.bind((ids, pos), {"input_ids": ids})
