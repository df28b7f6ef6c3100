"""The own models (tests/gqa_rope.py beside tests/llama_swa.py), served by the backend
and checked against their own eager run: the GQA/RoPE model on every kind of step and
every token count from 1 up, and short serving soaks of both (tests/own_soak.py), with
graphs emulated on the CPU."""
from __future__ import annotations

import pytest
import torch

import replay_backend
from replay_backend import RequestChunk as R
from replay_backend import StepKind, counters, plan_of
from gqa_rope import GQARope
from own_server import OwnServer, gqa_cache
from own_soak import make_soak, soak

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_dynamo")
W = 12
OPTIONS = {"compiler": "eager", "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64],
           "decoder_replay_trim_threshold": 32, "max_num_seqs": 4, "max_num_batched_tokens": 256}


def served(model, max_num_seqs: int = 8, **options):
    compiled = replay_backend.compile(model, ("input_ids", "positions"), options={**OPTIONS, **options})
    server = OwnServer(model, gqa_cache, compiled, max_num_seqs=max_num_seqs)
    server.serve()
    return server, compiled


def check_step(server, oracle, step, tol=1e-5):
    want, _ = oracle.step(step)
    got, result = server.step(step)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    for (layer, which, a), (_, _, b) in zip(server.written(step), oracle.written(step)):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m: f"{which} cache of layer {layer}: {m}")
    return result


# (step, its kind, trimmed); W = 12, so a chunk of more than 12 tokens has rows to trim
STEPS = [
    ([R("a", 20, 20)], "piecewise", True),  # 20 tokens pad to 32, the threshold: trims
    ([R("a", 1, 21)], "piecewise", False),  # a lone decode: one token, graph size 1
    ([R("f", 1, 1)], "piecewise", False),  # a lone one-token prompt
    ([R("a", 1, 22), R("b", 12, 12)], "piecewise", False),  # 13 pad to 16: below it
    ([R("c", 100, 100)], "eager", True),  # above the largest size: eager, trims
    ([R("d", 70, 70, keep_all=True)], "eager", False),  # keeps every row: nothing to trim
    ([R("a", 38, 60), R("e", 3, 3)], "piecewise", True),  # a chunk after cached context
    ([R("c", 1, 101), R("d", 2, 72), R("e", 40, 43, kv_start=38)], "piecewise", True),  # a later floor
    ([R("f", 3, 4), R("a", 4, 64)], "piecewise", False),  # speculative decodes
    ([R("b", 70, 82)], "eager", True),
    ([R("b", 1, 83)], "piecewise", False),
]


@pytest.mark.parametrize("compiler", ["eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_the_gqa_model_matches_its_eager_run_on_every_kind_of_step(compiler):
    model = GQARope(window=W).eval()
    oracle = OwnServer(model, gqa_cache)
    server, compiled = served(model, compiler=compiler)
    plan = plan_of(compiled)
    assert plan.window == W and plan.replay_layers == [2, 5]
    # Layer 0 (a window layer) and layer 1 (the KV source) before the cut, four window
    # layers inside it: one window op on both sides of the cut.
    assert plan.pieces_by_kind("main")["attention"] == 2 and plan.pieces_by_kind("replay")["attention"] == 4
    assert compiled.direct
    for step, kind, trimmed in STEPS:
        with counters.expect(strict=False, recompiles=0, graphs_seen=0, fallbacks={}):
            result = check_step(server, oracle, step)
        assert (result.kind, result.trimmed) == (StepKind(kind), trimmed), step
        assert result.has_region and result.replay_graph == (kind == "piecewise" or trimmed), (step, result)
        assert result.num_tokens == sum(r.query_len for r in step)


def test_one_window_op_applies_the_floor_only_where_the_replay_layers_read():
    """The window op on a 30-token prefill with a later floor (25): on the whole batch's
    view (layer 0, before the cut) row p reads [p - 11, p]; on the view the replay
    layers read, [max(p - 11, 25), p], and a row below the floor reads nothing (zero).
    Query heads 0, 1 read KV head 0, heads 2, 3 KV head 1."""
    torch.manual_seed(1)
    model = GQARope(window=W)
    server = OwnServer(model, gqa_cache)
    step = [R("a", 30, 30, kv_start=25)]
    batch = replay_backend.build_step_batch(step, [torch.zeros(30, dtype=torch.int64)], [server.block("a")],
                                            server.layout, W, "cpu")
    q, k, v = torch.randn(30, 4, 16), torch.randn(30, 2, 16), torch.randn(30, 2, 16)

    def expected(floor: int) -> torch.Tensor:
        out = torch.zeros_like(q)
        for p in range(30):
            keys = range(max(p - W + 1, floor), p + 1)
            for h in range(4):
                if keys:
                    kv = h // 2
                    s = torch.stack([q[p, h] @ k[j, kv] for j in keys]) * 16 ** -0.5
                    out[p, h] = torch.softmax(s, 0) @ v[list(keys), kv]
        return out

    for view, floor in ((batch.view, 0), (batch.region_view, 25)):
        out = torch.full_like(q, float("nan"))
        ctx = replay_backend.ForwardContext(batch, server.cache)
        ctx.active = view
        with replay_backend.set_forward_context(ctx):
            torch.ops.gqa_rope.window_attention(q, k, v, out, 3, W)
        torch.testing.assert_close(out, expected(floor), rtol=1e-5, atol=1e-5)
    assert (out[:25] == 0).all()


def every_token_count(device: str = "cpu") -> set:
    """Every step size from 1 to 64 and a one-token decode after each prefill, with
    Inductor pieces, on ``device``: one trace, no recompile, no fallback, every step
    equal to the eager model's. Returns the (padded size, trimmed) pairs seen."""
    model = GQARope(window=W).to(device).eval()
    oracle = OwnServer(model, gqa_cache, max_num_seqs=64)
    with counters.expect(strict=False, graphs_seen=1, recompiles=0, fallbacks={}):
        server, compiled = served(model, max_num_seqs=64, compiler="inductor")
        kinds = set()
        for n in range(1, 65):
            for step in ([R(n, n, n)], [R(n, 1, n + 1)]):
                result = check_step(server, oracle, step)
                kinds.add((result.padded_tokens, result.trimmed))
    return kinds


@pytest.mark.inductor
def test_every_token_count_and_lone_decodes_run_on_the_one_inductor_trace():
    kinds = every_token_count()
    assert (1, False) in kinds and (64, True) in kinds and (32, True) in kinds and (16, False) in kinds


# Every way a step runs, as own_soak.step_kind names it.
KINDS = {"piecewise/trimmed/replay-graph/io-graphs", "piecewise/untrimmed/replay-graph",
         "eager/trimmed/replay-graph", "eager/untrimmed/replay-eager"}
FEATURES = {"decode", "speculative decode (2-4)", "new prefill", "prefill chunk after context",
            "prefill longer than W", "prompt chunked", "keep_all chunk", "later floor (kv_start)",
            "finished (block freed)"}


@pytest.mark.parametrize("model_name", ["llama", "gqa"])
def test_a_short_soak_of_each_model_matches_its_eager_run(model_name):
    report = soak(model_name, 60, seed=3)
    report.assert_clean()  # no mismatch, no recompile or fallback while serving
    assert report.steps == 60
    assert KINDS <= set(report.kinds), report.render()
    assert report.lone["piecewise/untrimmed/replay-graph"] >= 3, report.render()
    assert FEATURES <= {k for k, n in report.features.items() if n}, report.render()


@pytest.mark.inductor
def test_a_short_inductor_soak_of_the_gqa_model():
    report = soak("gqa", 40, seed=4, compiler="inductor")
    report.assert_clean()
    assert {"piecewise/trimmed/replay-graph/io-graphs", "piecewise/untrimmed/replay-graph"} <= set(report.kinds), \
        report.render()
    assert sum(report.lone.values()) >= 3, report.render()


def test_the_soak_reports_a_wrong_cache_entry_as_a_mismatch_of_its_step():
    """One kept row's value in the last replay layer spoiled after step 5: a mismatch of
    step 5 naming that layer; the entry then takes the oracle's value, so later steps
    pass."""
    s = make_soak("gqa", seed=5)
    step = s.server.step

    def spoil_step_5(chunks, tokens=None):
        out = step(chunks, tokens)
        if s.report.steps == 5:
            r = chunks[-1]
            s.server.cache.v[5][s.server.layout.base(s.server.blocks[r.req_id]) + r.seq_len - 1] += 0.5
        return out

    s.server.step = spoil_step_5
    report = s.run(12)
    assert [(m.step, m.what) for m in report.mismatches] == [(5, "v cache, first at layer 5")], report.render()
    assert report.mismatches[0].err == pytest.approx(0.5, rel=1e-3)
    assert "1 mismatches" in report.render()
