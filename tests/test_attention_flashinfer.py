"""attention_impl="flashinfer" on the CPU: FlashInfer's wrapper emulated from its
documented semantics (reference/flashinfer_semantics.py), the rest of the path real: the key
sets each view is split into, the plans made before attention reads a view (the whole
batch, a replay view, a replay graph's fixed-size plan), and the merge with the sink,
all against the PyTorch reference attention. The GPU tests run FlashInfer itself."""
from __future__ import annotations

import math
import sys
from types import SimpleNamespace

import pytest
import torch

import flashinfer_merge_cases
from conftest import MAX_MODEL_LEN, MAX_NUM_SEQS, check_interpreted, needs_triton, small_config
from replay_backend import RequestChunk, StepRunner, build_model
from replay_backend.backend import ReplayBackend
from replay_backend.reference import attention_flashinfer as fi
from replay_backend.reference import flashinfer_import
from replay_backend.reference import flashinfer_batches as fb
from replay_backend.reference import flashinfer_run as fr
from replay_backend.reference import flashinfer_semantics
from replay_backend.reference.compare import max_abs_err, max_abs_err_kv

pytestmark = pytest.mark.usefixtures("fresh_dynamo", "one_thread")

# Floors (kv_start) below, inside and above a chunk's rows, prompts starting at
# position 0 (a ratio-2 row that reads no global entry), decodes, keep-all prefills.
COMPOSITIONS = [
    [RequestChunk("a", 40, 40), RequestChunk("b", 1, 30), RequestChunk("c", 7, 25)],
    [RequestChunk("a", 50, 90, kv_start=70), RequestChunk("b", 3, 33)],
    [RequestChunk("a", 33, 33, keep_all=True), RequestChunk("b", 20, 61, kv_start=50)],
    [RequestChunk("a", 64, 64)],
    [RequestChunk("a", 2, 17), RequestChunk("b", 1, 2), RequestChunk("c", 45, 100)],
]


def test_key_sets_per_request():
    """Hand-counted: W = 4. Request 0 holds positions 5..8 (rows 0..3) with floor 7,
    base 100; request 1 positions 0..2 (rows 4..6), base 200. Rows that see no key
    are a request of their own (FlashInfer's mask needs as many keys as rows)."""
    view = SimpleNamespace(query_start_loc=(0, 4, 7), seq_lens=(9, 3), kv_start=(7, 0), cache_base=(100, 200),
                           num_tokens=7)
    assert fb.swa_part(view, 4, floored=False) == [(4, 102, 7), (3, 200, 3)]  # from 5 - 3
    # from the floor: positions 5 and 6 see nothing, 7 and 8 see 7..8
    assert fb.swa_part(view, 4, floored=True) == [(2, 0, 0), (2, 107, 2), (3, 200, 3)]
    assert fb.global_part(view, 1) == ([(4, 100, 9), (3, 200, 3)], None)
    # ratio 2: positions 5, 7 read 3, 4 entries; 6, 8 read 3, 4; 0 reads none, 2 reads 1; 1 reads 1
    reqs, perm = fb.global_part(view, 2)
    assert reqs == [(2, 50, 4), (2, 50, 4), (1, 0, 0), (1, 100, 1), (1, 100, 1)]
    assert perm.tolist() == [0, 2, 1, 3, 4, 6, 5]
    # a graph plan: empty requests up to its fixed count, then the pad rows' request
    assert fb.padded(reqs, 7, 10, 7) == reqs + [(0, 0, 0), (3, 0, 0)]
    with pytest.raises(ValueError, match="5 FlashInfer requests exceeds the graph plan's 4"):
        fb.padded(reqs, 7, 10, 5)
    lay = fb.layout_of(fb.swa_part(view, 4, floored=True))
    assert lay.small == [0, 2, 4, 7, 0, 0, 2, 5, 0, 2, 3, 0, 1, 1]
    assert lay.kv_indices.tolist() == [107, 108, 200, 201, 202]
    assert lay.longest == 3  # FlashInfer's plan is told, not left to count it


@pytest.mark.parametrize("with_kernel", [False, pytest.param(True, marks=needs_triton)])
def test_merge_is_one_softmax_over_both_key_sets_and_the_sink(with_kernel):
    if with_kernel:
        check_interpreted("flashinfer_merge_cases", "check_merge")
    else:
        flashinfer_merge_cases.check_merge("cpu", kernel=False)


@pytest.fixture(scope="module")
def models():
    cfg = small_config()
    torch.manual_seed(0)
    ref = build_model(cfg.replace(attention_impl="reference"))
    fim = build_model(cfg.replace(attention_impl="flashinfer"))
    fim.load_state_dict(ref.state_dict())
    return ref, fim


def _runner(model, **kw):
    return StepRunner(model, max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN,
                      attention_wrapper_factory=flashinfer_semantics.factory if model.cfg.attention_impl == "flashinfer"
                      else None, **kw)


def _agree(runner, oracle, reqs, i):
    reqs = [RequestChunk(f"{r.req_id}{i}", r.query_len, r.seq_len, keep_all=r.keep_all, kv_start=r.kv_start)
            for r in reqs]
    for r in (runner, oracle):
        r.prefill_context(reqs, forward=r.model)
    got, want = runner.step(reqs), oracle.step(reqs)
    assert max_abs_err(got.logits, want.logits) < 1e-4, reqs
    assert max_abs_err_kv(runner.kv, oracle.kv, got.batch) < 1e-4, reqs
    for r in (runner, oracle):
        for q in reqs:
            r.free(q.req_id)
    return got


def test_eager_model_matches_the_reference(models):
    ref, fim = models
    runner, oracle = _runner(fim), _runner(ref)
    for i, reqs in enumerate(COMPOSITIONS):
        _agree(runner, oracle, reqs, i)
    planned = runner.attention._wrappers
    assert {slot for slot, _ in planned} == {"main"}  # the uncompiled model reads the whole batch


def test_flashinfer_batches_get_no_row_blocks(models, monkeypatch):
    """The row blocks are built with every batch of a runner whose attention reads
    them (the Triton kernel, and the reference attention inside FULL graphs), and not
    with FlashInfer's, which never reads them: building them is host time before a
    step's first kernel."""
    from replay_backend.reference import attention_ops, attention_triton

    ref, fim = models
    reqs = [RequestChunk("a", 100, 100), RequestChunk("b", 9, 9)]
    for model, blocks in ((ref, True), (fim, False)):
        runner = _runner(model)
        for batch in (runner.build_batch(reqs), runner.dummy_batch(70)):
            assert (attention_ops.ATTN_BLOCKS in batch.view.derived) is blocks
            assert (attention_ops.ATTN_BLOCKS in batch.replay.view.derived) is blocks
    monkeypatch.setattr(attention_triton, "available", lambda: True)
    assert attention_ops.view_fields("triton", "cpu") is attention_ops.VIEW_FIELDS
    assert attention_ops.view_fields("auto", "cuda") is attention_ops.VIEW_FIELDS
    assert attention_ops.view_fields("auto", "cpu") is attention_ops.VIEW_FIELDS
    # the model's own compressed slots, whatever attends
    assert attention_ops.view_fields("flashinfer", "cuda") == attention_ops.COMP_FIELD


def test_compiled_model_plans_each_view_before_it_is_read(models):
    """Served steps through captured (emulated) graphs: trimmed steps plan the replay
    view into the replay graph's wrappers before it replays, always at the graph's
    request and row count; steps without a replay graph plan a wrapper of their own."""
    ref, fim = models
    backend = ReplayBackend(compiler="eager", max_num_seqs=MAX_NUM_SEQS, max_cudagraph_capture_size=64,
                            decoder_replay_trim_threshold=48, strict=True)
    runner, oracle = _runner(fim, backend=backend), _runner(ref)
    runner.capture()
    graph_plans = {k: w.inner.plans for k, w in runner.attention._wrappers.items() if isinstance(k[0], int)}
    assert graph_plans, "capture planned no replay graph"
    kinds = set()
    more = [[RequestChunk("a", 100, 100)], [RequestChunk("a", 90, 120, kv_start=100), RequestChunk("b", 1, 9)],
            [RequestChunk("a", 20, 20), RequestChunk("b", 1, 30)]]
    for i, reqs in enumerate(COMPOSITIONS + more + COMPOSITIONS):
        out = _agree(runner, oracle, reqs, i)
        kinds.add((out.step.kind if out.step else "eager", out.trim.trimmed, out.trim.graph))
    # trimmed into a replay graph, graphed but untrimmed (the region's graph on the
    # whole batch), eager and trimmed into a replay graph
    assert {("piecewise", True, True), ("piecewise", False, True), ("eager", True, True)} <= kinds, kinds
    wrappers = runner.attention._wrappers
    assert any(wrappers[k].inner.plans > n for k, n in graph_plans.items())  # planned again while serving
    for (slot, _), w in wrappers.items():
        if isinstance(slot, int):
            assert set(w.inner.plan_rows) == {slot}, (slot, w.inner.plan_rows)


def test_plans_outside_graphs_split_only_where_a_row_reads_many_keys(models, monkeypatch):
    """FlashInfer would split any plan's keys to fill the GPU. Outside graphs a part's
    plan may split only where some row reads at least MIN_SPLIT_KEYS keys: never the
    SWA part (a row reads at most the window), the global parts of a long request."""
    ref, fim = models
    window = fim.cfg.window
    monkeypatch.setattr(fi, "MIN_SPLIT_KEYS", 48)
    assert window < 48
    runner, oracle = _runner(fim), _runner(ref)

    def splits(reqs, i) -> dict:
        _agree(runner, oracle, reqs, i)
        return {part: w.inner.split for (slot, part), w in runner.attention._wrappers.items() if slot == "main"}

    # the ratio-1 part reads 40 keys, the ratio-2 part 20: neither splits
    assert splits([RequestChunk("a", 40, 40)], 0) == {("swa", False): False, ("swa", True): False,
                                                      ("global", 1): False, ("global", 2): False}
    # 100 and 50: both global parts may split; the SWA keys, 30 + window - 1 per request, never
    assert splits([RequestChunk("a", 30, 100)], 1) == {("swa", False): False, ("swa", True): False,
                                                       ("global", 1): True, ("global", 2): True}
    # a row reads what counts, not its request's keys: the SWA request lists 40 + window - 1
    # positions, the ratio-2 part's requests (its residue classes) 30 entries, 60 positions
    assert splits([RequestChunk("a", 40, 60)], 2) == {("swa", False): False, ("swa", True): False,
                                                      ("global", 1): True, ("global", 2): False}


def _plans_of(att, key) -> int:
    w = att._wrappers.get(key)
    return 0 if w is None else w.inner.plans


def test_a_trimming_step_plans_the_whole_batch_for_the_main_layers_only(models):
    """Only the replay layers read the whole batch's floored SWA keys, and a step that
    trims runs them on the replay view: its metadata build plans the whole batch for
    the main layers, and the replay region plans that part itself where it runs on the
    whole batch without a graph. A model without a region, whose replay layers read
    the whole batch with no region to plan it, gets every part up front."""
    ref, fim = models
    floored = ("main", ("swa", True))
    oracle = _runner(ref)
    for decoder_replay in (True, False):
        backend = ReplayBackend(compiler="eager", max_num_seqs=MAX_NUM_SEQS, max_cudagraph_capture_size=64,
                                decoder_replay_trim_threshold=48, decoder_replay=decoder_replay, strict=True)
        runner = _runner(fim, backend=backend)
        runner.capture()
        assert backend.replays_in_region is decoder_replay
        kinds = set()
        # trimmed into a graph; untrimmed in a graph (of the region's own wrappers); untrimmed
        # beyond the graphs, the region's plan of the whole batch; trimmed beyond the graphs
        more = [[RequestChunk("a", 100, 100)], [RequestChunk("a", 20, 20)],
                [RequestChunk("a", 100, 100, keep_all=True)], [RequestChunk(f"a{k}", 20, 20) for k in range(5)]]
        for i, reqs in enumerate(COMPOSITIONS + more):
            reqs = [RequestChunk(f"{r.req_id}{decoder_replay}{i}", r.query_len, r.seq_len, keep_all=r.keep_all,
                                 kv_start=r.kv_start) for r in reqs]
            for r in (runner, oracle):
                r.prefill_context(reqs)
            before = _plans_of(runner.attention, floored)
            got, want = runner.step(reqs), oracle.step(reqs)
            assert max_abs_err(got.logits, want.logits) < 1e-4, reqs
            kind = (got.trim.trimmed, got.trim.graph) if got.trim else None  # None: no replay region
            kinds.add(kind)
            whole = kind in (None, (False, False))
            assert _plans_of(runner.attention, floored) - before == whole, (reqs, got.trim)
            for r in (runner, oracle):
                for q in reqs:
                    r.free(q.req_id)
        assert kinds == ({(True, True), (False, True), (False, False), (True, False)} if decoder_replay
                         else {None})


def test_attention_on_a_view_planned_without_its_part_is_an_error(models):
    """A whole batch planned for the main layers only, then read by a replay layer (a
    runner that plans like a region would, without one): a clear error, not a stale plan,
    also where that part was planned for the view once and has since been planned over."""
    _, fim = models
    runner = _runner(fim)
    att = runner.attention
    batch, other = (runner.build_batch([RequestChunk(r, n, n)]) for r, n in (("a", 40), ("b", 30)))
    heads, d = fim.cfg.num_heads, fim.cfg.head_dim
    q = torch.randn(40, heads, d)
    cache = torch.randn(att.num_slots, d)
    for earlier in (None, other):
        if earlier is not None:  # every part of the batch, then every part of another
            att.prepare(batch.view, None)
            att.prepare(earlier.view, None)
        att.prepare_main(batch.view)
        fr.attend(q, torch.empty_like(q), cache, None, 1, batch.view, False, torch.zeros(heads))
        with pytest.raises(RuntimeError, match="planned for the main layers only"):
            fr.attend(q, torch.empty_like(q), cache, None, 1, batch.view, True, torch.zeros(heads))


def test_graph_plans_may_list_more_pages_than_the_cache_has_slots(models):
    """Capture's dummy requests all read the same slots, so the plan of a replay graph
    larger than the cache (graphs up to the token budget, the trim threshold above them,
    one short request) lists more page indices than there are slots: the graph's
    page-index buffer must hold them."""
    ref, fim = models
    sizes = [8, 16, 32, 64, 128, 256]
    backend = ReplayBackend(compiler="eager", max_num_seqs=1, max_num_batched_tokens=256,
                            max_cudagraph_capture_size=256, cudagraph_capture_sizes=sizes, strict=True)
    kw = dict(max_num_seqs=1, max_model_len=130, max_num_batched_tokens=256)
    runner = StepRunner(fim, backend=backend, attention_wrapper_factory=flashinfer_semantics.factory, **kw)
    oracle = StepRunner(ref, **kw)
    assert runner.attention.num_slots < max(sizes)
    runner.capture()
    assert any(isinstance(slot, int) and slot > runner.attention.num_slots for slot, _ in runner.attention._wrappers)
    got, want = runner.step([RequestChunk("a", 120, 120)]), oracle.step([RequestChunk("a", 120, 120)])
    assert got.trim.graph, got.trim
    assert max_abs_err(got.logits, want.logits) < 1e-4


def _run_graph_plans(att, view, size: int, cache: torch.Tensor) -> None:
    """Plan ``view`` for a replay graph of ``size`` rows and run each part's plan."""
    att.prepare(view, size)
    q = torch.randn(size, att.cfg.num_heads, att.cfg.head_dim)
    for planned in view.derived[fr.PLAN].values():
        fr._run(planned, q, cache, torch.empty_like(q), torch.empty(q.shape[:2]))


def test_graph_plans_that_do_not_split_read_a_cleared_work_list(models):
    """A large replay graph's plan does not split its keys: FlashInfer then launches the
    graph's worst-case count of blocks, and those past the plan's work list read what
    that memory held before. Each wrapper is made with it cleared, so they read zeros or
    an earlier plan's entries, never a wild request index (the emulation faults as the
    GPU did, with an illegal memory access, where the memory is not cleared)."""
    _, fim = models
    runner = _runner(fim, max_num_batched_tokens=1024)
    att, size = runner.attention, 1024
    assert not att.graphs_split and not att._graph_splits(size, att.graph_batch(size))
    cache = torch.randn(att.num_slots, att.cfg.head_dim)
    for reqs in ([RequestChunk("a", 40, 40)], [RequestChunk("b", 300, 300), RequestChunk("c", 9, 9)]):
        batch = runner.build_batch(reqs)
        _run_graph_plans(att, batch.view, size, cache)
    wrappers = [w for (slot, _), w in att._wrappers.items() if slot == size]
    assert wrappers and all(not w.split and w.inner.work[0] < w.inner.work[1] for w in wrappers)


def test_a_slots_plans_take_turns_in_host_memory(models):
    """A plan is host memory that copies queued on the stream read later, so planning
    into memory whose copy is still queued must wait for the GPU. Consecutive plans of a
    slot stage their work lists in different memory, and the plan after them in the
    first one's again: a plan waits only for the copies of the plan two before it
    (test_gpu.py holds FlashInfer to this with the GPU kept busy)."""
    ref, fim = models
    runner, oracle = _runner(fim), _runner(ref)
    for i in range(3):
        _agree(runner, oracle, [RequestChunk("a", 40 + i, 40 + i), RequestChunk("b", 7, 7)], i)
    wrappers = runner.attention._wrappers.values()
    assert runner.attention.turns == fi.TURNS == 2 and wrappers
    for w in wrappers:
        first, second, third = w.inner.staged_in
        assert first != second and third == first, w.inner.staged_in


class NoPlanMemoryWrapper(flashinfer_semantics.EmulatedPrefillWrapper):
    """A FlashInfer that keeps its plans' work list elsewhere: nothing to clear."""

    def __init__(self, graph_buffers) -> None:
        super().__init__(graph_buffers)
        del self._pin_memory_int_workspace_buffer


def test_without_plan_memory_to_clear_every_graph_plan_splits(models):
    """Where the adapter does not find the plan memory, graph plans take FlashInfer's
    guarded path (every one splits, with the float workspace for a graph's worst case):
    a counted, logged fallback, an error when strict."""
    from replay_backend.fallbacks import StrictFallbackError
    from replay_backend.counters import counters

    _, fim = models
    args = (fim.cfg, MAX_NUM_SEQS * MAX_MODEL_LEN + 1, MAX_NUM_SEQS, 4097, MAX_MODEL_LEN, "cpu", torch.float32)
    usual = fi.FlashInferAttention(*args, factory=flashinfer_semantics.factory)
    with counters.expect(fallbacks={"flashinfer_graph_split": 1}):
        att = fi.FlashInferAttention(*args, factory=NoPlanMemoryWrapper)
    assert att.graphs_split and att._graph_splits(1024, att.graph_batch(1024))
    assert not usual._graph_splits(1024, usual.graph_batch(1024))
    assert att.turns == 1 and usual.turns == 2  # without staging buffers to hand out, a plan waits
    assert att.float_bytes > usual.float_bytes
    runner = _runner(fim, max_num_batched_tokens=1024)
    batch = runner.build_batch([RequestChunk("a", 40, 40)])
    _run_graph_plans(att, batch.view, 1024, torch.randn(att.num_slots, att.cfg.head_dim))
    assert all(w.split for w in att._wrappers.values())
    with pytest.raises(StrictFallbackError, match="flashinfer_graph_split"):
        fi.FlashInferAttention(*args, factory=NoPlanMemoryWrapper, strict=True)


class _CountedKernels:
    """A kernel module that counts its calls for its wrapper, per plan."""

    def __init__(self, kernels, wrapper) -> None:
        self.kernels, self.wrapper = kernels, wrapper

    def paged_run(self, *args):
        self.wrapper.counts[-1][1] += 1
        return self.kernels.paged_run(*args)


class CountingWrapper(flashinfer_semantics.EmulatedPrefillWrapper):
    """The emulation, counting per plan its ``run()`` calls and its kernels' calls."""

    def __init__(self, graph_buffers) -> None:
        super().__init__(graph_buffers)
        self.counts: list[list[int]] = []  # [run() calls, kernel calls] per plan
        self._cached_module = _CountedKernels(self._cached_module, self)

    def plan(self, **kw) -> None:
        super().plan(**kw)
        self.counts.append([0, 0])

    def run(self, *args, **kw) -> None:
        self.counts[-1][0] += 1
        super().run(*args, **kw)


class FreshArgumentWrapper(CountingWrapper):
    """Hands its kernels a fresh copy of the plan's page pointers at every call: no
    argument list can be learned from its calls."""

    def run(self, *args, **kw) -> None:
        self.kv = list(self.kv)
        super().run(*args, **kw)


def _counting_runner(fim, wrapper_class):
    made = []

    def factory(buffers):
        made.append(wrapper_class(buffers))
        return made[-1]

    runner = StepRunner(fim, max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN,
                        attention_wrapper_factory=factory)
    return runner, made


def test_a_plans_later_calls_go_straight_to_the_kernels(models):
    """After each plan a wrapper's first two calls go through its run(), recorded; the
    plan's later calls pass the recorded arguments with their own tensors straight to
    the kernel module, and every step still agrees with the reference."""
    from replay_backend.counters import counters

    ref, fim = models
    runner, made = _counting_runner(fim, CountingWrapper)
    oracle = _runner(ref)
    with counters.expect(fallbacks={}):
        for i, reqs in enumerate(COMPOSITIONS):
            _agree(runner, oracle, reqs, i)
    plans = [c for w in made for c in w.counts]
    assert any(kernel > 2 for _, kernel in plans)
    assert all(runs == min(kernel, 2) for runs, kernel in plans), plans


def _one_request_planned(fim, factory, strict: bool = False):
    """Attention of ``factory``'s wrappers with a one-request batch of 40 rows planned,
    the batch, and a call of its SWA part (new random query and cache each time)."""
    att = fi.FlashInferAttention(fim.cfg, MAX_NUM_SEQS * MAX_MODEL_LEN + 1, MAX_NUM_SEQS, 4097, MAX_MODEL_LEN,
                                 "cpu", torch.float32, factory=factory, strict=strict)
    batch = _runner(fim).build_batch([RequestChunk("a", 40, 40)])
    att.prepare(batch.view, None)
    heads, d = fim.cfg.num_heads, fim.cfg.head_dim

    def attend() -> None:
        q = torch.randn(40, heads, d)
        fr.attend(q, torch.empty_like(q), torch.randn(att.num_slots, d), None, 1, batch.view, False,
                  torch.zeros(heads))

    return att, batch, attend


def test_a_learned_call_with_other_tensors_goes_through_run(models):
    """A call whose tensors differ in shape from the ones its plan's calls were learned
    from goes through run(), whose checks see it: here a query of the wrong row count."""
    _, fim = models
    att, batch, attend = _one_request_planned(fim, CountingWrapper)
    for _ in range(3):
        attend()
    heads, d = fim.cfg.num_heads, fim.cfg.head_dim
    q, cache = torch.randn(40, heads, d), torch.randn(att.num_slots, d)
    wrapper = att._wrappers[("main", ("swa", False))]
    assert wrapper.inner.counts[-1] == [2, 3]
    planned = batch.view.derived[fr.PLAN][("swa", False)]
    with pytest.raises(ValueError, match="q has 39 rows, the plan 40"):
        wrapper.run(q[:39], (cache.view(-1, 1, 1, d),) * 2, torch.empty_like(q[:39]), torch.empty(39, heads))
    assert wrapper.inner.counts[-1] == [3, 4] and planned.wrapper is wrapper


def test_a_plan_whose_calls_differ_beyond_their_tensors_keeps_run(models):
    """Where two calls of one plan hand the kernels arguments that differ beyond the
    call's tensors, nothing is learned: every call of that plan goes through run(), one
    counted, logged fallback per plan, an error when strict."""
    from replay_backend.fallbacks import StrictFallbackError
    from replay_backend.counters import counters

    ref, fim = models
    runner, made = _counting_runner(fim, FreshArgumentWrapper)
    before = counters.fallbacks["flashinfer_direct_call"]
    _agree(runner, _runner(ref), COMPOSITIONS[0], 0)
    plans = [c for w in made for c in w.counts]
    assert all(runs == kernel for runs, kernel in plans) and any(kernel > 2 for _, kernel in plans)
    assert counters.fallbacks["flashinfer_direct_call"] - before == sum(kernel >= 2 for _, kernel in plans)
    _, _, attend = _one_request_planned(fim, FreshArgumentWrapper, strict=True)
    attend()
    with pytest.raises(StrictFallbackError, match="flashinfer_direct_call"):
        attend()


def test_flashinfer_needs_its_package_cuda_and_a_16_bit_model(models):
    _, fim = models
    with pytest.raises(ValueError, match="attention_impl='flashinfer'"):
        StepRunner(fim, max_model_len=64)


def test_a_batch_run_again_after_another_is_planned_again(models):
    """Batches A and B built, run A, B, then A again: A's plans live in wrappers that B's
    planning took over, so A is planned again instead of running on B's plan."""
    ref, fim = models
    runner, oracle = _runner(fim), _runner(ref)
    a = [RequestChunk("a", 40, 40), RequestChunk("b", 7, 7)]
    b = [RequestChunk("c", 20, 20)]
    batch_a, batch_b = runner.build_batch(a), runner.build_batch(b)
    runner.run(batch_a), runner.run(batch_b)
    got = runner.run(batch_a)
    want = oracle.step(a)
    assert max_abs_err(got.logits, want.logits) < 1e-4


class StandInWrapper(flashinfer_semantics.EmulatedPrefillWrapper):
    """The emulation behind FlashInfer 0.6.13's constructor and workspace API, for a
    stand-in ``flashinfer`` module: a wrong argument name fails as it would there."""

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, qo_indptr_buf=None,
                 paged_kv_indptr_buf=None, paged_kv_indices_buf=None, paged_kv_last_page_len_buf=None,
                 custom_mask_buf=None, mask_indptr_buf=None, backend="auto", jit_args=None) -> None:
        assert kv_layout == "NHD" and use_cuda_graph == (qo_indptr_buf is not None)
        super().__init__(dict(qo_indptr_buf=qo_indptr_buf, paged_kv_indptr_buf=paged_kv_indptr_buf,
                              paged_kv_indices_buf=paged_kv_indices_buf,
                              paged_kv_last_page_len_buf=paged_kv_last_page_len_buf) if use_cuda_graph else None)
        self.backend, self.workspaces = backend, None

    def reset_workspace_buffer(self, float_workspace_buffer, int_workspace_buffer) -> None:
        self.workspaces = (float_workspace_buffer.numel(), int_workspace_buffer.numel())


def test_wrappers_are_made_through_flashinfers_api(models, monkeypatch):
    """The default wrappers, made through a stand-in ``flashinfer`` module with FlashInfer
    0.6.13's constructor: the fa2 backend, CUDA-graph buffers for a replay graph's
    wrappers, the workspaces this model's plans need; a broken install is a clear error."""
    import types

    _, fim = models
    monkeypatch.setitem(sys.modules, "flashinfer",
                        types.SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=StandInWrapper))
    att = fi.FlashInferAttention(fim.cfg, MAX_NUM_SEQS * MAX_MODEL_LEN + 1, MAX_NUM_SEQS, 257, MAX_MODEL_LEN, "cpu",
                                 torch.float32)
    runner = _runner(fim)
    batch = runner.build_batch([RequestChunk("a", 40, 40), RequestChunk("b", 9, 9)])
    att.prepare(batch.view, None)
    att.prepare(batch.replay.view, 64)
    made = {slot: w.inner for (slot, _), w in att._wrappers.items()}
    assert set(made) == {"main", 64}
    assert all(w.backend == "fa2" and w.workspaces == (att.float_bytes, att.int_bytes) for w in made.values())
    assert made[64].graph_batch == att.graph_batch(64) and made["main"].graph_batch is None
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # installed, but its import fails
    monkeypatch.setattr(flashinfer_import, "available", lambda: True)
    with pytest.raises(ValueError, match="importing flashinfer failed"):
        flashinfer_import.check_supported("cuda", torch.bfloat16)


def _flashinfer_check(monkeypatch, wrapper_class):
    """scripts/flashinfer_check.py, its FlashInfer a stand-in module of ``wrapper_class``."""
    import importlib.util
    import pathlib

    from replay_backend.reference import runner as runner_module

    monkeypatch.setitem(sys.modules, "flashinfer", SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=wrapper_class))
    monkeypatch.setattr(runner_module, "check_supported", lambda *a: None)
    path = pathlib.Path(__file__).parents[1] / "scripts" / "flashinfer_check.py"
    spec = importlib.util.spec_from_file_location("flashinfer_check", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "flashinfer_check", module)  # its dataclasses look it up
    spec.loader.exec_module(module)
    return module


class WrongRowWrapper(StandInWrapper):
    """The stand-in, with one row of every SWA part's output NaN: a kernel fault that no
    comparison with a limit may let pass."""

    def run(self, q, kv, *, out, lse, return_lse) -> None:
        super().run(q, kv, out=out, lse=lse, return_lse=return_lse)
        if self.window_left >= 0 and out.shape[0] > 30:
            out[30] = math.nan


ARGV = ["--device", "cpu", "--model-option", "num_layers=8", "--model-option", "kv_source_layer_ids=1,3",
        "--model-option", "window=16", "--max-model-len", "256", "--batch", "p:40/90@60,d:1/30"]


def test_flashinfer_check_passes_a_faithful_wrapper_and_names_a_wrong_row(monkeypatch, capsys, tmp_path):
    """The GPU diagnosis tool, on the CPU: against a wrapper that is the semantics it
    finds nothing; against one that zeroes a row it names the call, the row and its
    request, and the step drifts from PyTorch's attention."""
    assert _flashinfer_check(monkeypatch, StandInWrapper).main(ARGV) == 0
    out = capsys.readouterr().out
    assert "15 FlashInfer calls" in out, out  # every call checked: none straight to the kernels
    assert "0 above 0.02 (and 0 while building its context)" in out and "OUT OF BOUNDS" not in out, out
    check = _flashinfer_check(monkeypatch, WrongRowWrapper)
    assert check.main(ARGV + ["--no-split", "--dump", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "(swa, window_left 15, split off)" in out and "worst row 30 (request 0) rel L2 inf" in out, out
    assert "requests rows/keys: 40/55 1/16" in out and "OUT OF BOUNDS" in out
    dumps = sorted(tmp_path.iterdir())
    # the context's prefill (50 rows) has a row 30 too: the first dumps are its calls
    assert len(dumps) == check.DUMPS and all(d.name.startswith("batch0-context-call") for d in dumps), dumps
    call = torch.load(dumps[0])
    assert call["out"][30].isnan().all() and call["want"][30].abs().max() > 0
    assert call["plan"]["split"] is False and call["plan"]["window_left"] == 15


@pytest.mark.parametrize("options", [{}, {"decoder_replay": False}], ids=["region", "no-region"])
def test_full_graphs_plan_each_view_into_the_graph_wrappers_before_they_replay(models, options):
    """full_and_piecewise with FlashInfer: a step below the trim threshold runs as one
    (emulated) FULL graph, whose views the step plans into wrappers of the graph's size
    before it replays: the whole batch for the main layers (the ratio-2 global part's
    rows permuted through fixed buffers), its replay twin for the replay layers. Each
    replay reads the new step's plans, never the captured step's; trimming steps still
    run in pieces. Without a replay region (``decoder_replay`` off) the replay layers
    read their view between the main layers, inside the FULL graph too: planned alike.
    All against the reference attention."""
    ref, fim = models
    backend = ReplayBackend(compiler="eager", max_num_seqs=MAX_NUM_SEQS, max_cudagraph_capture_size=64,
                            decoder_replay_trim_threshold=48, strict=True, cudagraph_mode="full_and_piecewise",
                            **options)
    runner, oracle = _runner(fim, backend=backend), _runner(ref)
    summary = runner.capture()
    assert summary["full"]["graphs"] > 0, summary
    steps = [[RequestChunk("a", 1, 30), RequestChunk("b", 1, 2)], [RequestChunk("a", 3, 40)],
             [RequestChunk("a", 20, 61, kv_start=50), RequestChunk("b", 1, 9), RequestChunk("c", 7, 25)],
             [RequestChunk("a", 1, 17)], COMPOSITIONS[0], [RequestChunk("a", 2, 33), RequestChunk("b", 1, 5)]]
    kinds = []
    for i, reqs in enumerate(steps):
        kinds.append(_agree(runner, oracle, reqs, i).step.kind)
    # without a region nothing trims, and the 48-token step is FULL too
    assert kinds == ["full"] * 4 + ["piecewise" if not options else "full", "full"], kinds
    wrappers = runner.attention._wrappers
    graph_parts = {part for (slot, part) in wrappers if isinstance(slot, int)}
    assert {("swa", False), ("global", 2), ("swa", True), ("global", 1)} <= graph_parts, graph_parts
    for (slot, _), w in wrappers.items():
        if isinstance(slot, int):
            assert set(w.inner.plan_rows) == {slot}, (slot, w.inner.plan_rows)
