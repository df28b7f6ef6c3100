"""The benchmark's machinery on CPU: one trace for every mode, run order, the table."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from replay_backend import bench
from replay_backend.backend import ReplayBackend
from replay_backend.compare import max_abs_err
from replay_backend.counters import counters
from replay_backend.runner import StepRunner

from conftest import MAX_MODEL_LEN


@pytest.fixture(autouse=True)
def _fresh(one_thread):
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_shared_trace_builds_every_mode_from_one_dynamo_trace(model):
    opts = dict(compiler="eager", max_num_seqs=4, max_cudagraph_capture_size=64,
                decoder_replay_trim_threshold=48)
    backends = {"off": ReplayBackend(**opts, decoder_replay=False, cudagraph_mode="none"),
                "replay": ReplayBackend(**opts)}
    shared = bench.SharedTrace(backends)
    fwd = torch.compile(model, backend=shared, fullgraph=True)
    oracle = StepRunner(model, max_model_len=MAX_MODEL_LEN)
    want = oracle.prefill({"p": 90})["p"]
    before = counters.graphs_seen
    for key, be in backends.items():
        shared.current = key
        runner = StepRunner(model, max_model_len=MAX_MODEL_LEN, forward=fwd, backend=be)
        if be.config.graphs_enabled:
            runner.capture()
        got = runner.prefill({"p": 90})["p"]
        assert max_abs_err(got, want) < 1e-4, key
    # one Dynamo graph handed to both backends: each built exactly once, from that graph
    assert counters.graphs_seen - before == 2
    assert set(shared.build_s) == {"off", "replay"}
    assert backends["off"].model.plan.replay_off_reason == "decoder_replay=false"
    assert backends["replay"].model.plan.replay_off_reason is None
    assert backends["replay"].model.dispatch["replay"]  # the 90-token step trimmed


def test_plan_runs_the_stock_peer_last_and_no_graphless_mode_twice():
    args = SimpleNamespace(modes=["reduce-overhead", "replay", "off", "eager"], settings=["default", "wide"])
    assert bench._plan(args) == [("replay", "default"), ("replay", "wide"), ("off", "default"),
                                 ("eager", "default"), ("reduce-overhead", "default")]


def test_render_has_the_table_shape_and_ratios():
    report = {"preset": "mini-2k", "dtype": "torch.bfloat16", "device": "GPU", "torch": "2.11",
              "runs": 10, "warmup": 1, "max_num_batched_tokens": 16384, "trace_s": 30.0,
              "floor_ms": {"default": {"1024/1": 20.0}}, "trim_host_us_median": 80.0,
              "results": [
                  {"mode": "off", "setting": "default", "compile_s": 1.0, "capture": {}, "ms": {"1024/1": 100.0},
                   "error": None},
                  {"mode": "replay", "setting": "default", "compile_s": 2.0,
                   "capture": {"main": {"graphs": 3, "sizes": 1, "seconds": 0.5, "gib": 0.25}},
                   "ms": {"1024/1": 25.0}, "trim_host_us": {"1024/1": 80.0},
                   "trim_host_us_inflight": {"1024/1": 95.0}, "error": None}]}
    text = bench.render(report)
    assert "| ISL/conc | off ms | replay ms | floor ms | replay speed-up vs off | replay / floor |" in text
    assert "| 1024/1 | 100.0 | 25.0 | 20.0 | 4.00x | 1.25 |" in text
    assert "main: 3 graphs over 1 sizes, 0.5 s, 0.25 GiB" in text
    assert "trim op host time per trimming step, device idle at its entry: median 80 us" in text
    assert "- default/replay: 1024/1: 80 us (95)" in text
