"""FULL CUDA graphs on the GPU: real graphs with the Triton attention inside, Inductor
pieces, against the eager oracle; skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

from replay_backend import RequestChunk as R
from replay_backend import build_model, counters, preset
from replay_backend.backend import ReplayBackend
from replay_backend.reference.compare import max_abs_err, max_abs_err_kv
from replay_backend.reference.runner import StepRunner

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# Eight layers (W = 128): a shorter compile than the 40-layer preset, the same kinds of layer.
CFG = preset("tiny").with_layers(8, (1, 3))
SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
# Decodes at c1 and c8, speculative decodes, a mixed step below the threshold, a
# trimming step, a lone decode after it, and steps with fewer requests than the one
# before at the same padded size (the graph reads the new step's metadata).
STEPS = [[R("a", 300, 300)], [R("a", 1, 301)], [R(f"b{i}", 40, 40) for i in range(7)],
         [R("a", 1, 302), *[R(f"b{i}", 1, 41) for i in range(7)]],
         [R("a", 3, 305), *[R(f"b{i}", 3, 44) for i in range(3)]],
         [R("a", 1, 306), R("b0", 1, 45), R("c", 200, 200)],
         [R("d", 900, 900), R("a", 1, 307)], [R("a", 1, 308)], [R("b1", 1, 45), R("b2", 1, 45)]]


def _runner(model, **opts):
    be = ReplayBackend(cudagraph_mode="full_and_piecewise", cudagraph_capture_sizes=SIZES, max_num_seqs=16,
                       max_num_batched_tokens=2048, **opts)
    r = StepRunner(model, max_model_len=2048, max_num_seqs=16, max_num_batched_tokens=2048, backend=be)
    return r, r.capture()


def test_full_steps_match_the_oracle_with_triton_attention_inside_the_graph():
    model = build_model(CFG, "cuda", torch.float32)
    runner, summary = _runner(model, strict=True)
    oracle = StepRunner(model, max_model_len=2048, max_num_seqs=16, max_num_batched_tokens=2048)
    assert summary["full"]["graphs"] == len([s for s in SIZES if s < 768]) and summary["main"]["graphs"] > 0
    kinds = []
    for step in STEPS:
        got, want = runner.step(step), oracle.step(step)
        kinds.append((got.result.kind.value, got.result.trimmed))
        assert max_abs_err(got.logits, want.logits) < 1e-3, (step, got.result)
        assert max_abs_err_kv(runner.kv, oracle.kv, got.batch) < 1e-3, (step, got.result)
    assert kinds.count(("full", False)) >= 6 and ("piecewise", True) in kinds, kinds


def test_a_full_step_and_the_same_step_in_pieces_agree_to_the_bit():
    """fp32: the FULL graph runs the very kernels the pieces and the eager attention
    run, on the same graph layout; a twin whose FULL graphs are dropped runs every
    such step in pieces (a counted fallback)."""
    model = build_model(CFG, "cuda", torch.float32)
    full, _ = _runner(model)
    pieces, _ = _runner(model)
    pieces.backend.model.full.graphs.clear()
    before = counters.fallbacks["uncaptured_size"]
    for step in STEPS:
        a, b = full.step(step), pieces.step(step)
        assert torch.equal(a.logits, b.logits), (step, a.result)
    assert counters.fallbacks["uncaptured_size"] > before
    # Every slot but the pad slot, which padding rows write in no fixed order.
    for a, b in zip([*full.kv.swa, *full.kv.glob.values()], [*pieces.kv.swa, *pieces.kv.glob.values()]):
        assert torch.equal(a[:-1], b[:-1])


def test_serving_soak_with_full_graphs_has_no_mismatch():
    """The serving soak (random decodes, speculative decodes, prefills, chunks, trimming
    steps) under full_and_piecewise: every written cache slot and logit against the
    oracle, FULL steps among them."""
    from replay_backend.reference.soak import soak

    report = soak(build_model(CFG, "cuda", torch.float32), 150, seed=13, max_num_seqs=8,
                  max_model_len=4096, max_num_batched_tokens=2048,
                  options={"cudagraph_mode": "full_and_piecewise"})
    print(report.render())
    assert report.mismatches == [] and not report.counters_moved.get("fallbacks"), report.render()
    assert any(k.startswith("full/") for k in report.kinds), report.kinds
    assert any(k.startswith("piecewise/trimmed") for k in report.kinds), report.kinds


def test_an_own_model_serves_full_graphs_on_cuda_with_inductor_pieces():
    """A model written against the public API alone (tests/full_toy.py), its attention
    declared ALWAYS and reading only the graph layout: real FULL graphs with Inductor
    pieces, lone one-token decodes among the steps, each against its eager run."""
    import replay_backend
    from full_toy import ToyModel, toy_cache
    from own_server import OwnServer
    from test_full_graphs import TOY_LEN, TOY_OPTS, TOY_STEPS, toy_step

    model = ToyModel("always").to("cuda").eval()
    opts = {**TOY_OPTS, "compiler": "inductor", "cudagraph_mode": "full_and_piecewise", "strict": True}
    compiled = replay_backend.compile(model, ("input_ids", "positions"), options=opts)
    server = OwnServer(model, toy_cache, compiled, max_model_len=TOY_LEN, max_num_seqs=4)
    summary = server.serve()
    oracle = OwnServer(model, toy_cache, max_model_len=TOY_LEN, max_num_seqs=4)
    assert summary["full"]["graphs"] == len(TOY_OPTS["cudagraph_capture_sizes"])
    kinds = []
    for step in TOY_STEPS:
        result, err = toy_step(server, oracle, step)
        kinds.append(result.kind.value)
        assert err <= 1e-4, (step, result, err)
    assert kinds.count("full") == len(TOY_STEPS), kinds


def test_the_memory_estimate_covers_full_graphs_whose_attention_splits_for_the_longest_sequence():
    """A cache of long sequences: the FULL attention splits its keys for the longest
    one the cache holds, whatever the step, so its graphs' scratch is larger than a
    dummy step without the graph layout needs. The estimate made before capture runs
    the largest FULL step as its graph holds it, and covers what capture takes."""
    model = build_model(CFG, "cuda", torch.float32)
    be = ReplayBackend(cudagraph_mode="full_and_piecewise", cudagraph_capture_sizes=SIZES, max_num_seqs=16,
                       max_num_batched_tokens=2048)
    runner = StepRunner(model, max_model_len=32768, max_num_seqs=16, max_num_batched_tokens=2048, backend=be)
    est = runner.estimate_graph_memory()
    summary = runner.capture()
    took = sum(level["gib"] for level in summary.values())
    assert est.full_peak_bytes > 0 and est.full_graphs == summary["full"]["graphs"], (est, summary)
    assert took <= 1.5 * est.total_gib + 0.125, (summary, est)


def test_the_decode_bench_takes_a_floor_at_every_point_after_all_its_timing(tmp_path):
    """The decode bench times every point of this backend's modes first, then takes each
    point's floors with the CUDA tracing kept attached from one session to the next,
    then runs the stock peer in a process of its own: every point of every mode has a
    floor, and a host profile at each profiled point."""
    import json

    from replay_backend.reference import cli

    out, host = tmp_path / "decode.json", tmp_path / "host.txt"
    assert cli.main(["decode-bench", "--preset", "tiny", "--model-option", "num_layers=8", "--model-option",
                     "kv_source_layer_ids=1,3", "--context", "200", "--conc", "1,4", "--mixed", "24",
                     "--prefill-isl", "256", "--steps", "3", "--runs", "1", "--warmup", "1",
                     "--max-num-batched-tokens", "512", "--modes", "piecewise,full_and_piecewise,reduce-overhead",
                     "--profile-points", "200/1,200/4", "--host-profile-out", str(host), "--out", str(out)]) == 0
    runs = json.loads(out.read_text())["results"]
    for r in runs:
        assert not r["error"] and not r["floor_errors"] and set(r["floor_ms"]) == {"200/1", "200/4"}, r
        assert all(0 < f <= r["tpot_ms"][p] for p, f in r["floor_ms"].items()), r
        assert max(r["max_abs_err_vs_first"].values()) < 0.05, r  # bf16
    assert [r["mode"] for r in runs] == ["piecewise", "full_and_piecewise", "reduce-overhead"]
    assert host.read_text().count("######## ") == 6
