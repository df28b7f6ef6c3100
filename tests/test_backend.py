"""DSv4.1-mini through the compiled backend vs the eager oracle (SPEC §3-§7).

The 8-layer config of conftest (window W=16, layers 4..7 replay layers), pieces
compiled with ``compiler="eager"``, graphs emulated on CPU. Main capture sizes for
``max_cudagraph_capture_size=64`` are [1, 2, 4, 8, 16, 24, ..., 64]; replay capture
sizes for W=16 and ``max_num_seqs=4`` are [16, 32, 48, 64]; the trim threshold is 48.
Steps above 64 tokens are eager steps.

Most tests share one captured runner (compiling and capturing costs seconds); tests
that need another configuration build their own after ``torch._dynamo.reset()``.
"""
from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from replay_backend.backend import ReplayBackend
from replay_backend.batch import RequestChunk
from replay_backend.compare import max_abs_err, max_abs_err_kv
from replay_backend.config import padded_size
from replay_backend.counters import counters
from replay_backend.runner import StepRunner
from replay_backend.runtime.graphs import GraphLevel, GraphResources, PieceRunner, StaticGraph

from conftest import MAX_MODEL_LEN

ATOL = 1e-4
MAIN_SIZES = [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
REPLAY_SIZES = [16, 32, 48, 64]
THRESHOLD = 48
DEFAULTS = dict(compiler="eager", max_num_seqs=4, max_cudagraph_capture_size=64,
                decoder_replay_trim_threshold=THRESHOLD)

_ids = itertools.count()


def R(name, q, s, **kw) -> RequestChunk:
    """A request with a test-unique id (runners are shared between tests)."""
    return RequestChunk(f"{name}#{next(_ids)}", q, s, **kw)


# --------------------------------------------------------------------------------------
# Runners
# --------------------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # The model is tiny: one intra-op thread is faster, and far faster when another
    # process shares the two cores.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


_shared: dict = {}


def _reset_dynamo():
    torch._dynamo.reset()
    _shared.clear()  # a reset drops the shared runner's compiled code


def build_env(model, capture=True, **options) -> SimpleNamespace:
    opts = dict(DEFAULTS)
    opts.update(options)
    be = ReplayBackend(**opts)
    rc = StepRunner(model, max_model_len=MAX_MODEL_LEN, backend=be)
    ro = StepRunner(model, max_model_len=MAX_MODEL_LEN)
    before = counters.snapshot()
    summary = rc.capture() if capture else None
    return SimpleNamespace(model=model, be=be, rc=rc, ro=ro, summary=summary, before_capture=before)


@pytest.fixture(autouse=True)
def _fresh_dynamo(request):
    if "shared" not in request.fixturenames:
        _reset_dynamo()
    yield


@pytest.fixture
def shared(model):
    """The default backend, captured and serving, with an eager oracle runner."""
    if "env" not in _shared:
        _reset_dynamo()
        _shared["env"] = build_env(model)
    env = _shared["env"]
    yield env
    for r in (env.rc, env.ro):
        for rid in list(r._blocks):
            r.free(rid)


def prefill_both(env, reqs):
    for r in (env.rc, env.ro):
        r.prefill_context(reqs, forward=env.model)  # the oracle path in both


def compare(env, reqs, atol=ATOL, free=True):
    """One step through both runners (after building the same context); returns the
    compiled runner's StepOutput."""
    prefill_both(env, reqs)
    got = env.rc.step(reqs)
    want = env.ro.step(reqs)
    check_outputs(env, got, want, atol)
    if free:
        for r in (env.rc, env.ro):
            for q in reqs:
                r.free(q.req_id)
    return got


def check_outputs(env, got, want, atol=ATOL):
    assert got.logits.shape == want.logits.shape == (len(got.batch.requests), env.model.cfg.vocab_size)
    assert torch.isfinite(got.logits).all()
    err = max_abs_err(got.logits, want.logits)
    kv_err = max_abs_err_kv(env.rc.kv, env.ro.kv, got.batch)
    assert err <= atol, f"logits differ by {err}"
    assert kv_err <= atol, f"replay-layer KV differs by {kv_err}"


def expected_dispatch(batch, main_sizes, replay_sizes, threshold, replay_graphs=True):
    """(kind, padded_tokens, trimmed, replay rows or None, replay padded) per SPEC §5-§6."""
    t = max(batch.num_tokens, 2)  # the runner runs a lone decode as two rows
    tp = padded_size(main_sizes, t) if main_sizes else None
    if tp is not None:
        kind, padded = "piecewise", tp
        trimmed = replay_graphs and tp >= threshold
    else:
        kind, padded = "eager", t
        trimmed = batch.has_trimmable_rows
    if not trimmed:
        return kind, padded, False, None, (tp if kind == "piecewise" else None)
    rows = batch.replay.num_rows
    return kind, padded, True, rows, padded_size(replay_sizes, rows) if replay_sizes else None


def check_dispatch(out, kind, padded, trimmed, rows, rpad):
    assert (out.step.kind, out.step.padded_tokens) == (kind, padded)
    assert out.trim is not None
    assert out.trim.trimmed is trimmed
    if rows is not None:
        assert out.trim.rows == rows
    assert out.trim.padded == rpad
    assert out.trim.graph is (rpad is not None)


# ======================================================================================
# The shared default runner
# ======================================================================================
def test_plan_shape(shared):
    plan = shared.be.model.plan
    kinds = [p.kind for p in plan.main_pieces]
    assert kinds == ["graph", "attention"] * 4 + ["graph", "replay"]
    assert plan.pieces_by_kind("main") == {"graph": 5, "attention": 4, "replay": 1}
    assert plan.pieces_by_kind("replay") == {"graph": 5, "attention": 4}
    assert [p.kind for p in plan.replay_pieces] == ["graph", "attention"] * 4 + ["graph"]
    assert [p.layers for p in plan.main_pieces if p.kind == "attention"] == [[0], [1], [2], [3]]
    assert [p.op for p in plan.main_pieces if p.kind == "attention"] == [
        "dsv41::swa_attention", "dsv41::source_attention", "dsv41::global_attention",
        "dsv41::source_attention"]
    assert [p.layers for p in plan.replay_pieces if p.kind == "attention"] == [[4], [5], [6], [7]]
    assert {p.op for p in plan.replay_pieces if p.kind == "attention"} == {"dsv41::global_attention"}
    replay = plan.main_pieces[-1]
    assert replay.op == "dsv41_replay::trim_and_redispatch" and replay.layers == [4, 5, 6, 7]
    assert plan.replay_layers == [4, 7]
    assert plan.window == 16 and plan.trim_threshold == THRESHOLD
    assert plan.capture_sizes == MAIN_SIZES
    assert plan.replay_capture_sizes == REPLAY_SIZES
    assert plan.replay_off_reason is None
    assert plan.as_dict()["replay_layers"] == [4, 7]


def test_capture_state(shared):
    m, be = shared.be.model, shared.be
    assert be.frozen and m.serving
    assert len(be.compiled) == 1
    # every size a step can use was captured (a lone decode runs as 2 rows, so size 1
    # is never needed), replay sizes and the replay region's below-threshold sizes too
    assert set(MAIN_SIZES) - {1} <= set(m.captured_sizes("main"))
    below = [s for s in MAIN_SIZES if s < THRESHOLD]
    assert set(REPLAY_SIZES) | (set(below) - {1}) <= set(m.captured_sizes("replay"))
    assert len(m.runners("main")) == 5 and len(m.runners("replay")) == 5
    assert shared.summary["main"]["graphs"] == sum(len(r.graphs) for r in m.runners("main"))
    assert shared.summary["replay"]["graphs"] == sum(len(r.graphs) for r in m.runners("replay"))
    with pytest.raises(RuntimeError, match="serving"):
        m.capture(lambda n: None, lambda n: None)


COMPOSITIONS = {
    # name: (requests, kind, padded tokens, trimmed, replay padded)
    "decode + trimmed prefill + short chunk": (
        lambda: [R("d", 1, 70), R("p", 50, 50), R("c", 10, 40)], "piecewise", 64, True, 32),
    "all decodes": (lambda: [R("a", 1, 30), R("b", 1, 2), R("c", 1, 100), R("d", 1, 17)],
                    "piecewise", 4, False, 4),
    "lone decode": (lambda: [R("a", 1, 77)], "piecewise", 2, False, 2),
    "speculative decodes + prefill": (lambda: [R("s", 3, 50), R("t", 3, 20), R("p", 30, 30), R("u", 2, 9)],
                                      "piecewise", 40, False, 40),
    "one long prefill (eager step)": (lambda: [R("a", 100, 100)], "eager", 100, True, 16),
    "long chunk after context (eager step)": (lambda: [R("a", 80, 200), R("d", 1, 9)], "eager", 81, True, 32),
    "prefix-cache later floor (eager step)": (
        lambda: [R("a", 40, 100, kv_start=90), R("b", 1, 20), R("c", 35, 35, kv_start=25)], "eager", 76, True, 48),
    "keep-all requests (piecewise, trimmed step)": (
        lambda: [R("k", 30, 30, keep_all=True), R("k2", 20, 50, keep_all=True)], "piecewise", 56, True, 64),
    "keep-all request alone (eager, nothing to trim)": (
        lambda: [R("k", 70, 70, keep_all=True)], "eager", 70, False, None),
}


@pytest.mark.parametrize("name", list(COMPOSITIONS))
def test_compositions(shared, name):
    make, kind, padded, trimmed, rpad = COMPOSITIONS[name]
    reqs = make()
    out = compare(shared, reqs)
    rows = out.batch.replay.num_rows if trimmed else None
    check_dispatch(out, kind, padded, trimmed, rows, rpad)
    assert expected_dispatch(out.batch, MAIN_SIZES, REPLAY_SIZES, THRESHOLD) == (kind, padded, trimmed, rows, rpad)
    # keep-all requests keep every row
    kept = {q.req_id: q.query_len for q in reqs if q.keep_all}
    if trimmed and kept:
        qsl = out.batch.replay.view.query_start_loc
        for i, q in enumerate(reqs):
            if q.keep_all:
                assert qsl[i + 1] - qsl[i] == q.query_len


