"""DSv4.1-mini through the compiled backend vs the eager oracle.

The 8-layer config of conftest (window W=16, layers 4..7 replay layers), pieces
compiled with ``compiler="eager"``, graphs emulated on CPU. Main capture sizes for
``max_cudagraph_capture_size=64`` are [1, 2, 4, 8, 16, 24, ..., 64]; replay capture
sizes for W=16 and ``max_num_seqs=4`` are [16, 32, 48, 64]; the trim threshold is 48.
Steps above 64 tokens are eager steps.

Most tests share one captured runner (compiling and capturing costs seconds); tests
that need another configuration build their own after ``torch._dynamo.reset()``.
"""
from __future__ import annotations

import contextlib
import itertools
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from replay_backend.backend import ReplayBackend
from replay_backend.batch import RequestChunk
from replay_backend.reference.compare import max_abs_err, max_abs_err_kv
from replay_backend.counters import counters
from replay_backend.reference.runner import StepRunner
from replay_backend.capture.graphs import GraphLevel, GraphResources, PieceRunner, StaticGraph

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
def _threads(one_thread):
    yield


_shared: dict = {}


def _reset_dynamo():
    torch._dynamo.reset()
    _shared.clear()  # a reset drops the shared runner's compiled code


def build_env(model, **options) -> SimpleNamespace:
    """A captured, serving runner on a fresh backend (``DEFAULTS`` updated by
    ``options``) and an eager oracle runner over the same model."""
    be = ReplayBackend(**{**DEFAULTS, **options})
    rc = StepRunner(model, max_model_len=MAX_MODEL_LEN, backend=be)
    ro = StepRunner(model, max_model_len=MAX_MODEL_LEN)
    summary = rc.capture()
    return SimpleNamespace(model=model, be=be, rc=rc, ro=ro, summary=summary)


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
        for rid in list(r.blocks_given):
            r.free(rid)


def prefill_both(env, reqs):
    for r in (env.rc, env.ro):
        r.prefill_context(reqs, forward=env.model)  # the oracle path in both


def compare(env, reqs, atol=ATOL, free=True, expect=None):
    """One step through both runners (after building the same context); returns the
    compiled runner's StepOutput. ``expect``: exact counter deltas of the compiled step
    (every counter not named must stay put)."""
    prefill_both(env, reqs)
    with (counters.expect(**expect) if expect is not None else contextlib.nullcontext()):
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


def _ceil(sizes, n):
    return min((s for s in sizes if s >= n), default=None)


def expected_dispatch(batch, main_sizes, replay_sizes, threshold, replay_graphs=True):
    """(kind, padded_tokens, trimmed, replay rows or None, replay padded) by the dispatch rules."""
    t = batch.num_tokens
    tp = _ceil(main_sizes, t)
    if tp is not None:
        kind, padded = "piecewise", tp
        trimmed = replay_graphs and tp >= threshold
    else:
        kind, padded = "eager", t
        trimmed = batch.has_trimmable_rows
    if not trimmed:
        return kind, padded, False, None, (tp if kind == "piecewise" else None)
    rows = batch.replay.num_rows
    return kind, padded, True, rows, _ceil(replay_sizes, rows)


def check_dispatch(out, kind, padded, trimmed, rows, rpad):
    assert (out.step.kind, out.step.padded_tokens) == (kind, padded)
    assert out.trim is not None
    assert out.trim.trimmed is trimmed
    if rows is not None:
        assert out.trim.rows == rows
    assert out.trim.padded == rpad
    assert out.trim.graph is (rpad is not None)
    # a graphed main step that trims into a replay graph gathers and scatters in graphs
    assert out.trim.io_graphs is (kind == "piecewise" and trimmed and rpad is not None)


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


def test_outputs_alive_across_the_trim_op_stay_owned(shared):
    """Only the piece that allocates the trim op's outputs (read after the region) is
    read across the trim op; its graph outputs must stay owned (capture/graphs.py)."""
    plan, m = shared.be.model.plan, shared.be.model
    before_trim = plan.main_pieces[-2].name
    assert {r.name for r in m.runners("main") if r.keep_outputs} == {before_trim}
    assert not any(r.keep_outputs for r in m.runners("replay"))


def test_graph_memory_estimate_is_for_before_capture(shared):
    """Refused once serving, by its phase, before it touches anything (that it needs
    CUDA, before capture: test_full_graphs.py)."""
    with pytest.raises(RuntimeError, match=r"estimate_graph_memory\(\) while serving"):
        shared.rc.estimate_graph_memory()


def test_fused_sinkhorn_op_compiles_into_the_replay_region(cfg):
    """The fused Sinkhorn is one opaque custom op inside graph pieces, also in the replay
    region (row-local, so the region check accepts it); same numbers as the reference."""
    from replay_backend.reference import build_model

    fused = build_model(cfg.replace(sinkhorn_impl="fused"))
    env = build_env(fused)
    plan = env.be.model.plan
    assert plan.replay_off_reason is None
    ops = "\n".join(r.source.code for r in env.be.model.runners("replay"))
    assert "dsv41.sinkhorn" in ops
    env.ro = StepRunner(build_model(cfg), max_model_len=MAX_MODEL_LEN)  # the reference model
    compare(env, [R("a", 60, 60), R("b", 1, 30)], expect=dict(trims=1, replay_dispatch={32: 1}))


def test_capture_state(shared):
    m, be = shared.be.model, shared.be
    assert be.frozen and m.serving
    assert len(be.compiled) == 1
    # every size a step can use was captured (a lone decode at size 1 too), replay
    # sizes and the replay region's below-threshold sizes too
    assert set(MAIN_SIZES) <= set(m.captured_sizes("main"))
    below = [s for s in MAIN_SIZES if s < THRESHOLD]
    assert set(REPLAY_SIZES) | set(below) <= set(m.captured_sizes("replay"))
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
    "lone decode": (lambda: [R("a", 1, 77)], "piecewise", 1, False, 1),
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
    want = {"trims": 1} if trimmed else {"untrimmed": 1}
    out = compare(shared, reqs, expect=dict(replay_dispatch={rpad if rpad else "eager": 1}, **want))
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




@pytest.mark.parametrize("make,padded,trimmed,rows,rpad", [
    (lambda: [R("p", 40, 40)], 40, False, None, 40),  # just below the threshold: untrimmed
    (lambda: [R("p", 33, 33)], 40, False, None, 40),
    (lambda: [R("p", 48, 48)], 48, True, 16, 16),  # at the threshold: trimmed
    (lambda: [R("p", 41, 41)], 48, True, 16, 16),  # 41 tokens pad to 48: trims
    # at the threshold with nothing to trim: all rows are replay rows
    (lambda: [R("a", 16, 16), R("b", 16, 40), R("c", 10, 10)], 48, True, 42, 48),
    (lambda: [R("p", 56, 56)], 56, True, 16, 16),  # above
], ids=["40-untrimmed", "33-pads-to-40", "48-trimmed", "41-pads-to-48", "48-nothing-to-trim", "56-trimmed"])
def test_trim_threshold(shared, make, padded, trimmed, rows, rpad):
    want = {"trims": 1} if trimmed else {"untrimmed": 1}
    out = compare(shared, make(), expect=dict(replay_dispatch={rpad: 1}, **want))
    check_dispatch(out, "piecewise", padded, trimmed, rows, rpad)
    if trimmed and not out.batch.has_trimmable_rows:
        assert out.batch.replay.rows == tuple(range(out.batch.num_tokens))


# Replay batches around each replay capture size. With W=16 and threshold 48 a trimming
# step has at least 16 replay rows (a step of >= 41 tokens keeps min(q, 16) >= 16 rows in
# total), so 16 is the smallest row count there is.
@pytest.mark.parametrize("make,rows,rpad", [
    (lambda: [R("p", 50, 50)], 16, 16),
    (lambda: [R("p", 50, 50), R("d", 1, 20)], 17, 32),
    (lambda: [R("p", 30, 30), R("q", 15, 15), R("d", 1, 9)], 32, 32),
    (lambda: [R("p", 40, 40), R("q", 16, 16)], 32, 32),
    (lambda: [R("p", 40, 40), R("q", 16, 16), R("d", 1, 9)], 33, 48),
    (lambda: [R("a", 16, 16), R("b", 16, 16), R("c", 16, 16)], 48, 48),
    (lambda: [R("a", 16, 16), R("b", 16, 16), R("c", 16, 16), R("d", 1, 5)], 49, 64),
    (lambda: [R("a", 16, 16), R("b", 16, 16), R("c", 15, 15), R("d", 1, 5), R("e", 40, 80)], 64, 64),
    (lambda: [R(c, 16, 16) for c in "abcd"], 64, 64),
], ids=["16", "17", "32-a", "32-b", "33", "48", "49", "64-eager-step", "64"])
def test_replay_capture_size_dispatch(shared, make, rows, rpad):
    reqs = make()
    out = compare(shared, reqs, expect=dict(trims=1, replay_dispatch={rpad: 1}))
    assert out.trim.trimmed and out.trim.rows == rows == out.batch.replay.num_rows
    assert out.trim.padded == rpad and out.trim.graph
    assert expected_dispatch(out.batch, MAIN_SIZES, REPLAY_SIZES, THRESHOLD)[2:] == (True, rows, rpad)


@pytest.mark.parametrize("make,rows", [
    (lambda: [R("k", 60, 60, keep_all=True), R("p", 60, 60), R("k2", 30, 80, keep_all=True)], 106),
    (lambda: [R("a", 16, 16), R("b", 16, 16), R("c", 16, 16), R("d", 16, 16), R("p", 30, 30)], 80),
    (lambda: [R("a", 16, 16), R("b", 16, 16), R("c", 16, 16), R("d", 1, 3), R("p", 30, 70)], 65),
], ids=["106-keep-all", "80", "65"])
def test_replay_rows_above_largest_size_run_eagerly(shared, make, rows):
    out = compare(shared, make(), expect=dict(trims=1, replay_dispatch={"eager": 1}))
    assert out.step.kind == "eager"
    assert out.trim.trimmed and out.trim.rows == rows
    assert out.trim.padded is None and out.trim.graph is False


def test_fixed_buffers_are_reused(shared):
    m = shared.be.model
    assert sorted(m.inputs.buffers) == sorted(m.token_inputs) and len(m.token_inputs) == 2
    ptrs = {i: b.data_ptr() for i, b in m.inputs.buffers.items()}
    first = m.runners("main")[0]
    graph = first.graphs[40]
    rfirst = m.runners("replay")[0]
    rgraph = rfirst.graphs[32]
    replays, rreplays = graph.replays, rgraph.replays
    # two consecutive PIECEWISE steps of padded size 40 (untrimmed), then two trimmed
    # steps whose replay batches pad to 32
    for make in (lambda: [R("p", 40, 40)], lambda: [R("q", 35, 35), R("d", 1, 12)],
                 lambda: [R("p", 50, 50), R("d", 1, 20)], lambda: [R("p", 40, 40), R("q", 16, 16)]):
        compare(shared, make())
    assert {i: b.data_ptr() for i, b in m.inputs.buffers.items()} == ptrs
    assert first.graphs[40] is graph and rfirst.graphs[32] is rgraph  # no re-capture
    assert graph.replays == replays + 2 and rgraph.replays == rreplays + 2
    # the captured graphs read slices of the persistent buffers
    for i in m.token_inputs:
        assert any(isinstance(a, torch.Tensor) and a.data_ptr() == ptrs[i] for a in graph.inputs)
    bufs = m.replay.buffers
    assert any(isinstance(a, torch.Tensor) and a.data_ptr() == bufs[0].data_ptr() for a in rgraph.inputs)


def test_stale_main_rows_do_not_leak(shared):
    m = shared.be.model
    ids = m.token_inputs[0]
    compare(shared, [R("big", 40, 40)])  # fills all 40 rows
    out = compare(shared, [R("q", 30, 30), R("d", 1, 10), R("e", 2, 2)])  # 33 rows, same size 40
    assert out.step.padded_tokens == 40 and not out.trim.trimmed
    # the 7 pad rows were reset, not left over from the 40-token step
    assert (m.inputs.buffers[ids][33:40] == 0).all()


def test_padded_rows_are_zero_after_longer_and_shorter_steps(shared):
    """Padded input rows are cleared only where an earlier, longer step wrote them
    (CompiledReplayModel._written): after every step of a mixed sequence each token
    input's padded rows are zero, its real rows the step's inputs."""
    m = shared.be.model
    for n in (40, 10, 20, 33, 5, 5, 40, 12):
        out = compare(shared, [R(f"z{n}", n, n)])
        tp = out.step.padded_tokens
        assert out.step.kind == "piecewise" and tp >= n
        real = sorted(tuple(x.tolist()) for x in (out.batch.input_ids, out.batch.positions))
        assert sorted(tuple(m.inputs.buffers[i][:n].tolist()) for i in m.token_inputs) == real
        for i in m.token_inputs:
            assert not m.inputs.buffers[i][n:tp].any(), (n, tp, i)


def test_stale_replay_rows_do_not_leak(shared):
    m = shared.be.model
    first = compare(shared, [R("a", 15, 15), R("p", 40, 40)])
    assert (first.trim.rows, first.trim.padded) == (31, 32)
    out = compare(shared, [R("q", 50, 50), R("d", 1, 20)])
    assert (out.trim.rows, out.trim.padded) == (17, 32)
    # rows 17..31 of the replay buffers are padding (copies of rows an earlier step left
    # in the gather graph's index, else the previous step's rows): computed on and
    # discarded, and the comparison above saw none of it
    stale = m.replay.buffers[0][17:31]
    assert (stale != 0).any()


@pytest.mark.parametrize("make, kind, rows, rpad, io", [
    (lambda: [R("d", 1, 70), R("p", 50, 50), R("c", 10, 40)], "piecewise", 27, 32, True),  # 61 -> 64
    (lambda: [R("p", 70, 70), R("d", 1, 30)], "eager", 17, 32, False),  # 71 tokens: main without graphs
])
def test_served_trims_execute_their_plan(shared, make, kind, rows, rpad, io):
    """Served steps that trim into a replay graph, with the gathers and scatter as graphs
    or as one row-moves launch each way, run the plan decided before the step: the
    record, the counters and the outputs (against the oracle) say so."""
    reqs = make()
    prefill_both(shared, reqs)
    with counters.expect(trims=1, replay_dispatch={rpad: 1}):
        out = shared.rc.step(reqs)
    assert (out.step.kind, out.trim.rows, out.trim.padded, out.trim.graph, out.trim.io_graphs) == (kind, rows, rpad, True, io)
    check_outputs(shared, out, shared.ro.step(reqs))


def test_served_steps_give_the_gather_graphs_their_rows_in_place(shared):
    """A served step's metadata is built at the head of the runner's metadata buffer,
    where the gather graphs read the count and rows: nothing is copied for them. Past
    the real rows the graph reads the step's next metadata field (slot numbers, here
    beyond the 48-token main size): clamped, they only fill padding, and the step
    matches the oracle."""
    io, meta = shared.be.model.replay.io, shared.be.metadata
    assert io.index.data_ptr() == meta.data.data_ptr()
    out = compare(shared, [R("z", 40, 40), R("d", 1, 20), R("e", 6, 6)], expect=dict(
        trims=1, replay_dispatch={32: 1}))  # trim_index_copies stays put
    assert (out.step.padded_tokens, out.trim.rows, out.trim.padded) == (48, 23, 32)
    assert out.trim.io_graphs and out.batch.replay.count_rows.data_ptr() == io.index_ptr
    assert io.index[1 + 23:1 + 32].max().item() >= 48  # out of range for the main size


def test_a_batch_built_elsewhere_is_staged_and_invalidates_the_buffer(shared):
    """A batch in fresh memory, built for the serving runner's blocks outside its compiled
    model (``build_step_batch`` with ``owner=`` the runner: a runner runs only its own
    batches), run on it: its rows are copied to the buffer's head over whatever an
    earlier step left there (a longer step's rows 48..63, out of range for this 48-token
    step: clamped), it matches the oracle, and the runner's own last batch, whose head
    that copy overwrote, is refused instead of run on another step's rows."""
    from replay_backend.batch import build_step_batch

    rc, io = shared.rc, shared.be.model.replay.io
    reqs = [R("z", 40, 40), R("d", 1, 20), R("e", 6, 6)]
    prefill_both(shared, reqs)  # steps of their own, before the longer step
    first = compare(shared, [R("x", 30, 30), R("y", 34, 34)])
    assert (first.step.padded_tokens, first.trim.rows, first.trim.padded) == (64, 32, 32)
    assert io.index[1 + 16:1 + 32].min().item() >= 48  # index[0]: the count
    with torch.inference_mode():
        elsewhere = build_step_batch(reqs, [rc.tokens(r.req_id, r.context_len, r.seq_len) for r in reqs],
                                     [rc.block_of(r.req_id) for r in reqs], rc.layout, rc.cfg.window, rc.device,
                                     view_fields=rc.view_fields, owner=rc)
    assert elsewhere.metadata is None
    with counters.expect(trims=1, replay_dispatch={32: 1}, trim_index_copies=1):
        got = rc.run(elsewhere)
    check_outputs(shared, got, shared.ro.step(reqs))
    assert (got.step.padded_tokens, got.trim.rows, got.trim.padded) == (48, 23, 32)
    assert got.trim.io_graphs and io.index[1 + 23:1 + 32].min().item() >= 48  # the earlier rows
    own = rc.build_batch(reqs)
    rc.run(elsewhere)
    with pytest.raises(RuntimeError, match="stale StepBatch.*built elsewhere"):
        rc.run(own)


def test_a_metadata_buffer_too_small_for_the_replay_rows_is_a_counted_fallback():
    from replay_backend.fallbacks import StrictFallbackError
    from replay_backend.dispatch.trim_io import TrimIO
    from replay_backend.step_metadata import MetadataBuffer

    io = TrimIO(32, 64, torch.device("cpu"), GraphResources(use_cuda=False))
    own = io.index_ptr
    with counters.expect(fallbacks={"trim_index_in_place": 1}):
        io.adopt(MetadataBuffer(32, "cpu"))  # 33 entries needed: the count and 32 rows
    assert io.metadata is None and io.index_ptr == own
    io.adopt(MetadataBuffer(33, "cpu"))
    assert io.metadata is not None and io.index_ptr == io.metadata.data.data_ptr()
    strict = TrimIO(32, 64, torch.device("cpu"), GraphResources(use_cuda=False, strict=True))
    with pytest.raises(StrictFallbackError, match="trim_index_in_place.*cannot hold 33"):
        strict.adopt(MetadataBuffer(8, "cpu"))


def test_a_batch_overwritten_by_a_later_build_is_refused(shared):
    reqs_a, reqs_b = [R("a", 30, 30)], [R("b", 8, 8)]
    a = shared.rc.build_batch(reqs_a)
    b = shared.rc.build_batch(reqs_b)
    assert a.replay.count_rows.data_ptr() == b.replay.count_rows.data_ptr()
    with counters.expect(), pytest.raises(RuntimeError, match="stale StepBatch.*later build_batch"):
        shared.rc.run(a)
    got = shared.rc.run(b)
    shared.ro.build_batch(reqs_a)  # the same cache blocks as in the compiled runner
    check_outputs(shared, got, shared.ro.step(reqs_b))


def test_trim_gathers_and_scatter_run_as_graphs(shared):
    """Every trimming main size x replay size has a gather and a scatter graph; a step
    through them matches the oracle, and the trimmed rows of its output are zeros."""
    io = shared.be.model.replay.io
    assert set(io.graphs) == {(s, r) for s in (48, 56, 64) for r in REPLAY_SIZES}
    assert shared.summary["replay"]["trim_io_graphs"] == 2 * len(io.graphs)
    reqs = [R("d", 1, 70), R("p", 50, 50), R("c", 10, 40)]  # 61 tokens -> 64; 27 replay rows -> 32
    prefill_both(shared, reqs)
    gather, scatter = io.graphs[(64, 32)]
    replays = gather.replays, scatter.replays
    seen = {}

    def spy(*args):  # the model's output, as the runner reads it
        seen["hidden"] = shared.rc.compiled(*args)
        return seen["hidden"]

    got = shared.rc.step(reqs, forward=spy)
    check_outputs(shared, got, shared.ro.step(reqs))
    assert got.trim.io_graphs and (got.trim.rows, got.trim.padded) == (27, 32)
    assert (gather.replays, scatter.replays) == (replays[0] + 1, replays[1] + 1)
    kept = set(got.batch.replay.rows)
    trimmed = [i for i in range(got.batch.num_tokens) if i not in kept]
    hidden = seen["hidden"]
    assert trimmed and (hidden[trimmed] == 0).all()
    assert (hidden[sorted(kept)].abs().sum(-1) > 0).all()
    for r in (shared.rc, shared.ro):
        for q in reqs:
            r.free(q.req_id)


def test_steps_through_the_compiled_runner_keep_caches_exact(shared):
    """Chunked prefills, decodes and new prompts, every step through the compiled
    runner (its trimmed steps skip the replay layers' KV of dead rows): each step and
    the caches it leaves must agree with the oracle."""
    a, b, c = (f"{n}#{next(_ids)}" for n in "abc")
    rc, ro = shared.rc, shared.ro
    steps = [
        [RequestChunk(a, 48, 48)],  # piecewise 48, trimmed
        [RequestChunk(a, 30, 78), RequestChunk(b, 10, 10)],  # piecewise 40, untrimmed
        [RequestChunk(a, 22, 100), RequestChunk(b, 1, 11), RequestChunk(c, 70, 70)],  # eager 93
        [RequestChunk(a, 1, 101), RequestChunk(b, 1, 12), RequestChunk(c, 1, 71)],
        [RequestChunk(a, 2, 103), RequestChunk(b, 45, 57), RequestChunk(c, 1, 72)],  # 48, trimmed
        [RequestChunk(a, 1, 104), RequestChunk(b, 1, 58), RequestChunk(c, 1, 73)],
    ]
    kinds = []
    for reqs in steps:
        got, want = rc.step(reqs), ro.step(reqs)
        check_outputs(shared, got, want)
        kinds.append((got.step.kind, got.trim.trimmed))
    assert kinds == [("piecewise", True), ("piecewise", False), ("eager", True), ("piecewise", False),
                     ("piecewise", True), ("piecewise", False)]


def test_no_recompiles_after_capture(shared):
    be = shared.be
    assert be.frozen
    sizes = [1, 2, 3, 5, 9, 16, 17, 25, 33, 40, 41, 49, 57, 63, 64, 65, 90, 120]
    with counters.expect(strict=False, recompiles=0, graphs_seen=0, compilations=0, captures={},
                         fallbacks={}, pieces={}):
        for n in sizes:
            out = compare(shared, [R("x", n, n + 3)])
            assert out.step.kind == ("piecewise" if n <= 64 else "eager")
    assert len(be.compiled) == 1


@st.composite
def compositions(draw):
    n = draw(st.integers(1, 4))
    reqs, room = [], 120
    for i in range(n):
        most = room - (n - i - 1)  # leave a token for each request still to come
        kind = draw(st.sampled_from(["decode", "spec", "prefill", "chunk", "keep"]))
        keep, kv_start = False, None
        if kind == "decode":
            q, s = 1, draw(st.integers(1, 150))
        elif kind == "spec":
            q = draw(st.integers(2, max(2, min(4, most))))
            s = draw(st.integers(q, 150))
        elif kind == "prefill":
            q = draw(st.integers(1, max(1, min(90, most))))
            s = q
        elif kind == "chunk":
            q = draw(st.integers(1, max(1, min(70, most))))
            s = q + draw(st.integers(1, 100))
        else:
            q = draw(st.integers(1, max(1, min(70, most))))
            s = q + draw(st.integers(0, 40))
            keep = True
        q = min(q, most)
        s = max(s, q)
        if kind in ("prefill", "chunk") and q > 16 and draw(st.booleans()):
            kv_start = draw(st.integers(s - 16, s - 1))
        reqs.append(R(f"r{i}", q, s, keep_all=keep, kv_start=kv_start))
        room -= q
    return reqs


@settings(max_examples=10, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(reqs=compositions())
def test_random_compositions_match_the_oracle(shared, reqs):
    assert sum(r.query_len for r in reqs) <= 120
    try:
        out = compare(shared, reqs)
        check_dispatch(out, *expected_dispatch(out.batch, MAIN_SIZES, REPLAY_SIZES, THRESHOLD))
    finally:
        for r in (shared.rc, shared.ro):
            for q in reqs:
                r.free(q.req_id)


# ======================================================================================
# Other configurations (each builds its own backend)
# ======================================================================================
def test_without_replay_graphs(model):
    """cudagraph_decoder_replay=False: PIECEWISE steps never trim; eager steps trim,
    eagerly. Context is prefilled before capture: capture must not disturb the caches."""
    early = [R("e", 1, 60), R("f", 20, 90)]
    be = ReplayBackend(**{**DEFAULTS, "cudagraph_decoder_replay": False})
    rc = StepRunner(model, max_model_len=MAX_MODEL_LEN, backend=be)
    ro = StepRunner(model, max_model_len=MAX_MODEL_LEN)
    env = SimpleNamespace(model=model, be=be, rc=rc, ro=ro)
    prefill_both(env, early)
    rc.capture()
    plan = be.model.plan
    assert plan.replay_capture_sizes == [] and plan.replay_layers == [4, 7]
    assert plan.pieces_by_kind("main")["replay"] == 1
    # the replay region runs in graphs of the main sizes when untrimmed
    assert set(MAIN_SIZES) - {1} <= set(be.model.captured_sizes("replay"))

    got, want = rc.step(early), ro.step(early)  # piecewise 24, context from before capture
    check_outputs(env, got, want)
    for make, kind, padded in [
        (lambda: [R("p", 50, 50)], "piecewise", 56),
        (lambda: [R("d", 1, 70), R("p", 50, 50), R("c", 10, 40)], "piecewise", 64),
        (lambda: [R(c, 16, 16) for c in "abcd"], "piecewise", 64),
    ]:
        out = compare(env, make(), expect=dict(untrimmed=1, replay_dispatch={padded: 1}))
        check_dispatch(out, kind, padded, False, None, padded)
        assert expected_dispatch(out.batch, MAIN_SIZES, [], THRESHOLD, replay_graphs=False)[2] is False
    for make, rows in [(lambda: [R("a", 100, 100)], 16),
                       (lambda: [R("k", 60, 60, keep_all=True), R("p", 60, 60)], 76),
                       (lambda: [R("d", 1, 20), R("p", 40, 100, kv_start=70), R("c", 35, 35)], 33)]:
        out = compare(env, make(), expect=dict(trims=1, replay_dispatch={"eager": 1}))
        check_dispatch(out, "eager", out.batch.num_tokens, True, rows, None)
    # an eager step with nothing to trim runs the region on the whole batch
    out = compare(env, [R("k", 70, 70, keep_all=True)], expect=dict(untrimmed=1, replay_dispatch={"eager": 1}))
    check_dispatch(out, "eager", 70, False, None, None)


def test_trim_io_graphs_switched_off(model):
    """trim_io_graphs=false: graphed steps trim through eager gathers and scatter, with
    the same results and the same dispatch otherwise."""
    env = build_env(model, trim_io_graphs=False)
    assert env.be.model.replay.io is None and env.summary["replay"]["trim_io_graphs"] == 0
    for make, rows, rpad in [(lambda: [R("d", 1, 70), R("p", 50, 50), R("c", 10, 40)], 27, 32),
                             (lambda: [R("p", 40, 40), R("q", 16, 16)], 32, 32)]:
        out = compare(env, make(), expect=dict(trims=1, replay_dispatch={rpad: 1}))
        assert (out.trim.rows, out.trim.padded, out.trim.graph, out.trim.io_graphs) == (rows, rpad, True, False)


def test_metadata_in_place_switched_off(model):
    """metadata_in_place=false: served batches are in fresh memory (two can be built
    before either runs), and every graphed trimming step copies its count and rows to
    the gather graphs' own index, with the same results."""
    env = build_env(model, metadata_in_place=False)
    io = env.be.model.replay.io
    assert env.be.metadata is None and io.metadata is None
    first, second = [R("d", 1, 70), R("p", 50, 50), R("c", 10, 40)], [R("p", 40, 40), R("q", 16, 16)]
    prefill_both(env, first + second)
    a, b = env.rc.build_batch(first), env.rc.build_batch(second)
    for batch, reqs, rows in [(a, first, 27), (b, second, 32)]:
        with counters.expect(trims=1, replay_dispatch={32: 1}, trim_index_copies=1):
            out = env.rc.run(batch)
        check_outputs(env, out, env.ro.step(reqs))
        assert (out.trim.rows, out.trim.padded, out.trim.io_graphs) == (rows, 32, True)
        assert torch.equal(io.index[:rows + 1], batch.replay.count_rows)


def test_cudagraph_mode_none(model):
    """cudagraph_mode="none": every step is eager, no graph is captured, and steps
    trim exactly when a prefill is longer than W."""
    with counters.expect(strict=False, captures={}):
        env = build_env(model, cudagraph_mode="none")
    plan = env.be.model.plan
    assert plan.capture_sizes == [] and plan.replay_capture_sizes == []
    assert plan.pieces_by_kind("main") == {"graph": 5, "attention": 4, "replay": 1}
    assert env.be.model.captured_sizes("main") == [] and env.be.model.captured_sizes("replay") == []
    for make, trimmed in [
        (lambda: [R("a", 1, 30), R("b", 1, 2)], False),
        (lambda: [R("p", 40, 40)], True),  # would be an untrimmed PIECEWISE step with graphs
        (lambda: [R("d", 1, 70), R("p", 50, 50), R("c", 10, 40)], True),
        (lambda: [R("a", 16, 16), R("b", 16, 40), R("c", 10, 10)], False),
        (lambda: [R("s", 3, 50), R("t", 3, 20), R("p", 30, 30), R("u", 2, 9)], True),
        (lambda: [R("a", 100, 100)], True),
        (lambda: [R("k", 60, 60, keep_all=True), R("p", 60, 60)], True),
    ]:
        with counters.expect(strict=False, captures={}, fallbacks={}):
            out = compare(env, make())
        assert out.step.kind == "eager"
        assert out.step.padded_tokens == max(out.batch.num_tokens, 2)
        rows = out.batch.replay.num_rows if trimmed else None
        check_dispatch(out, "eager", out.step.padded_tokens, trimmed, rows, None)
        assert out.trim.trimmed == out.batch.has_trimmable_rows


def test_small_replay_bound_and_address_checks(model):
    """max_num_seqs=2: replay sizes [16, 32], so a trimming PIECEWISE step with more
    than 32 replay rows runs the region eagerly. debug_check_addresses: every replay of
    every graph checks its input addresses, across many steps."""
    env = build_env(model, max_num_seqs=2, debug_check_addresses=True)
    assert env.be.model.plan.replay_capture_sizes == [16, 32]
    assert env.be.config.debug_check_addresses and env.be.model.res.check_every_replay
    cases = [
        (lambda: [R("p", 50, 50), R("d", 1, 20)], "piecewise", 17, 32),
        (lambda: [R("p", 40, 40), R("q", 16, 16), R("d", 1, 9)], "piecewise", 33, None),
        (lambda: [R("a", 16, 16), R("b", 16, 16), R("c", 16, 16)], "piecewise", 48, None),
        (lambda: [R("k", 30, 30, keep_all=True), R("k2", 20, 50, keep_all=True)], "piecewise", 50, None),
        (lambda: [R("a", 100, 100)], "eager", 16, 16),
        (lambda: [R("a", 40, 100, kv_start=90), R("b", 1, 20), R("c", 35, 35, kv_start=25)], "eager", 33, None),
        (lambda: [R("a", 1, 30), R("b", 1, 2)], "piecewise", None, None),
        (lambda: [R("p", 40, 40)], "piecewise", None, None),
    ]
    for make, kind, rows, rpad in cases * 2:  # the second round replays every graph again
        reqs = make()
        out = compare(env, reqs)
        want = expected_dispatch(out.batch, MAIN_SIZES, [16, 32], THRESHOLD)
        check_dispatch(out, *want)
        assert out.step.kind == kind
        if rows is not None:
            assert (out.trim.trimmed, out.trim.rows, out.trim.padded) == (True, rows, rpad)
    checked = [g.replays for r in env.be.model.runners("main") + env.be.model.runners("replay")
               for g in r.graphs.values()]
    assert max(checked) >= 3


def test_recompile_after_freeze_is_an_error(model):
    import dataclasses

    env = build_env(model, cudagraph_mode="none")
    batch = env.rc.build_batch([R("a", 5, 5)])
    # a different dtype for the token ids: the graph would have to be traced again
    with torch.inference_mode():
        odd = dataclasses.replace(batch, input_ids=batch.input_ids.to(torch.int32))
    with pytest.raises(ValueError, match="input_ids is torch.int32.*needs a new trace, which is an error once serving"):
        env.rc.run(odd)
    assert len(env.be.compiled) == 1
    # and the backend itself refuses a second graph once frozen
    gm = torch.fx.symbolic_trace(torch.nn.ReLU())
    with counters.expect(recompiles=1, graphs_seen=1), pytest.raises(RuntimeError, match="recompile after warm-up"):
        env.be(gm, [torch.randn(3)])
    assert len(env.be.compiled) == 1


def test_replays_in_region_only_with_one_graph_that_has_a_region(model):
    """A runner may leave the whole batch's replay-layer plans to the region only while
    every step's replay layers run in it: not before the first compile, and not once a
    second graph (a recompile during warm-up) may run steps without the region."""
    be = ReplayBackend(**{**DEFAULTS, "cudagraph_mode": "none"})
    rc = StepRunner(model, max_model_len=MAX_MODEL_LEN, backend=be)
    assert not be.replays_in_region
    rc.run(rc.build_batch([R("a", 5, 5)]), use_graphs=False)
    assert be.replays_in_region
    with counters.expect(recompiles=1, graphs_seen=1, pieces={"graph": 1}):
        be(torch.fx.symbolic_trace(torch.nn.ReLU()), [torch.randn(3)])
    assert len(be.compiled) == 2 and not be.replays_in_region


# ======================================================================================
# Static graphs: recorded input addresses
# ======================================================================================
def _fn(x, w):
    return (x @ w + 1,)


def test_static_graph_replays_on_capture_buffers():
    res = GraphResources(use_cuda=False)
    x, w = torch.randn(4, 3), torch.randn(3, 2)
    g = StaticGraph("toy[4]", _fn, (x, w), res)
    out = g.replay((x, w))[0]
    torch.testing.assert_close(out, x @ w + 1)
    x.add_(1.0)  # new data, same address: the replay sees it and writes the same output
    out2 = g.replay((x, w))[0]
    assert out2.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out2, x @ w + 1)


def test_static_graph_first_replay_checks_input_addresses():
    res = GraphResources(use_cuda=False)
    x, w = torch.randn(4, 3), torch.randn(3, 2)
    g = StaticGraph("toy[4]", _fn, (x, w), res)
    with pytest.raises(RuntimeError, match="input 0 changed since capture"):
        g.replay((x.clone(), w))


def test_static_graph_debug_mode_checks_every_replay():
    res = GraphResources(use_cuda=False, check_every_replay=True)
    x, w = torch.randn(4, 3), torch.randn(3, 2)
    g = StaticGraph("toy[4]", _fn, (x, w), res)
    for _ in range(3):
        g.replay((x, w))
    with pytest.raises(RuntimeError, match="input 1 changed since capture"):
        g.replay((x, w.clone()))


@pytest.mark.parametrize("fails", [False, True])
def test_static_graph_capture_pauses_automatic_collection(fails):
    """Collection is off while a graph captures (a collection that frees a dropped graph
    would invalidate a CUDA capture: the GPU test stages that) and back on after,
    also when the piece raises; a caller that had turned it off keeps it off."""
    import gc

    seen = []

    def piece(x, w):
        seen.append(gc.isenabled())
        if fails:
            raise ValueError("piece failed")
        return _fn(x, w)

    x, w = torch.randn(4, 3), torch.randn(3, 2)
    for enabled in (True, False):
        (gc.enable if enabled else gc.disable)()
        try:
            if fails:
                with pytest.raises(ValueError, match="piece failed"):
                    StaticGraph("toy[4]", piece, (x, w), GraphResources(use_cuda=False))
            else:
                StaticGraph("toy[4]", piece, (x, w), GraphResources(use_cuda=False))
            assert gc.isenabled() is enabled
        finally:
            gc.enable()
    assert seen == [False, False]


def test_static_graph_capture_frees_garbage_only_after_the_capture():
    """The GPU test's case on the CPU: a reference cycle that becomes garbage while a
    graph captures, with a collection due at every allocation, is freed after the
    capture, not inside it (where destroying a CUDA graph invalidates the capture)."""
    import gc

    freed, capturing = [], [False]

    class Sentinel:  # stands in for a dropped runner's CUDA graph
        def __del__(self):
            freed.append(capturing[0])

    gc.collect()  # the cycle below starts in the youngest generation
    holder = [[Sentinel()]]
    holder[0].append(holder[0])
    thresholds = gc.get_threshold()

    def piece(x, w):
        capturing[0] = True
        holder.clear()
        gc.set_threshold(1, 1, 1)
        [[i] for i in range(2000)]  # allocations, each of which would start a collection
        capturing[0] = False
        return _fn(x, w)

    try:
        StaticGraph("toy[4]", piece, (torch.randn(4, 3), torch.randn(3, 2)), GraphResources(use_cuda=False))
        gc.collect()
    finally:
        gc.set_threshold(*thresholds)
    assert freed == [False]


def test_piece_runner_debug_mode_detects_a_moved_input():
    res = GraphResources(use_cuda=False, check_every_replay=True)
    level = GraphLevel("main", [4], size=4)
    runner = PieceRunner("toy", _fn, level, res)
    x, w = torch.randn(4, 3), torch.randn(3, 2)
    runner(x, w)  # capture
    runner(x, w)
    with pytest.raises(RuntimeError, match="changed since capture"):
        runner(x.clone(), w)


def test_piece_runner_first_serving_replay_detects_a_moved_input():
    """On CPU the capture call returns the captured outputs without a replay, so the
    first serving step is the graph's first replay and its address check sees a moved
    input (checked on the first replay of every graph, always)."""
    res = GraphResources(use_cuda=False)
    level = GraphLevel("main", [4], size=4)
    runner = PieceRunner("toy", _fn, level, res)
    x, w = torch.randn(4, 3), torch.randn(3, 2)
    with counters.expect(strict=False, captures={"main": 1}):
        out = runner(x, w)[0]  # capture
    torch.testing.assert_close(out, x @ w + 1)
    with pytest.raises(RuntimeError, match="changed since capture"):
        runner(x.clone() + 5, w)


def test_piece_runner_uncaptured_size_after_serving_is_a_counted_fallback():
    from replay_backend.fallbacks import StrictFallbackError

    from replay_backend.lifecycle import Lifecycle, Phase

    x, w = torch.randn(4, 3), torch.randn(3, 2)
    level = GraphLevel("main", [4, 8])
    serving = Lifecycle()
    for phase in (Phase.WARMING, Phase.SERVING):
        serving.advance(phase)
    res = GraphResources(use_cuda=False, lifecycle=serving)
    runner, second = PieceRunner("toy", _fn, level, res), PieceRunner("toy2", _fn, level, res)
    for _ in range(2):  # two steps of two pieces each: one count a step, not one a piece
        with counters.expect(fallbacks={"uncaptured_size": 1}), level.at(4):
            out = runner(x, w)[0]
            second(x, w)
    torch.testing.assert_close(out, x @ w + 1)
    assert runner.graphs == {}
    strict = PieceRunner("toy", _fn, level, GraphResources(use_cuda=False, strict=True, lifecycle=serving))
    with pytest.raises(StrictFallbackError, match="uncaptured_size"), level.at(4):
        strict(x, w)


def test_threshold_above_largest_capture_size_is_warned(model, caplog):
    torch._dynamo.reset()
    be = ReplayBackend(compiler="eager", max_num_seqs=4, max_cudagraph_capture_size=32,
                       decoder_replay_trim_threshold=48)
    runner = StepRunner(model, max_model_len=256, backend=be)
    with caplog.at_level("WARNING", logger="replay_backend"):
        out = runner.step([RequestChunk("a", 30, 30)])
    assert any("PIECEWISE steps never trim" in r.getMessage() for r in caplog.records)
    assert out.step.kind == "piecewise" and not out.trim.trimmed
    torch._dynamo.reset()
