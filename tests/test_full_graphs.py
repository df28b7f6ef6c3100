"""FULL graphs (``cudagraph_mode`` full, full_decode_only, full_and_piecewise): which
steps run as one FULL graph, and that they compute what the eager model computes.

Without CUDA a FULL graph is emulated: its replay re-runs the captured step under the
captured step's forward context, so an attention op that reads a host value inside
one gives a wrong answer here too. Every served step is checked against the eager
model of the same weights (the oracle), its logits and the KV it wrote; the FULL and
PIECEWISE runs of one step are checked to the bit. The reference model and a toy
model (tests/full_toy.py, whose attention ops declare each ``CudagraphSupport``)."""
from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch
import torch.distributed as dist

import replay_backend
from replay_backend import ReplayBackend, ReplayConfig, StepKind, build_step_batch, counters
from replay_backend import RequestChunk as R
from replay_backend.fallbacks import StrictFallbackError
from replay_backend.passes.roles import CudagraphSupport
from replay_backend.reference import build_model, preset
from replay_backend.reference.compare import max_abs_err, max_abs_err_kv
from replay_backend.reference.runner import StepRunner
from full_toy import ToyModel, toy_cache
from own_server import OwnServer
from ranks import run_ranks

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_dynamo")

FULL, PIECEWISE, EAGER = StepKind.FULL, StepKind.PIECEWISE, StepKind.EAGER
# Six layers: 0 SWA, 1 the ratio-2 KV source, 2 global, the cut after layer 2, 3..5 replay.
CFG = preset("tiny").with_layers(6, (1, 2)).replace(window=16)
SIZES = [1, 2, 4, 8, 16, 32, 64, 128]
OPTS = dict(compiler="eager", max_num_seqs=4, cudagraph_capture_sizes=SIZES, decoder_replay_trim_threshold=64)
MAX_MODEL_LEN = 256
TOL = 1e-4


@pytest.fixture(scope="module")
def model():
    return build_model(CFG)


def runner(model, **options) -> StepRunner:
    """A runner of ``model`` compiled with a backend of ``OPTS`` and ``options``; no
    backend given: the oracle."""
    backend = ReplayBackend(**{**OPTS, **options}) if options else None
    return StepRunner(model, max_model_len=MAX_MODEL_LEN, max_num_seqs=OPTS["max_num_seqs"], backend=backend)


def kv_err(got: StepRunner, want: StepRunner, out) -> float:
    """The largest difference of the KV the step wrote that a later step reads: every
    slot of the layers before the cut (the pad slot aside, which padded rows write),
    the kept rows' slots of the replay layers (``max_abs_err_kv``)."""
    caches = [(got.kv.swa[layer], want.kv.swa[layer]) for layer in range(min(CFG.replay_layers))]
    caches += [(got.kv.glob[k], want.kv.glob[k]) for k in got.kv.glob]
    caches += [(got.kv.raw[k], want.kv.raw[k]) for k in got.kv.raw]
    return max(max_abs_err_kv(got.kv, want.kv, out.batch), *(max_abs_err(a[:-1], b[:-1]) for a, b in caches))


def same_step(got, want, rc: StepRunner, ro: StepRunner) -> None:
    """The step's logits, prompt logprobs and KV match the oracle's."""
    err, kv = max_abs_err(got.logits, want.logits), kv_err(rc, ro, got)
    assert got.prompt_logprobs.keys() == want.prompt_logprobs.keys()
    for k in want.prompt_logprobs:
        err = max(err, max_abs_err(got.prompt_logprobs[k], want.prompt_logprobs[k]))
    assert err <= TOL and kv <= TOL, (got.result, err, kv)


# ---- full_and_piecewise: FULL below the threshold, PIECEWISE from it, eager above ------
# (step, kind, padded tokens, trimmed). Capture sizes 1 .. 128, threshold 64: FULL
# graphs at 1 .. 32; W = 16, so a chunk of more than 16 tokens has rows to trim.
SERVED = [
    ([R("a", 20, 20)], FULL, 32, False),  # a prefill below the threshold: nothing trims
    ([R("a", 1, 21)], FULL, 1, False),  # a lone decode
    ([R("b", 10, 10, keep_all=True), R("a", 1, 22)], FULL, 16, False),  # a prompt with its logprobs, a decode
    ([R("c", 3, 3), R("d", 2, 2)], FULL, 8, False),  # two small prompts
    ([R("a", 1, 23), R("b", 1, 11), R("c", 1, 4), R("d", 1, 3)], FULL, 4, False),  # four decodes
    ([R("a", 1, 24), R("b", 1, 12), R("c", 1, 5)], FULL, 4, False),  # three, at the same size
    ([R("a", 3, 27), R("b", 3, 15), R("c", 3, 8)], FULL, 16, False),  # speculative: 3 tokens each
    ([R("a", 3, 30), R("b", 3, 18)], FULL, 8, False),  # two of them, at a size seen with two prompts
    ([R("a", 1, 31), R("d", 39, 41)], PIECEWISE, 64, True),  # 40 pad to 64, the threshold: trims
    ([R("c", 130, 138)], EAGER, 130, True),  # above the largest size: eager, trims
    ([R("c", 1, 139), R("b", 6, 24, kv_start=21)], FULL, 8, False),  # a long context; a later floor
    ([R("a", 1, 32), R("b", 1, 25)], FULL, 2, False),
    ([R("a", 1, 33)], FULL, 1, False),  # the size-1 graph again, on the new metadata
]


def test_full_and_piecewise_runs_small_steps_as_full_graphs_matching_the_oracle(model):
    """strict: any fallback (a FULL graph not captured, a downgrade) would raise."""
    rc, ro = runner(model, cudagraph_mode="full_and_piecewise", strict=True), runner(model)
    summary = rc.capture()
    assert rc.backend.model.full_policy.sizes == (1, 2, 4, 8, 16, 32)
    assert (summary["full"]["sizes"], summary["full"]["graphs"]) == (6, 6)
    assert summary["main"]["sizes"] == len(SIZES) and summary["main"]["graphs"] > 0
    assert summary["replay"]["graphs"] > 0
    for step, kind, padded, trimmed in SERVED:
        got, want = rc.step(step), ro.step(step)
        result = got.result
        assert (result.kind, result.padded_tokens, result.trimmed) == (kind, padded, trimmed), step
        assert result.num_tokens == sum(r.query_len for r in step)
        if kind is FULL:  # the replay layers ran inside the one graph, on every row
            assert result.replay_padded == padded and result.replay_rows == result.num_tokens
        same_step(got, want, rc, ro)
    full = [p for _, k, p, _ in SERVED if k is FULL]
    assert rc.backend.model.dispatch["full"] == Counter(full)
    assert rc.backend.model.dispatch["main"] == Counter({64: 1, "eager": 1})


# ---- a FULL step and the same step in pieces compute alike ----------------------------
def test_a_full_step_and_the_same_step_in_pieces_agree_to_the_bit(model):
    """A backend in piecewise mode on the same weights, given each step's batch laid out
    as the FULL backend lays out its own (its policy's graph_rows, in the metadata
    buffer): its pieces read the same graph layout, so they compute exactly what the
    FULL graph does. Logits, prompt logprobs and every cache entry, from the same
    (zero) caches, to the bit in fp32."""
    rf = runner(model, cudagraph_mode="full_and_piecewise", strict=True)
    rp = runner(model, cudagraph_mode="piecewise", strict=True)
    rf.capture()
    rp.capture()
    rows = rf.backend.model.full_policy.rows
    for step, _, padded, _ in SERVED[:8]:
        full = rf.step(step)
        with torch.inference_mode():
            tokens = [rp.tokens(r.req_id, r.context_len, r.seq_len) for r in step]
            blocks = [rp.block_of(r.req_id) for r in step]
            batch = build_step_batch(step, tokens, blocks, rp.layout, CFG.window, rp.device, rp.max_num_batched_tokens,
                                     inputs_in_metadata=rp.compiled.direct, metadata=rp.backend.metadata,
                                     view_fields=rp.view_fields, owner=rp, graph_rows=rows)
        assert batch.graph is not None and batch.graph.rows == rows
        pieces = rp.run(batch)
        assert (full.result.kind, pieces.result.kind) == (FULL, PIECEWISE), step
        assert full.result.padded_tokens == pieces.result.padded_tokens == padded
        assert torch.equal(full.logits, pieces.logits), (step, max_abs_err(full.logits, pieces.logits))
        assert full.prompt_logprobs.keys() == pieces.prompt_logprobs.keys()
        assert all(torch.equal(full.prompt_logprobs[k], pieces.prompt_logprobs[k]) for k in full.prompt_logprobs)
        for name in ("swa", "glob", "raw"):
            a, b = getattr(rf.kv, name), getattr(rp.kv, name)
            for k in (range(len(a)) if isinstance(a, list) else a):
                assert torch.equal(a[k], b[k]), (step, name, k, max_abs_err(a[k], b[k]))


# ---- the toy model ------------------------------------------------------------------
TOY_OPTS = {"compiler": "eager", "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32], "max_num_seqs": 4,
            "max_num_batched_tokens": 64}
TOY_LEN = 64


def toy_served(attention: str, **options):
    """The toy model served with ``attention``, its capture summary, and its oracle."""
    model = ToyModel(attention).eval()
    compiled = replay_backend.compile(model, ("input_ids", "positions"), options={**TOY_OPTS, **options})
    server = OwnServer(model, toy_cache, compiled, max_model_len=TOY_LEN, max_num_seqs=4)
    summary = server.serve()
    return server, summary, OwnServer(model, toy_cache, max_model_len=TOY_LEN, max_num_seqs=4)


def toy_step(server, oracle, step):
    """One step on both; returns its result and the largest difference of the logits and
    of the KV entries the step wrote."""
    got, result = server.step(step)
    want, _ = oracle.step(step)
    err = max_abs_err(got, want)
    for (_, _, a), (_, _, b) in zip(server.written(step), oracle.written(step)):
        err = max(err, max_abs_err(a, b))
    return result, err


# a prompt, then decodes and mixed steps at sizes the prompt's step did not have
TOY_STEPS = [[R("a", 5, 5)], [R("a", 1, 6)], [R("a", 1, 7), R("b", 3, 3)], [R("a", 1, 8), R("b", 1, 4)],
             [R("b", 1, 5)]]


@pytest.mark.parametrize("attention, mode, wrong", [
    ("host_read", "full_and_piecewise", True),  # reads the captured step's host fields
    ("host_read", "piecewise", False),  # between pieces it reads the step's own
    ("always", "full_and_piecewise", False),  # reads only the graph layout's device metadata
])
def test_an_op_that_reads_host_values_inside_a_full_graph_is_wrong_on_the_cpu_too(attention, mode, wrong):
    """The CPU emulation replays the captured step's host values: an attention op that
    declares ALWAYS but attends one request at a time from the view's host fields
    (query_start_loc, seq_lens, cache_base) gives a wrong answer under FULL, as its
    kernels would on a GPU, and the right one under piecewise; the same attention
    from device metadata only is right under FULL."""
    server, summary, oracle = toy_served(attention, cudagraph_mode=mode, strict=True)
    assert ("full" in summary) == (mode != "piecewise")
    errs = []
    for step in TOY_STEPS:
        result, err = toy_step(server, oracle, step)
        assert result.kind is (FULL if mode != "piecewise" else PIECEWISE), step
        errs.append(err)
    if wrong:  # every step after the first: its requests are not the captured dummy's
        assert min(errs[1:]) > 1e-2, errs
    else:
        assert max(errs) <= 1e-5, errs


@pytest.mark.parametrize("strict", [False, True])
def test_a_batch_laid_out_for_full_graphs_outside_the_metadata_buffer_runs_in_pieces(strict):
    """A batch laid out for FULL graphs (graph_rows) but in fresh memory, not in the
    backend's metadata buffer, which a FULL graph reads: its step runs in pieces, right,
    as the counted fallback metadata_in_place (an error under strict)."""
    server, _, oracle = toy_served("always", cudagraph_mode="full_and_piecewise", strict=strict)
    compiled = server.compiled
    step = [R("b", 6, 6)]
    policy = compiled.backend.model.full_policy
    batch = build_step_batch(step, [server.default_tokens(r) for r in step], [server.block("b")], server.layout,
                             server.model.window, "cpu", graph_rows=policy.rows, view_fields=server.setup.view_fields,
                             inputs_in_metadata=compiled.direct)
    assert batch.graph is not None and batch.metadata is None
    with torch.no_grad(), replay_backend.set_forward_context(server.setup.context(batch)):
        if strict:
            with pytest.raises(StrictFallbackError, match="metadata_in_place: a batch laid out for FULL graphs"):
                compiled(batch.input_ids, batch.positions)
            return
        with counters.expect(strict=False, fallbacks={"metadata_in_place": 1}):
            compiled(batch.input_ids, batch.positions)
    result = compiled.last_step
    assert (result.kind, result.padded_tokens) == (PIECEWISE, 8)


def test_steps_after_capture_without_start_serving_run_in_pieces_and_the_note_says_so(caplog):
    """FULL graphs serve only from start_serving() on: a step between capture() and it
    runs in pieces, right, and the once-logged note on such steps names the FULL graphs."""
    model = ToyModel("always").eval()
    compiled = replay_backend.compile(model, ("input_ids", "positions"),
                                      options={**TOY_OPTS, "cudagraph_mode": "full_and_piecewise"})
    server = OwnServer(model, toy_cache, compiled, max_model_len=TOY_LEN, max_num_seqs=4)
    oracle = OwnServer(model, toy_cache, max_model_len=TOY_LEN, max_num_seqs=4)
    server.warm_up()
    assert "full" in compiled.capture(server.setup)
    result, err = toy_step(server, oracle, [R("a", 5, 5)])
    assert result.kind is PIECEWISE and err <= 1e-5
    assert "steps run after capture() without start_serving()" in caplog.text
    assert "no step runs as a FULL graph" in caplog.text


@pytest.mark.parametrize("strict", [False, True])
def test_a_served_batch_built_without_the_graph_layout_is_a_counted_fallback(strict):
    """A batch a FULL graph could run, built with ``build_step_batch`` (no graph layout)
    instead of the compiled model's ``build_batch``: its step runs in pieces, right,
    as the counted fallback metadata_in_place (an error under strict), not silently. A
    batch beyond every FULL size counts nothing."""
    server, _, oracle = toy_served("always", cudagraph_mode="full_and_piecewise", strict=strict)
    compiled = server.compiled
    policy = compiled.backend.model.full_policy

    def plain(step):
        return build_step_batch(step, [server.default_tokens(r) for r in step], [server.block(r.req_id) for r in step],
                                server.layout, server.model.window, "cpu", view_fields=server.setup.view_fields,
                                inputs_in_metadata=compiled.direct)

    step = [R("b", 6, 6)]
    batch = plain(step)
    assert batch.graph is None and policy.wants_layout(step)
    with torch.no_grad(), replay_backend.set_forward_context(server.setup.context(batch)):
        if strict:
            with pytest.raises(StrictFallbackError, match="metadata_in_place: a batch that could run as a FULL graph "
                                                          "was built without the graph layout"):
                compiled(batch.input_ids, batch.positions)
            return
        with counters.expect(strict=False, fallbacks={"metadata_in_place": 1}):
            (hidden,) = compiled(batch.input_ids, batch.positions)
    assert (compiled.last_step.kind, compiled.last_step.padded_tokens) == (PIECEWISE, 8)
    want, _ = oracle.step(step)
    assert max_abs_err(server.model.head(hidden[batch.logits_indices]), want) <= 1e-5
    big = [R("c", policy.sizes[-1] + 1, policy.sizes[-1] + 1)]
    batch = plain(big)
    with torch.no_grad(), replay_backend.set_forward_context(server.setup.context(batch)):
        with counters.expect(strict=False, fallbacks={}):
            compiled(batch.input_ids, batch.positions)
    assert compiled.last_step.kind is not FULL


def test_a_batch_laid_out_for_other_rows_runs_in_pieces():
    """A batch in the backend's metadata buffer but laid out for more rows than the
    FULL graphs read: its fields sit at other offsets, so its step runs in pieces, as
    the counted fallback metadata_in_place, and is right."""
    server, _, oracle = toy_served("always", cudagraph_mode="full_and_piecewise")
    compiled = server.compiled
    result, err = toy_step(server, oracle, [R("a", 5, 5)])  # size 8 has replayed once, rightly
    assert (result.kind, result.padded_tokens) == (FULL, 8) and err <= 1e-5
    step = [R("b", 6, 6)]
    backend = compiled.backend
    batch = build_step_batch(step, [server.default_tokens(r) for r in step], [server.block("b")], server.layout,
                             server.model.window, "cpu", graph_rows=2 * backend.model.full_policy.rows,
                             view_fields=server.setup.view_fields, inputs_in_metadata=compiled.direct,
                             metadata=backend.metadata)
    with torch.no_grad(), replay_backend.set_forward_context(server.setup.context(batch)):
        with counters.expect(strict=False, fallbacks={"metadata_in_place": 1}):
            compiled(batch.input_ids, batch.positions)
    assert (compiled.last_step.kind, compiled.last_step.padded_tokens) == (PIECEWISE, 8)


@pytest.mark.parametrize("replayed_before", [False, True])
def test_a_full_step_whose_metadata_is_not_where_the_graph_reads_is_refused_naming_the_field(replayed_before):
    """A FULL graph checks on every replay that the step's metadata sits where it
    reads: here a batch whose slots were moved after it was built."""
    import dataclasses

    server, _, oracle = toy_served("always", cudagraph_mode="full_and_piecewise", strict=True)
    compiled = server.compiled
    if replayed_before:  # size 8 has replayed once, rightly
        result, err = toy_step(server, oracle, [R("a", 5, 5)])
        assert (result.kind, result.padded_tokens) == (FULL, 8) and err <= 1e-5
    step = [R("b", 6, 6)]
    batch = compiled.build_batch(step, [server.default_tokens(r) for r in step], [server.block("b")])
    moved = dataclasses.replace(batch.graph, slot_mapping=batch.graph.slot_mapping.clone())
    batch = dataclasses.replace(batch, graph=moved)
    with torch.no_grad(), replay_backend.set_forward_context(server.setup.context(batch)):
        with pytest.raises(RuntimeError, match=r"FULL graph \[8\]: the step's slot_mapping is at .* it would read "
                                               r"another step's metadata"):
            compiled(batch.input_ids, batch.positions)


def test_a_full_step_moves_the_counters_as_a_graph_replay_does(model):
    """A FULL step on the CPU counts what it counts on a GPU, where its replay runs no
    host code: not the trim op's work, which ran once, at capture."""
    rc = runner(model, cudagraph_mode="full_and_piecewise", strict=True)
    rc.capture()
    rc.step([R("a", 20, 20)])
    with counters.expect(strict=True):
        assert rc.step([R("a", 1, 21)]).result.kind is FULL


# ---- downgrades: the attention decides ----------------------------------------------
@pytest.mark.parametrize("attention", ["never", "undeclared"])
def test_attention_that_cannot_run_in_a_full_graph_downgrades_to_pieces_as_a_counted_fallback(attention):
    with counters.expect(strict=False, fallbacks={"cudagraph_mode": 1}):
        server, summary, oracle = toy_served(attention, cudagraph_mode="full_and_piecewise")
    assert "full" not in summary and summary["main"]["graphs"] > 0
    assert server.compiled.backend.model.full_policy is None
    with counters.expect(strict=False, fallbacks={}):
        for step in TOY_STEPS:
            result, err = toy_step(server, oracle, step)
            assert result.kind is PIECEWISE and err <= 1e-5, (step, result, err)


def test_a_full_only_mode_whose_sizes_all_trim_says_so(model):
    """cudagraph_mode='full' with every capture size at or above the trim threshold: no
    FULL graph, and capture's nothing_captured fallback names the sizes and the
    threshold; the steps still run right, eagerly."""
    opts = dict(cudagraph_mode="full", cudagraph_capture_sizes=[64, 128])
    rc, ro = runner(model, **opts), runner(model)
    with counters.expect(strict=False, fallbacks={"nothing_captured": 1}):
        rc.capture()
    got, want = rc.step([R("a", 20, 20)]), ro.step([R("a", 20, 20)])
    assert got.result.kind is EAGER
    same_step(got, want, rc, ro)
    with pytest.raises(StrictFallbackError, match=r"FULL graphs alone, which run only steps that never trim, and "
                       r"every capture size \[64, 128\] is at or above decoder_replay_trim_threshold=64"):
        runner(model, strict=True, **opts).capture()


def test_a_full_only_mode_whose_attention_cannot_says_so(caplog):
    """The same where the attention cannot run inside a FULL graph: the fallback points
    at the attention's own (counted) cudagraph_mode fallback."""
    with counters.expect(strict=False, fallbacks={"nothing_captured": 1, "cudagraph_mode": 1}), \
            caplog.at_level("WARNING", logger="replay_backend"):
        server, summary, oracle = toy_served("never", cudagraph_mode="full")
    assert "FULL graphs alone, and none of its sizes was kept (the cudagraph_mode fallback says why)" in caplog.text
    result, err = toy_step(server, oracle, [R("a", 5, 5)])
    assert result.kind is EAGER and err <= 1e-5
    with pytest.raises(StrictFallbackError, match="cudagraph_mode"):
        toy_served("never", cudagraph_mode="full", strict=True)


def test_the_downgrade_is_decided_and_counted_once():
    """The memory estimate and capture both need the policy: the first decides it (and
    counts a downgrade), the second takes it as decided."""
    model = ToyModel("never").eval()
    compiled = replay_backend.compile(model, ("input_ids", "positions"),
                                      options={**TOY_OPTS, "cudagraph_mode": "full_and_piecewise"})
    server = OwnServer(model, toy_cache, compiled, max_model_len=TOY_LEN, max_num_seqs=4)
    with counters.expect(strict=False, fallbacks={"cudagraph_mode": 1}):
        server.warm_up()
        with pytest.raises(RuntimeError, match="estimate_graph_memory needs CUDA"):  # after deciding the policy
            compiled.estimate_graph_memory(server.setup)
        compiled.capture(server.setup)


def test_the_memory_estimate_runs_the_largest_full_step_as_its_graph_holds_it(monkeypatch):
    """FULL graphs are captured first into the pool: the estimate runs the largest FULL
    size's capture step without a graph, its attention reading the graph layout (whose
    scratch may be sized for the cache's longest sequence), and the pool covers that
    peak. Nothing is captured by it, and capture and the served steps follow as usual.
    The peaks are faked here (the estimate needs CUDA): each is what ran inside it."""
    from replay_backend.capture import memory
    from replay_backend.dispatch.compiled import CompiledReplayModel

    model = ToyModel("always").eval()
    compiled = replay_backend.compile(model, ("input_ids", "positions"),
                                      options={**TOY_OPTS, "cudagraph_mode": "full_and_piecewise"})
    server = OwnServer(model, toy_cache, compiled, max_model_len=TOY_LEN, max_num_seqs=4)
    server.warm_up()
    inner = compiled.backend.model
    ran = []
    pieces_at = CompiledReplayModel._pieces_at

    def spy(self, size, new):
        view = replay_backend.get_forward_context().active
        ran.append((size, view.graph.rows if view.graph is not None else None))
        return pieces_at(self, size, new)

    peaks = []

    @contextlib.contextmanager
    def fake_peak():
        got = [0]
        yield got
        plan = inner.last_plan
        peaks.append((plan.kind, plan.padded_tokens))
        got[0] = 10 ** 9 if len(peaks) == 1 else 3 * 10 ** 9  # the FULL step's the larger

    monkeypatch.setattr(CompiledReplayModel, "_pieces_at", spy)
    monkeypatch.setattr(memory, "_peak", fake_peak)
    monkeypatch.setattr(inner.res, "use_cuda", True)
    est = compiled.estimate_graph_memory(server.setup)
    sizes = inner.full_policy.sizes
    # the main step without graphs, then the largest FULL step, whose work ran directly
    # (size None) on the graph layout's views at its size
    assert peaks == [(EAGER, max(TOY_OPTS["cudagraph_capture_sizes"])), (FULL, sizes[-1])], peaks
    assert ran == [(None, sizes[-1])], ran
    assert est.main_peak_bytes == 10 ** 9 and est.full_peak_bytes == 3 * 10 ** 9 and est.full_graphs == len(sizes)
    # the pool covers the FULL step's peak, its outputs counted once (with every FULL
    # graph's), then a cost per graph
    largest_out = inner.output_row_bytes * sizes[-1]
    graphs = est.graphs * est.per_graph_bytes
    assert est.total_bytes > 3 * 10 ** 9 - largest_out + est.full_output_bytes + graphs, est
    assert est.total_bytes < 3 * 10 ** 9 + est.full_output_bytes + 2 * graphs + 10 ** 8, est
    assert inner.last_plan is None or inner.last_plan.kind is not FULL  # no trace of the estimate's steps
    assert not inner.dispatch["full"]
    assert not inner.full.graphs and compiled.backend.lifecycle.phase.value == "warming"
    monkeypatch.setattr(inner.res, "use_cuda", False)
    compiled.capture(server.setup)
    compiled.start_serving()
    oracle = OwnServer(model, toy_cache, max_model_len=TOY_LEN, max_num_seqs=4)
    for step in TOY_STEPS:
        result, err = toy_step(server, oracle, step)
        assert err <= 1e-5, (step, result, err)
    assert {toy_step(server, oracle, [R("b", 1, 6)])[0].kind} == {FULL}


def test_the_memory_estimate_after_capture_is_refused_and_changes_nothing():
    """Once serving (uncaptured FULL sizes dropped from the policy), the estimate is
    refused by its phase before it touches the policy; fail_step without data-parallel
    ranks only raises its error."""
    server, _, oracle = toy_served("always", cudagraph_mode="full_and_piecewise")
    compiled = server.compiled
    policy = compiled.backend.model.full_policy
    with pytest.raises(RuntimeError, match="estimate_graph_memory"):
        compiled.estimate_graph_memory(server.setup)
    assert compiled.backend.model.full_policy is policy
    with pytest.raises(KeyError, match="mine"):
        compiled.fail_step(KeyError("mine"))
    result, err = toy_step(server, oracle, [R("a", 1, 1)])
    assert result.kind is FULL and err <= 1e-5


@pytest.mark.parametrize("attention", ["never", "undeclared"])
def test_under_strict_the_downgrade_is_an_error_naming_cudagraph_mode_and_the_op(attention):
    with pytest.raises(StrictFallbackError, match=rf"cudagraph_mode: cudagraph_mode='full_and_piecewise': attention "
                                                  rf"op full_toy::{attention} declares cudagraph_support NEVER"):
        toy_served(attention, cudagraph_mode="full_and_piecewise", strict=True)


def test_uniform_decode_support_runs_only_uniform_decodes_as_full_graphs():
    """UNIFORM_DECODE under full_and_piecewise: a counted downgrade; FULL sizes up to
    the one that holds max_num_seqs decodes; a one-token decode runs FULL, steps whose
    requests differ in query length run in pieces."""
    with counters.expect(strict=False, fallbacks={"cudagraph_mode": 1}):
        server, summary, oracle = toy_served("uniform", cudagraph_mode="full_and_piecewise")
    policy = server.compiled.backend.model.full_policy
    assert (policy.sizes, policy.uniform_only, policy.uniform_len) == ((1, 2, 4), True, 1)
    with pytest.raises(StrictFallbackError, match="cudagraph_mode: .*declares cudagraph_support UNIFORM_DECODE, so "
                                                  "only uniform decode batches"):
        toy_served("uniform", cudagraph_mode="full_and_piecewise", strict=True)
    for step, kind, padded in [([R("a", 5, 5)], PIECEWISE, 8),  # a prompt: 5 tokens
                               ([R("a", 1, 6)], FULL, 1),
                               ([R("a", 1, 7), R("b", 3, 3)], PIECEWISE, 4),  # 4 tokens: a FULL size, not uniform
                               ([R("a", 1, 8)], FULL, 1),
                               ([R("b", 2, 5), R("a", 1, 9)], PIECEWISE, 4)]:
        result, err = toy_step(server, oracle, step)
        assert (result.kind, result.padded_tokens) == (kind, padded) and err <= 1e-5, (step, result, err)


UNIFORM_DECODES = [[R("a", 1, 6)], [R("a", 1, 7), R("b", 1, 4)], [R("a", 1, 8), R("b", 1, 5), R("c", 1, 2)],
                   [R("a", 1, 9), R("b", 1, 6)]]


@pytest.mark.parametrize("attention, mode", [("uniform", "full_and_piecewise"), ("always", "full_decode_only")])
def test_every_full_size_of_a_uniform_decode_policy_is_captured_and_served(attention, mode):
    """Uniform decodes of 1, 2, 3 and 2 requests: FULL at 1, 2, 4, 2, every one a
    captured graph (no uncaptured_size fallback)."""
    with counters.expect(strict=False, fallbacks={"cudagraph_mode": int(mode == "full_and_piecewise")}):
        server, summary, oracle = toy_served(attention, cudagraph_mode=mode)
        first = toy_step(server, oracle, [R("a", 5, 5), R("b", 3, 3), R("c", 1, 1)])[0]
        assert first.kind is (PIECEWISE if mode == "full_and_piecewise" else EAGER)
        assert (summary["full"]["sizes"], summary["full"]["graphs"]) == (3, 3)
        for step in UNIFORM_DECODES:
            result, err = toy_step(server, oracle, step)
            assert result.kind is FULL and err <= 1e-5, (step, result, err)


# ---- full_decode_only and full --------------------------------------------------------
def test_full_decode_only_runs_uniform_decodes_full_and_every_other_step_eagerly(model):
    rc, ro = runner(model, cudagraph_mode="full_decode_only", strict=True), runner(model)
    summary = rc.capture()
    assert rc.backend.model.full_policy.sizes == (1, 2, 4)  # max_num_seqs=4 decodes of one token
    assert (summary["main"]["sizes"], summary["main"]["graphs"]) == (0, 0) and "replay" not in summary
    for step, kind, padded, trimmed in [
            ([R("a", 20, 20)], EAGER, 20, True),  # a prompt longer than W: eager, trims
            ([R("a", 1, 21)], FULL, 1, False),
            ([R("a", 1, 22), R("b", 5, 5)], EAGER, 6, False),  # not uniform
            ([R("b", 3, 8)], EAGER, 3, False),  # 3 tokens: longer than uniform_decode_query_len
            ([R("a", 1, 23)], FULL, 1, False)]:
        got, want = rc.step(step), ro.step(step)
        assert (got.result.kind, got.result.padded_tokens, got.result.trimmed) == (kind, padded, trimmed), step
        same_step(got, want, rc, ro)


def test_full_runs_steps_below_the_threshold_full_and_a_trimming_step_eagerly(model):
    rc, ro = runner(model, cudagraph_mode="full", strict=True), runner(model)
    summary = rc.capture()
    assert (summary["full"]["sizes"], summary["full"]["graphs"]) == (6, 6)
    assert summary["main"]["graphs"] == 0 and "replay" not in summary
    for step, kind, padded, trimmed in [
            ([R("a", 20, 20)], FULL, 32, False),  # any batch: a prompt too
            ([R("a", 1, 21), R("b", 6, 6)], FULL, 8, False),
            ([R("c", 40, 40)], EAGER, 40, True),  # above the largest FULL size: eager, trimmed
            ([R("a", 2, 23), R("b", 2, 8), R("c", 2, 42)], FULL, 8, False),
            ([R("c", 70, 112), R("a", 1, 24)], EAGER, 71, True)]:  # above every capture size below 64
        got, want = rc.step(step), ro.step(step)
        assert (got.result.kind, got.result.padded_tokens, got.result.trimmed) == (kind, padded, trimmed), step
        same_step(got, want, rc, ro)


@pytest.mark.parametrize("mode", ["full", "full_and_piecewise"])
def test_full_sizes_beyond_max_num_seqs_windows_are_captured_and_served(model, mode):
    """Two cache blocks and FULL sizes up to 48 tokens, three windows (W = 16): capture's
    dummy step at 48 must fit the two requests the graph layout holds, as served
    batches do, or every later step at that size reads metadata where the graph does
    not and is refused."""
    opts = dict(OPTS, cudagraph_mode=mode, cudagraph_capture_sizes=[8, 48], max_num_seqs=2, strict=True)
    rc = StepRunner(model, max_model_len=MAX_MODEL_LEN, max_num_seqs=2, backend=ReplayBackend(**opts))
    ro = StepRunner(model, max_model_len=MAX_MODEL_LEN, max_num_seqs=2)
    assert rc.capture()["full"]["graphs"] == 2
    for step, padded in [([R("a", 20, 20)], 48), ([R("a", 1, 21), R("b", 40, 40)], 48), ([R("a", 1, 22)], 8)]:
        got, want = rc.step(step), ro.step(step)
        assert (got.result.kind, got.result.padded_tokens) == (FULL, padded), step
        same_step(got, want, rc, ro)


def test_a_full_size_no_served_batch_reaches_is_left_out(model):
    """One cache block of 32 positions: no served batch holds more than 32 tokens, so
    the FULL size 48 is left out of capture (its dummy step could not be laid out as a
    served one) and the sizes below it serve."""
    opts = dict(OPTS, cudagraph_mode="full", cudagraph_capture_sizes=[8, 32, 48], max_num_seqs=1, strict=True)
    rc = StepRunner(model, max_model_len=32, max_num_seqs=1, backend=ReplayBackend(**opts))
    ro = StepRunner(model, max_model_len=32, max_num_seqs=1)
    assert rc.capture()["full"]["graphs"] == 2
    assert rc.backend.model.full_policy.sizes == (8, 32)
    got, want = rc.step([R("a", 30, 30)]), ro.step([R("a", 30, 30)])
    assert (got.result.kind, got.result.padded_tokens) == (FULL, 32)
    same_step(got, want, rc, ro)


def test_a_graph_layout_refuses_more_requests_than_it_holds():
    """A graph layout holds as many requests as the cache has blocks: a batch of more
    would move every later field, so it is refused, naming the count."""
    layout = replay_backend.CacheLayout(64, 2)
    reqs = [R(f"r{i}", 2, 2) for i in range(3)]
    with pytest.raises(ValueError, match="holds at most 2 requests .* the step has 3"):
        build_step_batch(reqs, [[0, 0]] * 3, [0, 0, 0], layout, 16, "cpu", pad_writes=True, graph_rows=8)
    assert build_step_batch(reqs[:2], [[0, 0]] * 2, [0, 1], layout, 16, "cpu", graph_rows=8).graph.rows == 8


def test_a_uniform_decode_policy_that_no_full_size_holds_is_a_counted_fallback():
    """Attention that runs only uniform decodes inside a FULL graph, of more tokens than
    any capture size: no FULL graph, said with the reason, and steps run in pieces."""
    with counters.expect(strict=False, fallbacks={"cudagraph_mode": 2}):  # the downgrade, then no size
        server, summary, oracle = toy_served("uniform", cudagraph_mode="full_and_piecewise",
                                             uniform_decode_query_len=40)
    assert "full" not in summary and server.compiled.backend.model.full_policy is None
    result, err = toy_step(server, oracle, [R("a", 5, 5)])
    assert result.kind is PIECEWISE and err <= 1e-5


def test_uniform_decodes_longer_than_the_window_are_captured_and_served_full(model):
    """uniform_decode_query_len above W (16): capture's dummy decodes are that long too
    (a FULL step never trims), and such a decode, whose replay floor lies inside its
    chunk, runs as one FULL graph matching the oracle."""
    rc, ro = runner(model, cudagraph_mode="full_decode_only", uniform_decode_query_len=20, strict=True), runner(model)
    summary = rc.capture()
    assert summary["full"]["graphs"] == summary["full"]["sizes"] > 0
    for step, kind in [([R("a", 30, 30)], EAGER), ([R("a", 20, 50)], FULL), ([R("a", 20, 70), R("b", 5, 5)], EAGER),
                       ([R("a", 20, 90, kv_start=75)], FULL)]:
        got, want = rc.step(step), ro.step(step)
        assert got.result.kind is kind, (step, got.result)
        same_step(got, want, rc, ro)


def test_uniform_decodes_longer_than_max_model_len_get_no_full_graph_and_say_why(model, caplog):
    """uniform_decode_query_len 20 with sequences of at most 16 positions: no such decode
    exists, so no FULL size is captured for one (a counted fallback naming both), and
    the steps run right, eagerly."""
    opts = dict(OPTS, cudagraph_mode="full_decode_only", uniform_decode_query_len=20)
    rc = StepRunner(model, max_model_len=16, max_num_seqs=4, backend=ReplayBackend(**opts))
    ro = StepRunner(model, max_model_len=16, max_num_seqs=4)
    with counters.expect(strict=False, fallbacks={"cudagraph_mode": 1, "nothing_captured": 1}), \
            caplog.at_level("WARNING", logger="replay_backend"):
        assert "full" not in rc.capture()
    assert "none of its sizes was kept (the cudagraph_mode fallback says why)" in caplog.text
    got, want = rc.step([R("a", 10, 10)]), ro.step([R("a", 10, 10)])
    assert got.result.kind is EAGER
    same_step(got, want, rc, ro)
    with pytest.raises(StrictFallbackError, match="decodes of 20 tokens.*more tokens than the cache's max_model_len=16"):
        StepRunner(model, max_model_len=16, max_num_seqs=4, backend=ReplayBackend(**opts, strict=True)).capture()


@pytest.mark.parametrize("mode", ["full", "full_decode_only", "full_and_piecewise"])
@pytest.mark.parametrize("strict", [False, True])
def test_serving_a_full_mode_without_capture_is_a_counted_fallback(model, mode, strict):
    """No capture(), so no FULL graph: start_serving says so once (an error under
    strict, before serving starts), and the steps run right without one."""
    rc, ro = runner(model, cudagraph_mode=mode, strict=strict), runner(model)
    rc.run(rc.dummy_batch(CFG.window), use_graphs=False)  # the trace
    if strict:
        with pytest.raises(StrictFallbackError, match=f"uncaptured_size: cudagraph_mode='{mode}': serving started "
                                                      "without capture"):
            rc.start_serving()
        assert not rc.backend.lifecycle.serving
        return
    with counters.expect(strict=False, fallbacks={"uncaptured_size": 1}):
        rc.start_serving()
    # full_and_piecewise: its pieces have no graph either, counted once for each level
    # of the step (the main pieces, and the replay region's at the step's size)
    with counters.expect(strict=False, fallbacks={"uncaptured_size": 2} if mode == "full_and_piecewise" else {}):
        got = rc.step([R("a", 1, 1)])
    want = ro.step([R("a", 1, 1)])
    assert got.result.kind is not FULL
    same_step(got, want, rc, ro)


# ---- data parallelism ----------------------------------------------------------------
# Per step, rank 0's requests and rank 1's, and the kind and size both run at. The
# attention supports UNIFORM_DECODE, uniform_decode_query_len=2 (one draft token): FULL
# sizes 2, 4 and 8 (up to 4 requests of 2 tokens), for batches whose requests all have
# exactly 2 tokens.
DP_STEPS = [
    (([R("a", 20, 20), R("b", 6, 6)], [R("c", 10, 10)]), PIECEWISE, 32),  # prompts
    (([R("a", 2, 22), R("b", 2, 8)], [R("c", 2, 12)]), FULL, 4),  # two-token decodes on both
    (([R("a", 1, 23), R("b", 1, 9)], [R("c", 1, 13)]), PIECEWISE, 2),  # one token each: not the length
    (([R("a", 2, 25), R("b", 2, 11)], [R("c", 2, 15), R("d", 3, 3)]), PIECEWISE, 8),  # rank 1 not uniform
    (([R("a", 2, 27)], [R("c", 2, 17), R("d", 2, 5)]), FULL, 4),
    (([R("a", 2, 29)], [R("e", 20, 20)]), PIECEWISE, 32),  # rank 1 above the largest FULL size
    (([R("a", 2, 31)], None), FULL, 2),  # rank 1 idle: its dummy step is laid out as a decode
]


def _serve_dp(rank: int, world: int) -> list:
    from replay_backend.reference import attention_ops
    from replay_backend.reference.parallel import Parallel, shard

    # The reference attention declares ALWAYS; this process's declares UNIFORM_DECODE.
    uniform = CudagraphSupport.UNIFORM_DECODE
    replay_backend.declare_attention(attention_ops.swa_attention, attention_ops.global_attention,
                                     cudagraph_support=uniform)
    replay_backend.declare_attention(attention_ops.source_attention, kv_source=True, cudagraph_support=uniform)
    group = dist.group.WORLD
    par = Parallel(dp_size=world, dp_rank=rank, dp_group=group, enable_expert_parallel=True)
    oracle_model, model = build_model(CFG), shard(build_model(CFG), par)
    be = ReplayBackend(**OPTS, cudagraph_mode="full_and_piecewise", uniform_decode_query_len=2, dp_group=group)
    rc = StepRunner(model, max_model_len=MAX_MODEL_LEN, max_num_seqs=4, backend=be)
    ro = StepRunner(oracle_model, max_model_len=MAX_MODEL_LEN, max_num_seqs=4)
    summary = rc.capture()
    out = [be.model.full_policy.sizes, summary["full"]["graphs"], dict(counters.fallbacks)]
    for steps, _, _ in DP_STEPS:
        step = steps[rank]
        if step is None:
            rc.idle_step()
            out.append((be.last_step.kind, be.last_step.padded_tokens, 0.0, 0.0))
            continue
        got, want = rc.step(step), ro.step(step)
        out.append((got.result.kind, got.result.padded_tokens, max_abs_err(got.logits, want.logits),
                    max_abs_err_kv(rc.kv, ro.kv, got.batch)))
    out.append(dict(counters.fallbacks))
    return out


def test_data_parallel_ranks_run_full_only_when_every_ranks_batch_can():
    """Two ranks (gloo), expert-parallel MoE exchanging tokens inside the graphs: a step
    runs FULL on both only where both batches are uniform decodes within the FULL sizes;
    otherwise both run PIECEWISE at one padded size. Every step matches the
    single-process model."""
    per_rank = run_ranks(_serve_dp, 2, timeout=120)
    for sizes, graphs, fallbacks, *steps, after in per_rank:
        assert sizes == (2, 4, 8) and graphs == 3
        assert fallbacks == {"cudagraph_mode": 1} and after == fallbacks  # the downgrade only
        for (kind, padded, err, kv), (_, want_kind, want_padded) in zip(steps, DP_STEPS):
            assert (kind, padded) == (want_kind, want_padded) and err <= TOL and kv <= TOL, (kind, padded, err, kv)


def _capture_with_blocks(rank: int, world: int) -> str:
    """Rank 0 with 4 cache blocks, rank 1 with 2: under full_decode_only their FULL sizes
    differ (a uniform decode of 4 requests fits rank 0's only)."""
    from replay_backend.reference.parallel import Parallel, shard

    group = dist.group.WORLD
    model = shard(build_model(CFG), Parallel(dp_size=world, dp_rank=rank, dp_group=group,
                                             enable_expert_parallel=True))
    be = ReplayBackend(**OPTS, cudagraph_mode="full_decode_only", dp_group=group)
    rc = StepRunner(model, max_model_len=MAX_MODEL_LEN, max_num_seqs=4 - 2 * rank, backend=be)
    try:
        rc.capture()
    except ValueError as e:
        return str(e)
    return "captured"


def test_ranks_whose_full_graphs_would_differ_are_refused_before_capture():
    """The FULL sizes are part of the capture schedule the ranks compare: ranks that
    would capture different FULL graphs (whose collectives would not meet) are told
    so, naming the first difference, before any graph is captured."""
    for message in run_ranks(_capture_with_blocks, 2, timeout=120):
        assert "the ranks would capture different graphs" in message and "FULL sizes" in message, message


# ---- options -------------------------------------------------------------------------
@pytest.mark.parametrize("mode, full, pieces", [("none", False, False), ("piecewise", False, True),
                                                ("full", True, False), ("full_decode_only", True, False),
                                                ("full_and_piecewise", True, True)])
def test_each_mode_says_which_graphs_it_captures(mode, full, pieces):
    cfg = ReplayConfig.from_options({"cudagraph_mode": mode})
    assert (cfg.full_graphs, cfg.piecewise_graphs, cfg.graphs_enabled) == (full, pieces, mode != "none")


@pytest.mark.parametrize("options, key", [
    ({"cudagraph_mode": "full_piecewise"}, "cudagraph_mode"),
    ({"cudagraph_mode": "FULL"}, "cudagraph_mode"),
    ({"uniform_decode_query_len": 0}, "uniform_decode_query_len"),
    ({"uniform_decode_query_len": -2}, "uniform_decode_query_len"),
    ({"uniform_decode_query_len": 1.5}, "uniform_decode_query_len"),
    ({"uniform_decode_query_len": "2"}, "uniform_decode_query_len"),
    ({"uniform_decode_query_len": True}, "uniform_decode_query_len"),
    ({"uniform_decode_query_len": 10 ** 9}, "uniform_decode_query_len"),
    # no capture size holds one uniform decode request
    ({"cudagraph_mode": "full_decode_only", "cudagraph_capture_sizes": [1, 2], "uniform_decode_query_len": 3},
     "uniform_decode_query_len"),
    ({"cudagraph_mode": "full_decode_only", "cudagraph_capture_sizes": [1, 2], "max_cudagraph_capture_size": 8,
      "uniform_decode_query_len": 3}, "uniform_decode_query_len"),
])
def test_a_bad_mode_or_uniform_decode_query_len_is_refused_naming_it(options, key):
    with pytest.raises(ValueError, match=f"option {key}"):
        ReplayConfig.from_options(options)
    assert ReplayConfig.from_options({"uniform_decode_query_len": 3}).uniform_decode_query_len == 3


@pytest.mark.parametrize("options, trims, sizes", [
    ({"cudagraph_mode": "full_and_piecewise"}, True, [1, 2, 4, 8, 16, 32]),  # below the threshold (64)
    ({"cudagraph_mode": "full_and_piecewise"}, False, SIZES),  # a model that never trims: every size
    ({"cudagraph_mode": "full"}, True, [1, 2, 4, 8, 16, 32]),
    ({"cudagraph_mode": "full", "decoder_replay_trim_threshold": 40}, True, [1, 2, 4, 8, 16, 32]),
    ({"cudagraph_mode": "full", "decoder_replay_trim_threshold": 32}, True, [1, 2, 4, 8, 16]),
    ({"cudagraph_mode": "piecewise"}, True, []),
    ({"cudagraph_mode": "none"}, False, []),
    # full_decode_only: up to the size that holds max_num_seqs * uniform_decode_query_len
    ({"cudagraph_mode": "full_decode_only"}, True, [1, 2, 4]),  # 4 decodes
    ({"cudagraph_mode": "full_decode_only", "max_num_seqs": 5}, True, [1, 2, 4, 8]),  # 5 pad to 8
    ({"cudagraph_mode": "full_decode_only", "uniform_decode_query_len": 3}, True, [1, 2, 4, 8, 16]),  # 12
    ({"cudagraph_mode": "full_decode_only", "uniform_decode_query_len": 4}, True, [1, 2, 4, 8, 16]),  # 16
    ({"cudagraph_mode": "full_decode_only", "max_num_seqs": 64}, True, [1, 2, 4, 8, 16, 32]),  # the threshold's
    ({"cudagraph_mode": "full_decode_only", "max_num_seqs": 64}, False, SIZES[:-1]),
    ({"cudagraph_mode": "full_decode_only", "max_num_seqs": 200}, False, SIZES),  # beyond every size
])
def test_the_full_capture_sizes(options, trims, sizes):
    cfg = ReplayConfig.from_options({**OPTS, **options})
    assert cfg.full_capture_sizes(trims) == sizes


@pytest.mark.parametrize("mode, key, values", [("full_decode_only", "max_num_seqs", (4, 8)),
                                               ("full", "decoder_replay_trim_threshold", (32, 64))])
def test_no_note_calls_an_option_moot_that_changes_the_full_sizes(mode, key, values):
    a, b = (ReplayConfig.from_options({**OPTS, "cudagraph_mode": mode, key: v}) for v in values)
    assert a.full_capture_sizes(True) != b.full_capture_sizes(True)
    assert not [n for n in a.notes() if f"option {key}=" in n and "has no effect" in n], a.notes()


@pytest.mark.parametrize("mode", ["full", "full_decode_only"])
def test_no_note_calls_metadata_in_place_moot_where_full_graphs_read_the_buffer(mode):
    """metadata_in_place=False takes every FULL graph away (a FULL graph reads its steps'
    metadata in the backend's buffer), so =True is never moot with FULL graphs on."""
    cfg = ReplayConfig.from_options({**OPTS, "cudagraph_mode": mode, "metadata_in_place": True})
    assert not [n for n in cfg.notes() if "metadata_in_place" in n], cfg.notes()
