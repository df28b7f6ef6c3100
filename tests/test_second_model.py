"""A model that is not DSv4.1 (tests/llama_swa.py), written only against the public API,
compiled with the backend and checked against its own eager run: trimmed and untrimmed
steps, piecewise and eager, graphs emulated on the CPU (SPEC §7)."""
from __future__ import annotations

import pytest
import torch

import replay_backend
from replay_backend import RequestChunk as R
from replay_backend import counters, plan_of
from llama_swa import LlamaServer, LlamaSWA

pytestmark = pytest.mark.usefixtures("fresh_dynamo")
W = 8
OPTIONS = {"compiler": "eager", "cudagraph_capture_sizes": [8, 16, 32, 64], "decoder_replay_trim_threshold": 32,
           "max_num_seqs": 4, "max_num_batched_tokens": 256}


def served(model, **options):
    """Compile, warm up, capture and serve, as docs/bring-your-own-model.md does."""
    compiled = replay_backend.compile(model, ("input_ids", "positions"), options={**OPTIONS, **options})
    server = LlamaServer(model, forward=compiled)
    server.run_dummy(W, use_graphs=False)  # the one trace and compile, no capture
    with server.dummy_context():
        compiled.capture(server.run_dummy, server.replay_view)
    compiled.start_serving()
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


# (step, its kind, trimmed): each request's earlier chunks ran in earlier steps
STEPS = [
    ([R("a", 20, 20)], "piecewise", True),  # 20 tokens pad to 32, the threshold: trims
    ([R("a", 1, 21), R("b", 12, 12)], "piecewise", False),  # 13 pad to 16: below it
    ([R("c", 100, 100)], "eager", True),  # above the largest size: eager, trims
    ([R("d", 70, 70, keep_all=True)], "eager", False),  # keeps every row: nothing to trim
    ([R("a", 39, 60), R("e", 3, 3)], "piecewise", True),  # a chunk after cached context
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
    for step, kind, trimmed in STEPS:
        with counters.expect(strict=False, recompiles=0, graphs_seen=0, fallbacks={}):
            want, _ = oracle.step(step)
            got, ctx = server.step(step)
        assert (ctx.step.kind, ctx.last_trim.trimmed) == (kind, trimmed), step
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for a, b in zip(written(server, step, model), written(oracle, step, model)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_kv_source_inside_the_replay_region_switches_replay_off_by_name():
    model = LlamaSWA(window=W, replay_from=1).eval()  # full layer 1 inside the region
    with counters.expect(strict=False, fallbacks={"replay_region_unsupported": 1}):
        server, compiled = served(model)
    assert "llama_swa::full_attention" in plan_of(compiled).replay_off_reason
    want, _ = LlamaServer(model).step([R("a", 40, 40)])
    got, ctx = server.step([R("a", 40, 40)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
