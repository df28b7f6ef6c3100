"""The backend with Inductor-compiled pieces vs the eager oracle.

Inductor on a 2-core CPU is slow to compile, so this uses a 5-layer config (layer 0
SWA, 1 a ratio-2 source, 2 the ratio-1 source and cut, 3-4 replay layers), a small
capture range (main sizes up to 32, replay sizes [16, 32], trim threshold 24) and one
compiled runner for every step.
"""
from __future__ import annotations

import json

import pytest
import torch

from replay_backend.backend import ReplayBackend
from replay_backend.batch import RequestChunk as R
from replay_backend.reference.compare import max_abs_err, max_abs_err_kv
from replay_backend.counters import counters
from replay_backend.reference import build_model, preset
from replay_backend.reference.runner import StepRunner

pytestmark = pytest.mark.inductor

ATOL = 1e-4


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_inductor_pieces_match_the_oracle():
    cfg = preset("tiny").with_layers(5, (1, 2)).replace(window=16)
    model = build_model(cfg)
    be = ReplayBackend(compiler="inductor", max_num_seqs=2, max_cudagraph_capture_size=32,
                       decoder_replay_trim_threshold=24)
    rc = StepRunner(model, max_model_len=256, max_num_seqs=4, backend=be)
    ro = StepRunner(model, max_model_len=256, max_num_seqs=4)
    before = counters.snapshot()
    with counters.expect(strict=False, graphs_seen=1, recompiles=0,
                         pieces={"graph": 7, "attention": 5, "replay": 1}):
        rc.capture()
    compiled = counters.compilations - before["compilations"]
    reused = counters.piece_cache_hits - before["piece_cache_hits"]
    # Every graph piece is compiled or reuses an identical piece's code (in this 5-layer
    # model all 7 differ; tests/test_piece_cache.py covers reuse).
    assert compiled + reused == 7 and compiled > 0
    plan = be.model.plan
    assert plan.config["compiler"] == "inductor"
    assert plan.pieces_by_kind("main") == {"graph": 4, "attention": 3, "replay": 1}
    assert plan.pieces_by_kind("replay") == {"graph": 3, "attention": 2}
    assert plan.replay_layers == [3, 4]
    assert plan.capture_sizes == [1, 2, 4, 8, 16, 24, 32] and plan.replay_capture_sizes == [16, 32]
    # the pieces really are Inductor's, not the FX graph modules themselves
    assert all(not isinstance(r.fn, torch.fx.GraphModule) for r in be.model.runners("main"))

    cases = [
        # (requests, step kind, padded tokens, trimmed, replay padded)
        ([R("d", 1, 40), R("p", 20, 20)], "piecewise", 24, True, 32),  # 17 replay rows
        ([R("a", 40, 40)], "eager", 40, True, 16),
        ([R("e", 5, 5), R("f", 3, 30)], "piecewise", 8, False, 8),
    ]
    for reqs, kind, padded, trimmed, rpad in cases:
        for r in (rc, ro):
            r.prefill_context(reqs, forward=model)
        with counters.expect(strict=False, recompiles=0, compilations=0, captures={}, fallbacks={}):
            got = rc.step(reqs)
        want = ro.step(reqs)
        assert torch.isfinite(got.logits).all()
        assert max_abs_err(got.logits, want.logits) <= ATOL
        assert max_abs_err_kv(rc.kv, ro.kv, got.batch) <= ATOL
        assert (got.step.kind, got.step.padded_tokens) == (kind, padded)
        assert (got.trim.trimmed, got.trim.padded, got.trim.graph) == (trimmed, rpad, True)
        for r in (rc, ro):
            for q in reqs:
                r.free(q.req_id)


def test_an_eager_step_on_the_40_layer_tiny_preset_matches_the_oracle(capsys):
    """The default 40-layer model, every piece Inductor's, one eager step (a 128-token
    prefill and a decode after 299 cached tokens): the replay layers' KV of every kept
    row and the logits match the eager oracle. With the routing's former jumps, one of
    its rows sat within 1e-6 of a switch in layer 38 and its KV was 0.11 off
    (tests/test_model.py checks the continuity itself)."""
    from replay_backend.reference import cli

    code = cli.main(["verify", "--batch", "p:128/128,d:1/300", "--preset", "tiny", "--device", "cpu",
                     "--option", "compiler=inductor", "--option", "cudagraph_mode=none", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (out["step_kind"], out["trimmed"], out["num_tokens"]) == ("eager", False, 129)
    assert out["max_abs_err_kv"] <= out["tolerance"] and out["max_abs_err_logits"] <= out["tolerance"]
    assert code == 0 and out["ok"] is True


def test_a_runners_first_step_of_one_token_serves_every_count_with_inductor_pieces():
    """Inductor lowers the pieces with the traced token count as its size hint; traced on
    one token, some of its choices hold at one token only. A runner whose first step is
    one token traces on a W-token dummy first: then lone decodes and longer steps run on
    the one graph, against the oracle."""
    cfg = preset("tiny").with_layers(4, (1, 2)).replace(window=16)
    model = build_model(cfg)
    be = ReplayBackend(compiler="inductor", max_num_seqs=4, cudagraph_mode="none")
    rc = StepRunner(model, max_model_len=256, max_num_seqs=4, backend=be)
    ro = StepRunner(model, max_model_len=256, max_num_seqs=4)
    with counters.expect(strict=False, recompiles=0):
        for reqs in ([R("a", 1, 1)], [R("a", 1, 2)], [R("a", 5, 7), R("b", 30, 30)], [R("a", 1, 8)]):
            got, want = rc.step(reqs), ro.step(reqs)
            assert max_abs_err(got.logits, want.logits) <= ATOL, reqs
            assert max_abs_err_kv(rc.kv, ro.kv, got.batch) <= ATOL, reqs
    assert len(be.compiled) == 1
