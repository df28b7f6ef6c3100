"""GPU tests (CUDA graphs, Triton attention, grouped MoE); skipped without CUDA."""
from __future__ import annotations

import contextlib

import pytest
import torch

from replay_backend import RequestChunk, StepRunner, build_model, preset
from replay_backend.backend import ReplayBackend
from replay_backend.bench.modes import WIDE_SIZES
from replay_backend.reference.compare import kept_kv, max_abs_err, max_abs_err_kv, within_band
from replay_backend.counters import counters
from replay_backend.reference import attention_flashinfer, flashinfer_import

import flashinfer_merge_cases

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fresh_dynamo"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CFG = preset("tiny").with_layers(8, (1, 3)).replace(window=16)
OPTS = dict(max_num_seqs=4, max_cudagraph_capture_size=64, decoder_replay_trim_threshold=48)
COMPOSITIONS = [
    [RequestChunk("a", 1, 40), RequestChunk("b", 50, 50), RequestChunk("c", 10, 30)],
    [RequestChunk("a", 1, 9), RequestChunk("b", 1, 17), RequestChunk("c", 3, 33)],
    [RequestChunk("a", 100, 100)],
    [RequestChunk("a", 30, 30, keep_all=True), RequestChunk("b", 30, 70)],
    [RequestChunk("a", 45, 45)],
    [RequestChunk("a", 70, 200), RequestChunk("b", 2, 80)],
]


@pytest.fixture(scope="module")
def model():
    return build_model(CFG, "cuda", torch.bfloat16)


@pytest.fixture(scope="module")
def model32():
    return build_model(CFG, "cuda", torch.float32)


def test_triton_attention_matches_reference(model32):
    """fp32, exact-precision dots: the kernel and the PyTorch reference agree tightly."""
    ref = build_model(CFG.replace(attention_impl="reference", moe_impl="dense"), "cuda", torch.float32)
    a, b = StepRunner(model32, max_model_len=512), StepRunner(ref, max_model_len=512)
    for reqs in COMPOSITIONS:
        a.prefill_context(reqs), b.prefill_context(reqs)
        oa, ob = a.step(reqs), b.step(reqs)
        assert max_abs_err(oa.logits, ob.logits) < 1e-3
        assert max_abs_err_kv(a.kv, b.kv, oa.batch) < 1e-3
    # Every source's global entries too (written by cache_triton.py on one side), but
    # the pad slot: the reference fills it with throw-away values, the kernel skips it.
    for src, glob in a.kv.glob.items():
        assert glob[:-1].abs().max() > 0 and max_abs_err(glob[:-1], b.kv.glob[src][:-1]) < 1e-3


def agree(got, want, runner, oracle, tol: float | None) -> bool:
    """Logits and kept replay KV: within ``tol`` (max |d|), or for 16-bit models
    (``tol`` None) within 1.5 times the model's rounding-noise band."""
    if tol is None:
        return within_band(got.logits, want.logits) and \
            within_band(kept_kv(runner.kv, got.batch), kept_kv(oracle.kv, got.batch))
    return max_abs_err(got.logits, want.logits) < tol and max_abs_err_kv(runner.kv, oracle.kv, got.batch) < tol


@contextlib.contextmanager
def no_host_sync():
    """Raise on any synchronizing CUDA call made through PyTorch inside (a device-to-host
    copy, ``.item()``, a stream or device synchronize): a served step must never wait
    for the GPU. Calls that do not go through PyTorch (FlashInfer's own) and event waits
    are not seen."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):  # the mode is on: one known sync is refused
            torch.zeros(1, device="cuda").item()
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def check_compositions(model, compiler: str, tol: float | None) -> None:
    """One captured, serving runner (one compile) vs the eager oracle on every composition,
    each after the same cached context built by the oracle path. No served step makes a
    host sync (:func:`no_host_sync`)."""
    # strict: a fallback (the trim op's row-moves kernel among them) fails the test
    runner = StepRunner(model, max_model_len=512, backend=ReplayBackend(compiler=compiler, strict=True, **OPTS))
    oracle = StepRunner(model, max_model_len=512)
    runner.capture()
    kinds = set()
    copies = counters.trim_index_copies
    for i, reqs in enumerate(COMPOSITIONS):
        reqs = [RequestChunk(f"{r.req_id}{i}", r.query_len, r.seq_len, keep_all=r.keep_all) for r in reqs]
        for r in (runner, oracle):
            r.prefill_context(reqs, forward=model)
        with no_host_sync():
            got = runner.step(reqs)
        want = oracle.step(reqs)
        kinds.add((got.step.kind, got.trim.trimmed, got.trim.graph, got.trim.io_graphs))
        assert agree(got, want, runner, oracle, tol), reqs
        for r in (runner, oracle):
            for q in reqs:
                r.free(q.req_id)
    # the compositions cover graphed steps that trim into replay graphs (gathers and
    # scatter in graphs too), graphed steps that do not trim, and eager steps that trim
    assert {("piecewise", True, True, True), ("piecewise", False, True, False),
            ("eager", True, True, False)} <= kinds, kinds
    assert counters.trim_index_copies == copies  # the gather graphs read served rows in place


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_compiled_matches_oracle_fp32(model32, compiler):
    check_compositions(model32, compiler, 1e-3)


def test_compiled_matches_oracle_bf16(model):
    """bf16 with the oracle's own kernels: only graph capture and trimming differ."""
    check_compositions(model, "eager", None)


def test_graph_replay_equals_eager_pieces_exactly(model32):
    """The same compiled pieces on the same batch with and without graphs: bit-identical
    logits and KV. 56 tokens and 32 replay rows are capture sizes, so nothing is padded
    differently and every kernel sees the same shapes."""
    reqs = [RequestChunk("a", 40, 40), RequestChunk("b", 16, 16)]
    be = ReplayBackend(compiler="inductor", **OPTS)
    graphs = StepRunner(model32, max_model_len=512, backend=be)
    graphs.capture()
    # the same compiled model as a plain forward of a runner of its own (its own cache)
    plain = StepRunner(model32, max_model_len=512, forward=graphs.compiled)
    og = graphs.step(reqs)
    assert og.step.kind == "piecewise" and og.step.padded_tokens == 56
    assert og.trim.trimmed and og.trim.graph and og.trim.io_graphs and og.trim.padded == og.trim.rows == 32
    op = plain.run(plain.build_batch(reqs), use_graphs=False)
    assert op.step.kind == "eager" and not op.trim.graph
    assert torch.equal(og.logits, op.logits)
    def caches(kv):
        return [*kv.swa, *kv.glob.values(), *kv.raw.values()]

    for a, b in zip(caches(graphs.kv), caches(plain.kv)):
        assert torch.equal(a[:-1], b[:-1])  # the last slot is the pad slot capture wrote to


def test_capture_memory_is_about_one_step_and_matches_the_estimate(model):
    """83 main sizes up to 1024: graphs hold non-owning outputs, so the pool is about one
    1024-token step plus a fixed cost per graph, not every piece's outputs at every size;
    the estimate made before capture is close; every size still computes the right thing."""
    opts = dict(OPTS, max_cudagraph_capture_size=1024, decoder_replay_trim_threshold=768, max_num_seqs=8)
    be = ReplayBackend(compiler="eager", **opts)
    runner = StepRunner(model, max_model_len=1024, max_num_seqs=8, backend=be)
    oracle = StepRunner(model, max_model_len=1024, max_num_seqs=8)
    est = runner.estimate_graph_memory()
    summary = runner.capture()
    took = sum(level["gib"] for level in summary.values())
    assert 0 < est.total_gib < 1.0
    assert est.graphs >= sum(level["graphs"] for level in summary.values())
    assert 0.5 * est.total_gib <= took <= 1.5 * est.total_gib + 0.125, (summary, est)
    for reqs in ([RequestChunk("a", 900, 900)], [RequestChunk("a", 300, 300), RequestChunk("b", 1, 40)],
                 [RequestChunk("a", 130, 130), RequestChunk("b", 100, 100), RequestChunk("c", 37, 37)]):
        for r in (runner, oracle):
            r.prefill_context(reqs, forward=model)
        got, want = runner.step(reqs), oracle.step(reqs)
        assert got.step.kind == "piecewise"
        assert agree(got, want, runner, oracle, None), reqs
        for r in reqs:
            runner.free(r.req_id), oracle.free(r.req_id)


def test_no_recompiles_and_no_memory_growth(model):
    be = ReplayBackend(compiler="eager", **OPTS)
    runner = StepRunner(model, max_model_len=512, max_num_seqs=4, backend=be)
    runner.capture()
    before = counters.recompiles
    steps = [[RequestChunk(f"r{i}", 1 + (i * 7) % 60, 1 + (i * 7) % 60)] for i in range(1000)]
    for s in steps[:20]:
        runner.step(s)
        runner.free(s[0].req_id)
    torch.cuda.synchronize()
    mem0 = torch.cuda.memory_allocated()
    for s in steps[20:]:
        runner.step(s)
        runner.free(s[0].req_id)
    torch.cuda.synchronize()
    assert counters.recompiles == before
    assert torch.cuda.memory_allocated() - mem0 <= 1 << 20


def test_grouped_moe_matches_dense():
    from replay_backend.reference.moe import MoE

    gen = torch.Generator().manual_seed(0)
    moe = MoE(256, 8, 2, 128, 128, gen, impl="grouped").to("cuda", torch.bfloat16)
    x = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16)
    grouped = moe(x)
    moe.impl = "dense"
    dense = moe(x)
    assert max_abs_err(grouped, dense) < 0.05 * dense.abs().max().item()


def test_moe_kernels_match_the_pytorch_ops_to_the_bit(monkeypatch):
    """The grouped MoE's sort, SwiGLU and combine kernels (reference/moe_triton.py),
    compiled: the cases against the ops they replace, then the whole op with and without
    them on a mini-2k-shaped MoE, with a step above the kernels' size taking the
    PyTorch ops."""
    from moe_kernel_cases import check_against_reference
    from replay_backend.reference import moe_triton
    from replay_backend.reference.moe import MoE

    check_against_reference("cuda")
    gen = torch.Generator().manual_seed(0)
    moe = MoE(2048, 16, 2, 1024, 1024, gen, impl="grouped").to("cuda", torch.bfloat16)
    for t in (1000, 4096):
        x = torch.randn(t, 2048, device="cuda", dtype=torch.bfloat16)
        moe.permute_impl = "reference"
        want = moe(x)
        moe.permute_impl = "triton"
        assert torch.equal(moe(x), want), t
    monkeypatch.setattr(moe_triton, "MAX_PAIRS", 64)  # 4,096 tokens no longer fit: PyTorch sorts
    assert torch.equal(moe(x), want)


def test_fused_sinkhorn_matches_reference():
    from replay_backend.reference import sinkhorn_triton
    from replay_backend.reference.layers import sinkhorn

    mix = torch.randn(1000, 24, device="cuda") * 3  # a strided [T, 4, 4] view, as in the model
    logits = mix[:, 8:].view(1000, 4, 4)
    assert sinkhorn_triton.supports(logits)
    fused = torch.ops.dsv41.sinkhorn(logits, 20)
    assert max_abs_err(fused, sinkhorn(logits, 20)) < 1e-5
    ref = build_model(CFG.replace(sinkhorn_impl="reference"), "cuda", torch.float32)
    fast = build_model(CFG.replace(sinkhorn_impl="fused"), "cuda", torch.float32)
    a, b = StepRunner(fast, max_model_len=512), StepRunner(ref, max_model_len=512)
    reqs = COMPOSITIONS[0]
    a.prefill_context(reqs), b.prefill_context(reqs)
    assert max_abs_err(a.step(reqs).logits, b.step(reqs).logits) < 1e-3


def test_mhc_mix_ops_under_inductor_match_eager():
    """The hyper-connection mix as the model computes it (a bf16 projection with fp32
    results, its Sinkhorn part a strided view), compiled by Inductor with a dynamic token
    count: the same numbers as eager. The ops must read the layout Inductor gives them,
    not one fixed when they were traced."""
    from replay_backend.reference.layers import HyperConnection

    gen = torch.Generator().manual_seed(3)
    hc = HyperConnection(4, 256, 1e-6, 1e-6, 20, gen, sinkhorn_impl="fused").to("cuda", torch.bfloat16)
    compiled = torch.compile(hc, dynamic=True, fullgraph=True)
    for t in (300, 1000):
        stream = torch.randn(t, 4, 256, device="cuda", dtype=torch.bfloat16)
        for got, want in zip(compiled(stream), hc(stream)):
            assert max_abs_err(got, want) < 1e-4


def test_grouped_moe_under_inductor_matches_eager():
    """The grouped MoE op inside an Inductor-compiled graph (as in every piece of a bf16
    CUDA model) against the same module run eagerly."""
    from replay_backend.reference.moe import MoE

    gen = torch.Generator().manual_seed(0)
    moe = MoE(256, 8, 2, 128, 128, gen, impl="grouped").to("cuda", torch.bfloat16)
    x = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16)
    want = moe(x)
    got = torch.compile(moe, dynamic=True, fullgraph=True)(x)
    assert max_abs_err(got, want) < 0.05 * want.abs().max().item()


def test_mm_fp32_is_the_upcast_product():
    """16-bit operands into an fp32 result: the same numbers as upcasting first (exact
    products, fp32 sums), only the summation order may differ."""
    from replay_backend.reference.layers import mm_fp32

    x = torch.randn(3000, 8192, device="cuda").to(torch.bfloat16)
    w = torch.randn(24, 8192, device="cuda").to(torch.bfloat16)
    got = mm_fp32(x, w)
    want = x.double() @ w.double().t()
    assert got.dtype == torch.float32
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-5
    compiled = torch.compile(mm_fp32, fullgraph=True)(x, w)
    assert max_abs_err(compiled, got) < 1e-3


def test_step_metadata_copies_do_not_wait_for_the_device():
    """Building a step while the previous one runs must not block on it: every host to
    device copy of metadata is asynchronous (pinned), into fresh memory or into a
    serving runner's metadata buffer."""
    from replay_backend.step_metadata import MetadataBuffer, to_device

    runner = StepRunner(build_model(CFG, "cuda", torch.bfloat16), max_model_len=512)
    runner.prefill_context(COMPOSITIONS[0])  # the cached context its decodes and chunks read
    a = torch.randn(8192, 8192, device="cuda")
    torch.cuda.synchronize()
    for _ in range(20):  # about 0.1 s of queued GPU work
        a = a @ a / 8192 ** 0.5
    pending = torch.cuda.Event()
    pending.record()
    runner.build_batch(COMPOSITIONS[0])
    to_device(torch.arange(100), "cuda")
    MetadataBuffer(1000, "cuda").place(torch.arange(100))
    assert not pending.query(), "a metadata copy waited for the queued work"
    torch.cuda.synchronize()



def test_row_moves_kernel_matches_indexing():
    """The trim op's one-launch gather and scatter (dispatch/row_moves.py), compiled for
    the GPU, on the boundary tensors' dtypes and layouts, with rows at both ends."""
    from row_moves_cases import check_against_indexing

    check_against_indexing("cuda")


def test_cache_write_kernel_matches_the_reference_ops():
    """The attention ops' one-launch cache writes (reference/cache_triton.py), compiled for
    the GPU: SWA, raw and global caches against index_copy_ and the PyTorch compressor."""
    from cache_write_cases import check_against_reference

    check_against_reference("cuda")


def test_capture_survives_a_collection_that_frees_dropped_graphs():
    """A dropped runner's graphs, held only by a reference cycle, freed by an automatic
    collection in the middle of another capture: destroying a graph while the stream
    captures invalidates that capture unless collection is paused (graphs.py)."""
    import gc

    from replay_backend.capture.graphs import GraphResources, StaticGraph

    res = GraphResources(use_cuda=True)
    x = torch.arange(64, dtype=torch.float32, device="cuda")
    gc.collect()  # the cycle below starts in the youngest generation
    old = StaticGraph("old", lambda t: t * 2, (x,), res)
    holder = [[old]]
    holder[0].append(holder[0])  # a cycle: only a collection frees it
    del old
    thresholds = gc.get_threshold()

    def piece(t):
        holder.clear()  # the cycle is garbage now, in the middle of the capture
        gc.set_threshold(1, 1, 1)
        junk = [[i] for i in range(2000)]  # allocations that would start collections
        return t + len(junk)

    try:
        g = StaticGraph("new", piece, (x,), res)
    finally:
        gc.set_threshold(*thresholds)
    g.graph.replay()
    torch.testing.assert_close(g.outputs, x + 2000)
    assert gc.isenabled()


def test_attention_kernel_whole_and_split_match_the_reference():
    """The attention kernel with its global keys whole and in chunks, fp32 and bf16, and
    the model's steps with splits planned (attention_kernel_cases.py; the CPU tests run
    both under Triton's interpreter, fp32)."""
    import attention_kernel_cases

    attention_kernel_cases.check_against_reference("cuda")
    attention_kernel_cases.check_model_steps_split("cuda")


def test_serving_soak_at_the_real_window_has_no_mismatch():
    """A shorter scripts/soak.py: the 40-layer tiny preset (W = 128) in fp32, the
    backend's default options, 150 steps of random mixed traffic, every written cache
    slot and every logit against the oracle."""
    from replay_backend.reference.soak import soak

    report = soak(build_model(preset("tiny"), "cuda", torch.float32), 150, seed=11, max_num_seqs=8,
                  max_model_len=4096, max_num_batched_tokens=2048)
    print(report.render())
    assert report.mismatches == [] and not report.counters_moved.get("fallbacks"), report.render()
    assert {"piecewise/trimmed/replay-graph/io-graphs", "piecewise/untrimmed/replay-graph",
            "eager/trimmed/replay-graph"} <= set(report.kinds), report.kinds


# ---- attention_impl="flashinfer" (skipped where FlashInfer is not installed) ---------
needs_flashinfer = pytest.mark.skipif(not flashinfer_import.available(), reason="FlashInfer is not installed")
# Floors below, inside and above a chunk's rows, prompts from position 0; the last two
# with 100+ rows that see no key or only a few (beyond one of FlashInfer's key tiles).
FLOORED = [
    [RequestChunk("a", 50, 90, kv_start=70), RequestChunk("b", 3, 33)],
    [RequestChunk("a", 33, 33, keep_all=True), RequestChunk("b", 20, 61, kv_start=50)],
    [RequestChunk("a", 70, 200, kv_start=150), RequestChunk("b", 1, 2)],
    [RequestChunk("a", 300, 300)],
    [RequestChunk("a", 200, 400, kv_start=300), RequestChunk("b", 2, 130)],
]


def test_flashinfer_merge_kernel_is_one_softmax_over_both_key_sets_and_the_sink():
    flashinfer_merge_cases.check_merge("cuda")


@needs_flashinfer
@pytest.mark.parametrize("min_split_keys", [None, 32], ids=["as_is", "plans_split"])
def test_flashinfer_matches_the_fp32_reference(model, monkeypatch, min_split_keys):
    """Every step of the compositions, uncompiled: FlashInfer in bf16 against the PyTorch
    reference attention in fp32 (the same weights), within the bf16 band. The short
    prompts here read too few keys for a plan to split them (MIN_SPLIT_KEYS); with the
    threshold lowered FlashInfer may split every global part, merging its chunks itself."""
    if min_split_keys is not None:
        monkeypatch.setattr(attention_flashinfer, "MIN_SPLIT_KEYS", min_split_keys)
    fim = build_model(CFG.replace(attention_impl="flashinfer"), "cuda", torch.bfloat16)
    fim.load_state_dict(model.state_dict())
    ref = build_model(CFG.replace(attention_impl="reference", moe_impl="dense"), "cuda", torch.float32)
    ref.load_state_dict(model.state_dict())  # copied into fp32 parameters
    a, b = StepRunner(fim, max_model_len=512), StepRunner(ref, max_model_len=512)
    # FlashInfer's own wrappers: each plan's later calls go straight to its kernels
    # (flashinfer_compat.DirectCalls), learned without a fallback
    with counters.expect(strict=False, fallbacks={}):
        for i, reqs in enumerate(COMPOSITIONS + FLOORED):
            reqs = [RequestChunk(f"{r.req_id}{i}", r.query_len, r.seq_len, keep_all=r.keep_all,
                                 kv_start=r.kv_start) for r in reqs]
            a.prefill_context(reqs), b.prefill_context(reqs)
            oa, ob = a.step(reqs), b.step(reqs)
            assert within_band(oa.logits, ob.logits), (reqs, max_abs_err(oa.logits, ob.logits))
            assert within_band(kept_kv(a.kv, oa.batch), kept_kv(b.kv, ob.batch)), reqs
            for r in (a, b):
                for q in reqs:
                    r.free(q.req_id)
    assert any(w.calls.learned is not None for w in a.attention._wrappers.values())


@needs_flashinfer
def test_flashinfer_serving_matches_its_eager_model(model):
    """Captured and serving (replay graphs planned before each replay) against the same
    model uncompiled, on every composition."""
    fim = build_model(CFG.replace(attention_impl="flashinfer"), "cuda", torch.bfloat16)
    fim.load_state_dict(model.state_dict())
    check_compositions(fim, "eager", None)


@needs_flashinfer
def test_flashinfer_plans_the_next_step_while_the_gpu_runs_this_one(model):
    """A plan is host memory that copies queued on the stream read later. With the GPU
    held busy, two batches are planned one after the other into the same wrappers:
    neither plan waits for the GPU (the held work still runs after both), and each batch
    still runs right, against PyTorch's attention in bf16."""
    fim = build_model(CFG.replace(attention_impl="flashinfer"), "cuda", torch.bfloat16)
    fim.load_state_dict(model.state_dict())
    ref = build_model(CFG.replace(attention_impl="reference"), "cuda", torch.bfloat16)
    ref.load_state_dict(model.state_dict())
    runner, oracle = StepRunner(fim, max_model_len=512), StepRunner(ref, max_model_len=512)
    steps = [[RequestChunk(f"{n}{i}", 40 + 9 * i, 40 + 9 * i), RequestChunk(f"m{i}", 7, 7)]
             for i, n in enumerate("abc")]
    runner.run(runner.build_batch(steps[0]))  # makes the wrappers and loads the kernels
    torch.cuda.synchronize()
    batches = [runner.build_batch(reqs) for reqs in steps[1:]]
    torch.cuda._sleep(2_000_000_000)  # about a second of one busy block
    held = torch.cuda.Event()
    held.record()
    for batch in batches:
        runner.attention.prepare(batch.view, None)
    assert not held.query(), "planning waited for the GPU"
    # the later batch first: it runs on the plan made while the GPU was busy (its
    # wrappers still hold it); the earlier one is planned again
    for reqs, batch in reversed(list(zip(steps[1:], batches))):
        got, want = runner.run(batch), oracle.step(reqs)
        assert within_band(got.logits, want.logits), (reqs, max_abs_err(got.logits, want.logits))


@needs_flashinfer
@pytest.mark.parametrize("max_model_len", [1000, 4100])
def test_flashinfer_serves_with_graphs_up_to_the_token_budget(model, max_model_len):
    """Replay graphs up to 2,048 rows, over a cache smaller than the largest (capture's
    dummy requests then list more pages than the cache has slots) and larger than it;
    then a prompt as long as the cache allows, in budget-sized chunks, against the same
    model uncompiled."""
    fim = build_model(CFG.replace(attention_impl="flashinfer"), "cuda", torch.bfloat16)
    fim.load_state_dict(model.state_dict())
    budget = 2048  # the bench's wide setting, scaled down, one sequence at a time
    sizes = [s for s in WIDE_SIZES if s <= budget]
    backend = ReplayBackend(compiler="eager", strict=True, max_num_seqs=1, max_num_batched_tokens=budget,
                            max_cudagraph_capture_size=budget, cudagraph_capture_sizes=sizes)
    kw = dict(max_num_seqs=1, max_model_len=max_model_len, max_num_batched_tokens=budget)
    runner, oracle = StepRunner(fim, backend=backend, **kw), StepRunner(fim, **kw)
    runner.capture()
    torch.cuda.synchronize()  # a fault in capture's warm-up runs surfaces here, not in a later step
    n = max_model_len - 2
    got, want = runner.prefill({"a": n})["a"], oracle.prefill({"a": n})["a"]
    assert within_band(got, want), max_abs_err(got, want)


@needs_flashinfer
def test_flashinfer_serving_soak_against_pytorch_attention():
    """A shorter ``scripts/soak.py --model-option attention_impl=flashinfer --oracle-option
    attention_impl=reference --option compiler=eager``: the 40-layer tiny preset in bf16
    served with FlashInfer in graphs and trimmed, every step against the same weights
    with PyTorch's attention, uncompiled. The pieces are FX graphs, not Inductor's: the
    tiny preset in bf16 under Inductor departs from the eager model whatever attends
    (the test below), which would hide what FlashInfer does."""
    from replay_backend.reference.soak import soak

    fim = build_model(preset("tiny").replace(attention_impl="flashinfer"), "cuda", torch.bfloat16)
    ref = build_model(preset("tiny").replace(attention_impl="reference"), "cuda", torch.bfloat16)
    ref.load_state_dict(fim.state_dict())
    report = soak(fim, 120, seed=12, max_num_seqs=8, max_model_len=4096, max_num_batched_tokens=2048,
                  options={"compiler": "eager"}, oracle_model=ref)
    print(report.render())
    assert report.mismatches == [] and not report.counters_moved.get("fallbacks"), report.render()
    assert {"piecewise/trimmed/replay-graph/io-graphs", "eager/trimmed/replay-graph"} <= set(report.kinds), \
        report.kinds


@needs_flashinfer
def test_flashinfer_full_graphs_soak_against_pytorch_attention():
    """The soak above under full_and_piecewise: steps below the trim threshold replay
    one FULL graph with FlashInfer's CUDA-graph wrappers inside, planned before each
    replay, every step against PyTorch's attention; no plan is made inside a capture
    (FlashInferAttention raises there)."""
    from replay_backend.reference.soak import soak

    fim = build_model(preset("tiny").replace(attention_impl="flashinfer"), "cuda", torch.bfloat16)
    ref = build_model(preset("tiny").replace(attention_impl="reference"), "cuda", torch.bfloat16)
    ref.load_state_dict(fim.state_dict())
    report = soak(fim, 120, seed=12, max_num_seqs=8, max_model_len=4096, max_num_batched_tokens=2048,
                  options={"compiler": "eager", "cudagraph_mode": "full_and_piecewise"}, oracle_model=ref)
    print(report.render())
    assert report.mismatches == [] and not report.counters_moved.get("fallbacks"), report.render()
    assert any(k.startswith("full/") for k in report.kinds), report.kinds
    assert "piecewise/trimmed/replay-graph/io-graphs" in report.kinds, report.kinds


@pytest.mark.xfail(strict=True, reason="the tiny preset in bf16 under Inductor departs from eager in the "
                                        "main layers' caches (docs/testing.md, known failure)")
def test_tiny_preset_in_bf16_under_inductor_against_pytorch_attention():
    """The soak above with Inductor's pieces (the default) and the project's Triton
    attention: most steps fail, in every step kind, with or without graphs. With FX
    pieces it passes, and so does the fp32 soak of the same preset
    (test_serving_soak_at_the_real_window_has_no_mismatch)."""
    from replay_backend.reference.soak import soak

    model = build_model(preset("tiny").replace(attention_impl="triton"), "cuda", torch.bfloat16)
    ref = build_model(preset("tiny").replace(attention_impl="reference"), "cuda", torch.bfloat16)
    ref.load_state_dict(model.state_dict())
    report = soak(model, 8, seed=12, max_num_seqs=8, max_model_len=4096, max_num_batched_tokens=2048,
                  oracle_model=ref)
    print(report.render())
    assert report.mismatches == [], report.render()


def check_ffn_sublayer_under_inductor(name: str, device: str = "cuda") -> dict[int, dict[str, float]]:
    """One FFN sublayer of ``name`` in bf16 (the mHC merge, mixes and collapse, the norm,
    the router and the routed experts), compiled by Inductor with the token count
    dynamic, against the same code eager: each output's worst row's relative L2, per
    token count."""
    from replay_backend.reference.compare import worst_row_rel_l2

    model = build_model(preset(name).with_layers(2, (0,)), device, torch.bfloat16)
    cfg, blk = model.cfg, model.layers[0]

    def sublayer(hidden, residual, post, comb, prev_pre):
        (out, stream, post, comb), pre = model._sublayer(blk.ffn_hc, blk.ffn, (hidden, residual, post, comb),
                                                         prev_pre)
        return out, stream, pre, post, comb

    compiled = torch.compile(sublayer, backend="inductor", dynamic=True)
    gen = torch.Generator(device).manual_seed(0)
    errs = {}
    with torch.no_grad():
        for t in (1, 3, 16, 100, 777, 2048):
            residual = torch.randn(t, cfg.hc_mult, cfg.hidden_size, generator=gen, device=device).to(torch.bfloat16)
            hidden = (0.1 * torch.randn(t, cfg.hidden_size, generator=gen, device=device)).to(torch.bfloat16)
            prev_pre, post, comb = blk.attn_hc(residual)
            args = (hidden, residual, post, comb, prev_pre)
            want, got = sublayer(*args), compiled(*args)
            errs[t] = {k: worst_row_rel_l2(g.float().flatten(1), w.float().flatten(1))
                       for k, g, w in zip(("out", "stream", "pre", "post", "comb"), got, want)}
    return errs


@pytest.mark.parametrize("name", [
    pytest.param("tiny", marks=pytest.mark.xfail(strict=True, reason="the known failure of the tiny preset in bf16 "
                                                 "under Inductor (docs/testing.md): rows wrong from 777 tokens")),
    "mini-2k"])
def test_inductor_runs_an_ffn_sublayer_in_bf16_as_eager_does(name):
    """bf16 on CUDA is where the mHC mixes and the router take ``mm_fp32``'s GEMM with
    an fp32 result and the MoE its grouped op: code the CPU tests never compile. One
    sublayer by Inductor against eager, row by row (the known failure of the tiny
    preset under Inductor, docs/testing.md, starts here if this fails)."""
    errs = check_ffn_sublayer_under_inductor(name)
    print(errs)
    # A wrong row is O(1) away. Rounding is not: the MoE output's worst row, whose routing
    # weights are small leads between near-equal scores, is up to 0.05 on the CPU.
    assert all(e < 0.25 for per_t in errs.values() for e in per_t.values()), errs
