"""A model that is not DSv4.1 (tests/llama_swa.py), written only against the public API,
compiled with the backend and served by it, checked against its own eager run: trimmed
and untrimmed steps, piecewise and eager, every token count from 1 up, and the bare
``torch.compile`` path; graphs emulated on the CPU."""
from __future__ import annotations

import pytest
import torch

import replay_backend
from replay_backend import RequestChunk as R
from replay_backend import StepKind, backend_of, counters, plan_of, set_forward_context
from llama_swa import LlamaServer, LlamaSWA

pytestmark = pytest.mark.usefixtures("fresh_dynamo")
W = 8
OPTIONS = {"compiler": "eager", "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64],
           "decoder_replay_trim_threshold": 32, "max_num_seqs": 4, "max_num_batched_tokens": 256}


def served(model, max_num_seqs: int = 8, **options):
    """Compile, warm up, capture and serve, as docs/bring-your-own-model.md does."""
    compiled = replay_backend.compile(model, ("input_ids", "positions"), options={**OPTIONS, **options})
    server = LlamaServer(model, compiled, max_num_seqs=max_num_seqs)
    server.serve()
    return server, compiled


def written(server: LlamaServer, step: list[R], model: LlamaSWA) -> list[torch.Tensor]:
    """Every cache entry the step wrote that a later step may read: every row's in the
    full layers, the kept rows' (the last W of a prefill) in the window layers."""
    out = []
    for layer in range(len(model.layers)):
        slots = []
        for r in step:
            base = server.layout.base(server.blocks[r.req_id])
            keep = r.query_len if layer < model.replay_from or r.keep_all else min(r.query_len, W)
            slots += range(base + r.seq_len - keep, base + r.seq_len)
        idx = torch.tensor(slots)
        out += [server.cache.k[layer][idx], server.cache.v[layer][idx]]
    return out


def check_step(server, oracle, model, step, tol=1e-5):
    want, _ = oracle.step(step)
    got, result = server.step(step)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    for a, b in zip(written(server, step, model), written(oracle, step, model)):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    return result


# (step, its kind, trimmed): each request's earlier chunks ran in earlier steps
STEPS = [
    ([R("a", 20, 20)], "piecewise", True),  # 20 tokens pad to 32, the threshold: trims
    ([R("a", 1, 21)], "piecewise", False),  # a lone decode: one token, graph size 1
    ([R("a", 1, 22), R("b", 12, 12)], "piecewise", False),  # 13 pad to 16: below it
    ([R("c", 100, 100)], "eager", True),  # above the largest size: eager, trims
    ([R("d", 70, 70, keep_all=True)], "eager", False),  # keeps every row: nothing to trim
    ([R("a", 38, 60), R("e", 3, 3)], "piecewise", True),  # a chunk after cached context
    ([R("c", 1, 101), R("d", 2, 72), R("e", 40, 43, kv_start=38)], "piecewise", True),  # a later floor
    ([R("b", 70, 82)], "eager", True),
]


@pytest.mark.parametrize("compiler", ["eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_the_second_model_matches_its_eager_run_on_every_kind_of_step(compiler):
    model = LlamaSWA(window=W).eval()
    oracle = LlamaServer(model)
    server, compiled = served(model, compiler=compiler)
    plan = plan_of(compiled)
    assert plan.window == W and plan.replay_layers == [2, 5]
    assert plan.pieces_by_kind("main")["attention"] == 2 and plan.pieces_by_kind("replay")["attention"] == 4
    assert compiled.direct  # served steps reach the graph without Dynamo
    for step, kind, trimmed in STEPS:
        with counters.expect(strict=False, recompiles=0, graphs_seen=0, fallbacks={}):
            result = check_step(server, oracle, model, step)
        assert (result.kind, result.trimmed) == (StepKind(kind), trimmed), step
        assert result == compiled.last_step and result.has_region
        assert result.padded_tokens >= result.num_tokens == sum(r.query_len for r in step)


@pytest.mark.inductor
def test_every_token_count_and_lone_decodes_run_on_the_one_inductor_trace():
    """Every step size from 1 to 64 (graphs at 1, 2, 4, ..., 64) and a one-token decode
    after each prefill, with Inductor pieces: one trace, no recompile, no fallback,
    every step equal to the eager model's."""
    model = LlamaSWA(window=W).eval()
    oracle = LlamaServer(model, max_num_seqs=64)
    with counters.expect(strict=False, graphs_seen=1, recompiles=0, fallbacks={}):
        server, compiled = served(model, max_num_seqs=64, compiler="inductor")
        kinds = set()
        for n in range(1, 65):
            for step in ([R(n, n, n)], [R(n, 1, n + 1)]):
                result = check_step(server, oracle, model, step)
                kinds.add((result.padded_tokens, result.trimmed))
    assert (1, False) in kinds and (64, True) in kinds and (32, True) in kinds


def test_a_kv_source_inside_the_replay_region_switches_replay_off_by_name():
    """The refused region's layers stay in the main graph, and their attention still
    reads the batch as the replay layers do (the floor applies)."""
    model = LlamaSWA(window=W, replay_from=1).eval()  # full layer 1 inside the region
    with counters.expect(strict=False, fallbacks={"replay_region_unsupported": 1}):
        server, compiled = served(model)
    plan = plan_of(compiled)
    assert "llama_swa::full_attention" in plan.replay_off_reason
    assert [p.in_region for p in plan.main_pieces if p.kind == "attention"] == [False] + [True] * 5
    oracle = LlamaServer(model)
    for step in ([R("a", 40, 40)], [R("a", 1, 41)], [R("b", 30, 30, kv_start=25)]):
        result = check_step(server, oracle, model, step)
        assert not result.has_region and not result.trimmed


def _bare_steps(compiled, model, steps):
    """Serve ``steps`` through a bare ``torch.compile`` result, its backend found by
    ``backend_of``, against the eager model."""
    oracle, server = LlamaServer(model), LlamaServer(model)
    be = backend_of(compiled)
    for step in steps:
        tokens = [server.tokens(r) for r in step]
        blocks = [server.block(r.req_id) for r in step]
        batch = be.build_batch(step, tokens, blocks)
        with set_forward_context(server.setup.context(batch)), torch.no_grad():
            (hidden,) = compiled(batch.input_ids, batch.positions)
        want, _ = oracle.step(step)
        torch.testing.assert_close(model.head(hidden[batch.logits_indices]), want, rtol=1e-5, atol=1e-5)
    return server


@pytest.mark.parametrize("how", ["dynamic", "marked"])
def test_bare_torch_compile_captures_and_serves_one_token_steps(how):
    model = LlamaSWA(window=W).eval()
    compiled = torch.compile(model, backend="dsv41_replay", dynamic=how == "dynamic", options=OPTIONS)
    server = LlamaServer(model)
    batch = server.setup.dummy_batch(W)
    if how == "marked":
        replay_backend.mark_token_dims(batch.input_ids, batch.positions)
    with set_forward_context(server.setup.context(batch, use_graphs=False)), torch.no_grad():
        compiled(batch.input_ids, batch.positions)  # the one trace
    be = backend_of(compiled)
    summary = be.capture(server.setup)
    assert summary["main"]["graphs"] > 0 and summary["replay"]["graphs"] > 0
    be.start_serving()
    with counters.expect(strict=False, graphs_seen=0, recompiles=0, fallbacks={}):
        _bare_steps(compiled, model, [[R("a", 1, 1)], [R("a", 1, 2)], [R("b", 40, 40)], [R("b", 1, 41)]])
    assert be.last_step.num_tokens == 1 and be.last_step.kind is StepKind.PIECEWISE


def test_bare_torch_compile_of_static_shapes_fails_at_once_naming_the_fix():
    model = LlamaSWA(window=W).eval()
    compiled = torch.compile(model, backend="dsv41_replay", options=OPTIONS)
    server = LlamaServer(model)
    batch = server.setup.dummy_batch(W)
    with pytest.raises(Exception, match=r"traced with a static token count.*dynamic=True.*mark_token_dims"):
        with set_forward_context(server.setup.context(batch)), torch.no_grad():
            compiled(batch.input_ids, batch.positions)


def test_a_served_call_outside_the_forward_context_names_the_context():
    model = LlamaSWA(window=W).eval()
    server, compiled = served(model)
    batch = server.setup.dummy_batch(4)
    with pytest.raises(RuntimeError, match="no forward context is set"):
        compiled(batch.input_ids, batch.positions)
