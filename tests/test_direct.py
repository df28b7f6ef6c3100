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
from replay_backend.capture.graphs import StrictFallbackError

from conftest import MAX_MODEL_LEN

OPTS = dict(compiler="eager", max_num_seqs=4, max_cudagraph_capture_size=64, decoder_replay_trim_threshold=48)
# piecewise trimmed, piecewise below the threshold, eager trimmed, a lone decode (two rows)
STEPS = [[R("a", 50, 50)], [R("b", 20, 20), R("c", 9, 9)], [R("d", 100, 100)], [R("e", 1, 1)]]


@pytest.fixture(autouse=True)
def _fresh(fresh_dynamo, one_thread):
    yield


def _runner(model, **options) -> StepRunner:
    return StepRunner(model, max_model_len=MAX_MODEL_LEN, backend=ReplayBackend(**{**OPTS, **options}))


class _NoDynamo:
    """Stands in for the runner's compiled forward: any call through Dynamo fails."""

    def __call__(self, *args):
        raise AssertionError("a served step went through Dynamo's entry")


@pytest.mark.parametrize("mode", ["piecewise", "none"])
def test_served_steps_skip_dynamo_and_match_the_oracle(model, mode, caplog):
    caplog.set_level(logging.INFO, logger="replay_backend")
    rc = _runner(model, cudagraph_mode=mode)
    rc.capture()
    assert "served steps call the compiled model directly" in caplog.text
    entry = rc._direct
    assert isinstance(entry, direct.DirectEntry)
    assert entry.inputs[0] >= 0 and entry.inputs[1] >= 0 and entry.tokens
    rc.forward = _NoDynamo()  # ``run`` passes ``self.forward``: served steps must not call it
    ro = StepRunner(model, max_model_len=MAX_MODEL_LEN)
    for reqs in STEPS:
        got, want = rc.step(reqs), ro.step(reqs)
        assert max_abs_err(got.logits, want.logits) < 1e-4
        assert max_abs_err_kv(rc.kv, ro.kv, got.batch) < 1e-4
    assert rc.step([R("f", 50, 50)]).trim.trimmed  # graphed or eager, the step trims


def test_served_steps_take_their_inputs_from_the_metadata_copy(model):
    """Once served directly, a step's token ids and positions are views of its one
    metadata copy (no copies of their own); warm-up steps through Dynamo keep their own
    storage. Served steps still match the oracle (above); here against a runner without
    the option, bit for bit."""
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
    """The same steps through both entries of one captured runner: the same logits
    and caches to the bit, the same step records and dispatch counts."""
    runs = []
    for use_direct in (True, False):
        torch._dynamo.reset()
        rc = _runner(model)
        rc.capture()
        if not use_direct:
            rc._direct = None
        before = counters.state()
        outs = [rc.step(reqs) for reqs in STEPS]
        runs.append(SimpleNamespace(outs=outs, kv=rc.kv, moved=counters.moved_since(before),
                                    dispatch={k: dict(v) for k, v in rc.backend.model.dispatch.items()}))
    a, b = runs
    for x, y in zip(a.outs, b.outs):
        assert torch.equal(x.logits, y.logits)
        assert (x.step, x.trim) == (y.step, y.trim)
    for x, y in zip(_caches(a.kv), _caches(b.kv)):
        assert torch.equal(x, y)
    assert a.moved == b.moved and a.dispatch == b.dispatch


def test_inputs_dynamo_would_recompile_for_are_refused(model):
    rc = _runner(model, cudagraph_mode="none")
    rc.capture()
    batch = rc.build_batch([R("a", 5, 5)])
    with torch.inference_mode():
        odd = dataclasses.replace(batch, input_ids=batch.input_ids.to(torch.int32))
        short = dataclasses.replace(batch, positions=batch.positions[:4])
    with pytest.raises(ValueError, match="input_ids is torch.int32.*recompile"):
        rc.run(odd)
    with pytest.raises(ValueError, match=r"positions is torch.int64 \(4,\).*input_ids \(5\)"):
        rc.run(short)
    assert len(rc.backend.compiled) == 1


def test_switched_off_steps_go_through_dynamo(model):
    rc = _runner(model, direct_dispatch=False)
    with counters.expect(strict=False, fallbacks={}):
        rc.capture()
    assert rc._direct is None and rc._learned is None  # nothing watched, nothing learned
    ro = StepRunner(model, max_model_len=MAX_MODEL_LEN)
    got, want = rc.step(STEPS[0]), ro.step(STEPS[0])
    assert max_abs_err(got.logits, want.logits) < 1e-4


def test_nothing_learned_is_a_counted_fallback_or_an_error_when_strict(model, caplog):
    for strict in (False, True):
        torch._dynamo.reset()
        rc = _runner(model, cudagraph_mode="none", strict=strict)
        rc.run(rc.dummy_batch(16), use_graphs=False)
        rc._learned = "graph argument 7 (Tensor) is neither a forward input, ..."
        if strict:
            with pytest.raises(StrictFallbackError, match="direct_dispatch: .*graph argument 7"):
                rc.start_serving()
            continue
        with counters.expect(strict=False, fallbacks={"direct_dispatch": 1}):
            rc.start_serving()
        assert rc._direct is None and rc.backend.frozen
        assert "served steps go through Dynamo's entry: graph argument 7" in caplog.text
        ro = StepRunner(model, max_model_len=MAX_MODEL_LEN)
        assert max_abs_err(rc.step(STEPS[0]).logits, ro.step(STEPS[0]).logits) < 1e-4


def test_a_second_compiled_graph_is_not_served_directly(model):
    rc = _runner(model, cudagraph_mode="none")
    rc.run(rc.dummy_batch(16), use_graphs=False)
    rc.backend.compiled.append(rc.backend.model)  # as if Dynamo had recompiled once
    with counters.expect(strict=False, fallbacks={"direct_dispatch": 1}):
        rc.start_serving()
    assert rc._direct is None


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


NAMES = ("input_ids", "positions")


def test_learn_maps_inputs_token_counts_and_fixed_arguments():
    m, w = _Model(), torch.ones(3)
    ids, pos = torch.arange(6), torch.arange(6)
    entry = direct.learn(m, (6, ids, w, pos), m(6, ids, w, pos), (ids, pos), m.result, NAMES, {id(w)})
    assert isinstance(entry, direct.DirectEntry)
    assert entry.inputs == (1, 3) and entry.tokens == (0,) and entry.output == 1
    assert entry.template == (None, None, w, None)
    ids2, pos2 = torch.arange(9), torch.arange(9) + 1
    assert entry(ids2, pos2) is m.result
    n, a, b, c = m.calls[-1]
    assert n == 9 and a is ids2 and b is w and c is pos2


@pytest.mark.parametrize("args, fixed, returned, reason", [
    ([6, "ids", "stray", "pos"], True, True, "graph argument 2 .* neither a forward input"),
    ([6, "ids", "w", "pos"], False, True, "graph argument 2 .* parameter or buffer"),
    ([5, "ids", "w", "pos"], True, True, "symbolic size 5, not the token count 6"),
    ([6, "ids", "w", "stray"], True, True, "graph argument 3 is token-indexed but none"),
    ([6, "pos", "ids", "ids"], True, True, "graph argument 2 is input input_ids, which is not dynamic"),
    ([6, "ids", "w", "pos"], True, False, "does not return exactly one"),
])
def test_learn_refuses_calls_it_cannot_repeat(args, fixed, returned, reason):
    m, w = _Model(), torch.ones(3)
    ids, pos = torch.arange(6), torch.arange(6)
    named = {"ids": ids, "pos": pos, "w": w}
    args = tuple(named[a] if a in named else torch.ones(6) if a == "stray" else a for a in args)
    outputs = m(*args) if returned else (torch.zeros(1), m.result.clone())
    got = direct.learn(m, args, outputs, (ids, pos), m.result, NAMES, {id(w)} if fixed else set())
    assert isinstance(got, str) and re.search(reason, got), got


def test_for_serving_takes_only_an_entry_of_the_one_compiled_model():
    m, other, w = _Model(), _Model(), torch.ones(3)
    ids, pos = torch.arange(6), torch.arange(6)
    entry = direct.learn(m, (6, ids, w, pos), m(6, ids, w, pos), (ids, pos), m.result, NAMES, {id(w)})
    assert direct.for_serving(entry, [m]) is entry
    assert "another compiled model" in direct.for_serving(entry, [other])
    assert "compiled 2 graphs" in direct.for_serving(entry, [m, other])
    assert "no warm-up step" in direct.for_serving(None, [m])
    assert direct.for_serving("a reason", [m]) == "a reason"
