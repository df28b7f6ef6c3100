"""The benchmark's machinery on CPU: one trace for every mode, run order, the table."""
from __future__ import annotations

import functools
import json
import operator
import os
import pickle
import re
from types import SimpleNamespace

import pytest
import torch

from replay_backend.bench import decode as decode_bench
from replay_backend.bench.decode_report import render as render_decode
from replay_backend.compat import dynamo as compat_dynamo
from replay_backend.bench import modes as bench_modes
from replay_backend.bench import own_process
from replay_backend.bench import run as bench
from replay_backend.bench import report as bench_report
from replay_backend.bench import timing as bench_timing
from replay_backend.reference import cli, cli_bench
from replay_backend.backend import ReplayBackend
from replay_backend.reference.compare import max_abs_err
from replay_backend.counters import counters
from replay_backend.reference.runner import StepRunner
from replay_backend.requests import RequestChunk

from conftest import MAX_MODEL_LEN


pytestmark = pytest.mark.usefixtures("one_thread", "fresh_dynamo")


def test_shared_trace_builds_every_mode_from_one_dynamo_trace(model):
    opts = dict(compiler="eager", max_num_seqs=4, max_cudagraph_capture_size=64,
                decoder_replay_trim_threshold=48)
    backends = {"off": ReplayBackend(**opts, decoder_replay=False, cudagraph_mode="none"),
                "replay": ReplayBackend(**opts)}
    shared = bench_modes.SharedTrace(backends)
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
    assert bench_modes.plan_modes(args) == [("replay", "default"), ("replay", "wide"), ("off", "default"),
                                 ("eager", "default"), ("reduce-overhead", "default")]


def test_ungraphed_modes_run_once_when_only_the_wide_setting_is_asked_for():
    """A capture setting changes nothing in a mode without this backend's graphs: it
    runs at the default setting and the wide table shows it, no table of its own."""
    args = SimpleNamespace(modes=["replay", "off", "reduce-overhead"], settings=["wide"])
    assert bench_modes.plan_modes(args) == [("replay", "wide"), ("off", "default"), ("reduce-overhead", "default")]
    report = {"preset": "mini-2k", "dtype": "torch.bfloat16", "device": "GPU", "torch": "2.11",
              "runs": 10, "warmup": 1, "max_num_batched_tokens": 16384,
              "floor_ms": {"wide": {"131072/1": 3400.0}},
              "results": [
                  {"mode": "replay", "setting": "wide", "compile_s": 2.0, "capture": {},
                   "ms": {"131072/1": 3425.0}, "error": None},
                  {"mode": "off", "setting": "default", "compile_s": 1.0, "capture": {},
                   "ms": {"131072/1": 6850.0}, "error": None}]}
    text = bench.render(report)
    assert "## capture setting: default" not in text
    assert "| 131072/1 | 6850.0 | 3425.0 | 3400.0 | 2.00x | 1.01 |" in text.split("## capture setting: wide")[1]


def test_a_run_of_ungraphed_modes_alone_has_one_table_of_times():
    """Without this backend's graphed modes, both settings' tables would be the same
    runs, and without ``replay`` no ratio has a numerator."""
    report = {"preset": "mini-2k", "dtype": "torch.bfloat16", "device": "GPU", "torch": "2.11",
              "runs": 10, "warmup": 1, "max_num_batched_tokens": 16384, "floor_ms": {},
              "results": [{"mode": m, "setting": "default", "compile_s": 1.0, "capture": {},
                           "ms": {"131072/1": ms}, "error": None}
                          for m, ms in (("off", 8442.4), ("reduce-overhead", 8561.9))]}
    text = bench.render(report)
    assert text.count("## capture setting") == 1 and "## capture setting: default" in text
    assert "| ISL/conc | off ms | reduce-overhead ms |\n|---|---|---|\n| 131072/1 | 8442.4 | 8561.9 |" in text


def test_bench_refuses_a_run_with_every_point_filtered_out():
    args = SimpleNamespace(isl=[131072], conc=[1], max_tokens_per_point=65536)
    with pytest.raises(ValueError, match="above --max-tokens-per-point 65536 prompt tokens: nothing to measure"):
        bench.run_bench(args)


def test_render_has_the_table_shape_and_ratios(tmp_path):
    report = {"preset": "mini-2k", "dtype": "torch.bfloat16", "device": "GPU", "torch": "2.11",
              "runs": 10, "warmup": 1, "max_num_batched_tokens": 16384, "trace_s": 30.0,
              "floor_ms": {"default": {"1024/1": 20.0}}, "trim_host_us_median": 80.0,
              "peak_tflops": 0.5, "point_gflop": {"1024/1": 2.5},
              "results": [
                  {"mode": "off", "setting": "default", "compile_s": 1.0, "capture": {}, "ms": {"1024/1": 100.0},
                   "error": None},
                  {"mode": "replay", "setting": "default", "compile_s": 2.0,
                   "capture": {"main": {"graphs": 3, "sizes": 1, "seconds": 0.5, "gib": 0.25}},
                   "split_warmup_s": 1.5,
                   "ms": {"1024/1": 25.0}, "trim_host_us": {"1024/1": 80.0, "8192/8": 300.0},
                   "trim_host_us_by_step": {"8192/8": [70.0, 90.0, 400.0, 900.0]}, "error": None}]}
    text = bench.render(report)
    assert "| ISL/conc | off ms | replay ms | floor ms | replay speed-up vs off | replay / floor |" in text
    assert "| 1024/1 | 100.0 | 25.0 | 20.0 | 4.00x | 1.25 |" in text
    # 2.5 GFLOP in 100 / 25 / 20 ms against 0.5 TFLOP/s
    assert "model FLOPs utilisation at default (% of the measured 0.5 TFLOP/s):" in text
    assert "| ISL/conc | GFLOP | off | replay | floor |" in text and "| 1024/1 | 2.5 | 5.0 | 20.0 | 25.0 |" in text
    assert "main: 3 graphs over 1 sizes, 0.5 s, 0.25 GiB (after the attention's split warm-up step, 1.5 s)" in text
    assert "trim op host time per trimming step of the timed runs (the op without the region it runs): " \
           "median 80 us (wall time: it holds any wait for the device inside the op's CUDA calls)" in text
    assert "- default/replay: 1024/1: 80 us, 8192/8: 300 us (70 / 90 / 400 / 900 by step)" in text
    # the CLI writes the table and the report whole, each time it is handed one
    args = SimpleNamespace(json=str(tmp_path / "b.json"), out=str(tmp_path / "b.md"))
    assert cli._write_report(args, [report]) == text
    assert json.loads((tmp_path / "b.json").read_text()) == report
    assert (tmp_path / "b.md").read_text() == text + "\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.json", "b.md"]  # no partial file left
    # one report per attention implementation (--attention triton,flashinfer)
    other = {**report, "model_options": ["attention_impl=flashinfer"]}
    both = cli._write_report(args, [report, other])
    assert both.startswith(text) and "(attention_impl=flashinfer)" in both.split(text, 1)[1]
    assert json.loads((tmp_path / "b.json").read_text()) == {"reports": [report, other]}


def test_render_flags_first_runs_far_above_their_median():
    """A build inside a served step shows as a point's first run far above its median
    (run 36: 1,052.9 ms against 33.3 ms); a first run warming caches does not."""
    report = {"preset": "mini-2k", "dtype": "torch.bfloat16", "device": "GPU", "torch": "2.11",
              "runs": 10, "warmup": 1, "max_num_batched_tokens": 16384, "floor_ms": {},
              "results": [
                  {"mode": "replay", "setting": "default", "compile_s": 2.0, "capture": {}, "error": None,
                   "ms": {"1024/1": 15.1, "4096/1": 33.3, "8192/1": 59.0},
                   "first_ms": {"1024/1": 15.5, "4096/1": 1052.9, "8192/1": 59.0}},
                  {"mode": "parent", "setting": "default", "compile_s": 2.0, "capture": {}, "error": None,
                   "ms": {"1024/1": 20.0, "4096/1": 53.3}, "first_ms": {"1024/1": 90.0, "4096/1": 83.1}}]}
    # parent 1024/1: 4.5x but 70 ms over its median, under the 100 ms floor of a build
    assert bench_report.slow_first_runs(report) == [("default/replay", "4096/1", 1052.9, 33.3)]
    text = bench.render(report)
    assert "FIRST RUNS over 3x their point's median" in text
    assert "- default/replay 4096/1: 1052.9 ms, median 33.3 ms" in text
    del report["results"][0]["first_ms"]["4096/1"]
    assert "FIRST RUNS" not in bench.render(report)


def test_render_lists_what_moved_in_timed_runs():
    report = {"preset": "mini-2k", "dtype": "torch.bfloat16", "device": "GPU", "torch": "2.11",
              "runs": 10, "warmup": 1, "max_num_batched_tokens": 16384, "floor_ms": {},
              "results": [{"mode": "replay", "setting": "wide", "compile_s": 2.0, "capture": {}, "error": None,
                           "ms": {"1024/1": 15.1}, "events": {"1024/1": {
                               "fallbacks": {"uncaptured_size": 20}, "trim_index_copies": 10}}}]}
    text = bench.render(report)
    assert "EVENTS in timed runs" in text
    assert "- wide/replay 1024/1: fallbacks +{'uncaptured_size': 20}, trim_index_copies +10" in text
    report["results"][0]["events"] = {}
    assert "EVENTS" not in bench.render(report)


def test_run_bench_end_to_end_times_every_mode_in_turns(monkeypatch):
    """The whole bench on CPU with a small model: every mode measured at every point
    with the plain model's answer, run k of every mode before run k + 1 of any, the trim
    op's host time for ``replay``, and the report rendered."""
    calls = []
    ttft = bench_timing.ttft

    def spy(runner, isl, conc, tag):
        calls.append((id(runner), tag))
        return ttft(runner, isl, conc, tag)

    monkeypatch.setattr(bench_timing, "ttft", spy)
    args = SimpleNamespace(
        preset="tiny", model_option=["num_layers=8", "kv_source_layer_ids=1,3", "window=16"],
        option=["compiler=eager", "decoder_replay_trim_threshold=48"],
        modes=["eager", "off", "parent", "piecewise", "replay"], settings=["default", "wide"],
        isl=[40, 100], conc=[1, 2], runs=2, warmup=1, max_num_batched_tokens=128,
        max_tokens_per_point=1000, max_seconds=1e9, profile_out=None, profile_points=[])
    saved = []
    report = bench.run_bench(args, checkpoint=saved.append)
    runs = {(r["mode"], r["setting"]): r for r in report["results"]}
    # a partial report after the modes were prepared and after each point, the last whole
    assert [sum(len(r["ms"]) for r in s["results"]) for s in saved] == [0, 7, 14, 21, 28]
    assert saved[-1] == report
    assert set(runs) == {("eager", "default"), ("off", "default"), ("parent", "default"),
                         ("piecewise", "default"), ("piecewise", "wide"), ("replay", "default"),
                         ("replay", "wide")}
    for key, r in runs.items():
        assert r["error"] is None, (key, r["error"])
        assert set(r["ms"]) == {"40/1", "40/2", "100/1", "100/2"}, key
        assert r["max_abs_err_vs_eager"] < 1e-3, key
        assert r["rel_err_vs_fp32"] < report["drift_limit"] and not r["drifted"], key
    # a 40-token step pads to 40 by default (below the trim threshold 48: nothing to time)
    # and to 64 in the wide setting (trims); every other point trims in both
    assert set(runs[("replay", "default")]["trim_host_us"]) == {"40/2", "100/1", "100/2"}
    assert set(runs[("replay", "wide")]["trim_host_us"]) == {"40/1", "40/2", "100/1", "100/2"}
    # 100/2 trims in both of its steps (128 + 72 tokens: each ends a prompt), every other point in one
    for setting in ("default", "wide"):
        by_step = runs[("replay", setting)]["trim_host_us_by_step"]
        assert set(by_step) == {"100/2"} and len(by_step["100/2"]) == 2 and min(by_step["100/2"]) > 0
    assert all(set(r["first_ms"]) == set(r["ms"]) for r in runs.values())  # each point's first run
    # served steps took no slow path: no fallback, capture or trace, and the trimming
    # steps' gather graphs read their rows in place
    assert all(r["events"] == {} for r in runs.values()), {k: r["events"] for k, r in runs.items()}
    assert report["trim_host_us_median"] > 0
    assert report["check_tokens"] == 40  # the shortest ISL
    for when in ("start", "end"):  # host speed around the timed points; no CUDA here
        assert report["host_probe"][when]["cpu_op_us"] > 0
        assert report["host_probe"][when]["cuda_launch_us"] is None
    # in turns: at each point every mode's timed run m0 comes before any mode's m1
    timed = [(rid, tag) for rid, tag in calls if tag.startswith("m")]
    per_point = len(runs) * args.runs
    for p in range(len(timed) // per_point):
        block = timed[p * per_point:(p + 1) * per_point]
        assert [tag for _, tag in block] == ["m0"] * len(runs) + ["m1"] * len(runs)
        assert len({rid for rid, _ in block[:len(runs)]}) == len(runs)
    assert report["peak_tflops"] > 0 and set(report["point_gflop"]) == {"40/1", "40/2", "100/1", "100/2"}
    assert report["point_gflop"]["100/2"] > report["point_gflop"]["100/1"] > report["point_gflop"]["40/1"] > 0
    text = bench.render(report)
    assert "| 100/2 |" in text and "model FLOPs utilisation at wide" in text
    assert "host speed (small CPU op / tiny CUDA launch, us per call): start " in text


def test_max_seconds_counts_from_the_start_and_keeps_the_stock_peer_from_starting(monkeypatch):
    """Past --max-seconds (counted from the bench's start, the check prompt included) no
    point is measured and the stock peer is not compiled (minutes on the GPU): each
    mode reports the spent budget, and the report is still whole and renders."""
    monkeypatch.setattr(bench.torch, "compile", _refuse_peer(bench.torch.compile))
    args = SimpleNamespace(
        preset="tiny", model_option=["num_layers=4", "kv_source_layer_ids=1", "window=16"],
        option=["compiler=eager"], modes=["off", "reduce-overhead"], settings=["default"],
        isl=[40], conc=[1], runs=2, warmup=1, max_num_batched_tokens=128,
        max_tokens_per_point=1000, max_seconds=0.0, profile_out=None, profile_points=[])
    report = bench.run_bench(args)
    runs = {r["mode"]: r for r in report["results"]}
    assert runs["off"]["error"] == "time budget spent (--max-seconds) before 40/1"
    assert runs["reduce-overhead"]["error"] == "time budget spent (--max-seconds) before its compile"
    assert runs["off"]["ms"] == runs["reduce-overhead"]["ms"] == {}
    assert runs["off"]["rel_err_vs_fp32"] is not None  # prepared and checked before the budget applied
    assert "ERROR time budget spent" in bench.render(report)


def test_the_stock_peer_timed_after_profiled_floors_is_marked_so(monkeypatch):
    """The stock peer resets Dynamo, so it follows this backend's modes and their
    floors; CUDA tracing from those sessions slows its launches, and its report entry
    and the rendered report say so. This backend's modes are timed before any session."""
    monkeypatch.setattr(bench_modes, "stock_peer", _plain_peer)
    order: list[str] = []
    real_time, real_floor = bench.time_points, bench.floor_points

    def time_points(modes, *a, **k):
        order.append("time " + ",".join(m.run.mode for m in modes))
        return real_time(modes, *a, **k)

    def floor_points(timed, *a, **k):  # as on a GPU: the sessions traced CUDA
        order.append("floors " + ",".join(m.run.mode for m in timed.modes))
        real_floor(timed, *a, **k)
        return True

    monkeypatch.setattr(bench, "time_points", time_points)
    monkeypatch.setattr(bench, "floor_points", floor_points)
    args = SimpleNamespace(
        preset="tiny", model_option=["num_layers=4", "kv_source_layer_ids=1", "window=16"],
        option=["compiler=eager"], modes=["off", "reduce-overhead"], settings=["default"],
        isl=[40], conc=[1], runs=1, warmup=0, max_num_batched_tokens=128,
        max_tokens_per_point=1000, max_seconds=600.0, profile_out=None, profile_points=[])
    report = bench.run_bench(args, place=bench.PassPlace.now(600.0, peer_process=False))
    assert order == ["time off", "floors off", "time reduce-overhead", "floors reduce-overhead"]
    runs = {r["mode"]: r for r in report["results"]}
    assert runs["reduce-overhead"]["after_profiler"] and not runs["off"]["after_profiler"]
    assert report["profiled"] and set(runs["reduce-overhead"]["ms"]) == {"40/1"}
    assert "NOTE: default/reduce-overhead timed after a profiler session of this process" in bench.render(report)


@pytest.mark.inductor
def test_the_stock_peer_after_floors_runs_in_a_process_of_its_own(monkeypatch, tmp_path, capfd):
    """Where this backend's floors traced CUDA, the stock peer (torch's own compile, here
    on the CPU) runs its whole bench in a spawned process, untouched by them: its entry
    and its profiles come back, not marked. Neither process prints the entries (the
    CLI prints each once)."""
    real_floor, real_call, calls = bench.floor_points, own_process.call, []

    def call(fn, *a):
        calls.append((fn, a[1]))
        return real_call(fn, *a)

    monkeypatch.setattr(bench, "floor_points", lambda *a, **k: real_floor(*a, **k) or True)  # as on a GPU
    monkeypatch.setattr(own_process, "call", call)
    args = SimpleNamespace(
        preset="tiny", model_option=["num_layers=2", "kv_source_layer_ids=1", "window=16"],
        option=["compiler=eager"], modes=["off", "reduce-overhead"], settings=["default"],
        isl=[40], conc=[1], runs=1, warmup=0, max_num_batched_tokens=128, max_tokens_per_point=1000,
        max_seconds=600.0, profile_out=str(tmp_path / "prof.md"), profile_points=["40/1"])
    written = tmp_path / "report.json"
    report = bench.run_bench(args, checkpoint=functools.partial(cli_bench._checkpoint,
                                                                SimpleNamespace(json=str(written), out=None), []))
    runs = {r["mode"]: r for r in report["results"]}
    ((fn, checkpoint),) = calls
    assert fn is bench.run_bench and checkpoint.func is bench._with_peer  # the peer's points reach the report
    assert [r["mode"] for r in json.loads(written.read_text())["results"]] == ["off", "reduce-overhead"]
    peer = runs["reduce-overhead"]
    assert not peer["error"] and set(peer["ms"]) == {"40/1"} and not peer["after_profiler"], peer
    assert peer["rel_err_vs_fp32"] is not None and not peer["drifted"]
    assert (tmp_path / "prof.md").read_text().count("######## ") == 2  # off's, then the peer's process's
    assert "NOTE:" not in bench.render(report)
    assert '{"mode": ' not in capfd.readouterr().out


def test_the_peers_partial_reports_join_the_report_so_far():
    saved: list = []
    bench._with_peer(saved.append, {"device": "x", "results": [{"mode": "off"}]},
                     {"device": "x", "results": [{"mode": "reduce-overhead"}]})
    assert saved == [{"device": "x", "results": [{"mode": "off"}, {"mode": "reduce-overhead"}]}]
    assert bench._picklable(lambda: None) is None and bench._picklable(saved.append) is not None


@pytest.mark.parametrize("fn, args, raised, match", [
    (int, ("x",), ValueError, r"^invalid literal for int\(\) with base 10: 'x'$"),  # a usage error: its line
    (operator.truediv, (1, 0), own_process.OwnProcessFailed, r"Traceback[\s\S]*ZeroDivisionError"),
    (os._exit, (3,), own_process.OwnProcessFailed, r"_exit's process ended \(exit status 3\) before its result"),
])
def test_a_call_in_its_own_process_that_fails_says_how(fn, args, raised, match):
    with pytest.raises(raised, match=match):
        own_process.call(fn, *args)


@pytest.mark.parametrize("ranks", [None, SimpleNamespace(lead=True)])
def test_an_attention_pass_after_a_profiled_one_runs_apart_or_is_marked(monkeypatch, capsys, ranks):
    """A pass after one whose floors traced CUDA runs in a process of its own; over
    several ranks, whose groups stay in their processes, in this one, marked. Each
    pass's entries are printed once, as JSON lines, wherever the pass ran."""
    seen = []

    def entries(run):
        return [{"mode": m, "error": None, "pass": run.model_option[-1]} for m in ("replay", "reduce-overhead")]

    def run_bench(run, checkpoint=None, fp32_results=None, ranks=None, place=None):
        seen.append(("here", run.model_option[-1], place.after_profiler))
        return {"profiled": True, "results": entries(run)}

    def call(fn, run, checkpoint, fp32_results, ranks, place):
        assert fn is cli_bench.bench.run_bench and checkpoint is not None and 0 < place.seconds < 100
        seen.append(("own process", run.model_option[-1], place.after_profiler))
        return {"profiled": True, "results": entries(run)}

    monkeypatch.setattr(cli_bench.bench, "run_bench", run_bench)
    monkeypatch.setattr(own_process, "call", call)
    monkeypatch.setattr(cli_bench, "_write_report", lambda args, reports: "")
    args = SimpleNamespace(attention=["flashinfer", "triton"], model_option=[], max_seconds=100.0)
    assert cli_bench.bench_passes(args, ranks) == 0
    second = ("own process", "attention_impl=triton", False) if ranks is None else ("here", "attention_impl=triton",
                                                                                   True)
    assert seen == [("here", "attention_impl=flashinfer", False), second]
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [(e["pass"], e["mode"]) for e in printed] == [
        (f"attention_impl={impl}", mode) for impl in ("flashinfer", "triton") for mode in ("replay", "reduce-overhead")]


def test_model_options_take_one_layer_id_as_a_list_of_one():
    cfg = bench_modes.model_config_of(SimpleNamespace(preset="tiny", model_option=["kv_source_layer_ids=1", "num_layers=4"]))
    assert cfg.kv_source_layer_ids == (1,) and cfg.num_layers == 4
    with pytest.raises(ValueError, match="--model-option no_such_field: not a model config field; the fields are name,"):
        bench_modes.model_config_of(SimpleNamespace(preset="tiny", model_option=["no_such_field=1"]))
    with pytest.raises(ValueError, match="--model-option: invalid ModelConfig: window must be an integer, got 'x'"):
        bench_modes.model_config_of(SimpleNamespace(preset="tiny", model_option=["window=x"]))


def _refuse_peer(compile_fn):
    """torch.compile for this backend's shared trace; the stock peer's call fails the test."""
    def fn(model, **kw):
        assert "backend" in kw, "the stock peer was compiled past the time budget"
        return compile_fn(model, **kw)
    return fn


def test_check_prompt_is_the_shortest_isl_capped():
    """A 128K-only run checks every mode on a prompt of CHECK_MAX_TOKENS tokens, not 128K
    (with 128K check prompts the bench spent over nine minutes before building a mode)."""
    assert bench.check_tokens([(131072, 1)]) == bench.CHECK_MAX_TOKENS
    assert bench.check_tokens([(8192, 1), (1024, 8)]) == 1024


def test_bench_options_may_not_override_what_modes_decide():
    args = SimpleNamespace(option=["cudagraph_mode=none"], max_num_batched_tokens=128)
    with pytest.raises(ValueError, match="--option cudagraph_mode"):
        bench_modes.backend_config("replay", "default", args)


def test_a_mode_that_fails_leaves_the_rotation_and_the_others_are_measured():
    class Runner:
        def __init__(self, fail: bool) -> None:
            self.fail = fail

        def prefill(self, prompts):
            if self.fail:
                raise RuntimeError("boom")
            return {}

        def free(self, rid) -> None:
            pass

    ok = bench_timing.TimedMode(bench.ModeRun("off", "default"), Runner(False))
    bad = bench_timing.TimedMode(bench.ModeRun("parent", "default"), Runner(True))
    args = SimpleNamespace(warmup=1, runs=3, profile_out=None, profile_points=[])
    bench_timing.time_points([bad, ok], [(8, 1), (16, 1)], float("inf"), args, [])
    assert bad.run.error == "RuntimeError: boom" and not bad.run.ms
    assert ok.run.error is None and set(ok.run.ms) == {"8/1", "16/1"}


def test_every_point_is_timed_before_the_profiler_runs(tmp_path):
    """A profiler session that traces CUDA leaves later CUDA calls slower on the host, so
    a profile (or a floor) between points would slow every point timed after it."""
    tags = []

    class Runner:
        def prefill(self, prompts):
            tags.append(next(iter(prompts)).split("-")[0])
            return {}

        def free(self, rid) -> None:
            pass

    modes = [bench_timing.TimedMode(bench.ModeRun(m, "default"), Runner()) for m in ("off", "parent")]
    args = SimpleNamespace(warmup=1, runs=2, profile_out=str(tmp_path / "prof.md"), profile_points=["8/1", "16/1"])
    timed = bench_timing.time_points(modes, [(8, 1), (16, 1)], float("inf"), args, [])
    assert tags == ["w0", "w0", "m0", "m0", "m1", "m1"] * 2  # no profile yet
    assert not bench_timing.floor_points(timed, float("inf"), args, "cpu", {})  # no CUDA traced
    assert tags.count("prof") == 4 and set(tags[-4:]) == {"prof"}
    assert tags[:-4] == ["w0", "w0", "m0", "m0", "m1", "m1"] * 2
    assert (tmp_path / "prof.md").read_text().count("######## ") == 4


class _Kineto:
    """Kineto's CUDA tracing (CUPTI) as the bench meets it, as its source has it.

    Each session resets Kineto's trace state as it starts and again as it ends, and each
    reset with ``TEARDOWN_CUPTI=1`` (unset too, here: the stricter reading) while the
    tracing is attached starts a teardown, carried out on the process's next CUDA call: a session in which that call
    lands records no GPU kernels. A session that starts after a teardown re-attaches the
    tracing only with ``TEARDOWN_CUPTI=1`` (lazy re-init) and without
    ``DISABLE_CUPTI_LAZY_REINIT``, else it records none. ``lose``: numbers of sessions
    that record nothing regardless (1 = the first)."""

    def __init__(self, lose=()) -> None:
        self.attached = self.pending = self.torn_down = False
        self.session = None  # the open session
        self.sessions = self.released = 0
        self.lose = set(lose)

    @staticmethod
    def _teardown_on() -> bool:
        return os.environ.get("TEARDOWN_CUPTI", "1") == "1"

    def _reset(self) -> None:
        if self.attached and self._teardown_on():
            self.pending = True

    def cuda_call(self) -> None:
        if self.pending:
            self.attached = self.pending = False
            self.torn_down = True
            self.released += 1
            if self.session is not None:
                self.session.lost = True

    def profile(self, activities=()):
        kineto = self

        class Session:
            lost = False

            def __enter__(self):
                kineto.sessions += 1
                self.lost = kineto.sessions in kineto.lose
                kineto._reset()
                if kineto.torn_down:
                    reinit = kineto._teardown_on() and "DISABLE_CUPTI_LAZY_REINIT" not in os.environ
                    self.lost |= not reinit
                    kineto.torn_down = not reinit
                kineto.session, kineto.attached = self, True
                kineto.cuda_call()  # the profiler's own start makes CUDA calls
                return self

            def __exit__(self, *exc):
                kineto.session = None
                kineto._reset()

            def key_averages(self):
                cuda = torch.autograd.DeviceType.CUDA
                return [] if self.lost else [SimpleNamespace(device_type=cuda, self_device_time_total=2500.0)]

        return Session()


def _floors_back_to_back(monkeypatch, kineto: _Kineto, profile_points=()):
    """The floors of two points of ``replay``, taken as time_points takes them on a GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: kineto.cuda_call())
    monkeypatch.setattr(torch.profiler, "profile", kineto.profile)

    class Runner:
        backend = SimpleNamespace(model=SimpleNamespace(replay=SimpleNamespace(host_us=[])))

        def prefill(self, prompts):
            kineto.cuda_call()  # a step launches work
            return {}

        def free(self, rid) -> None:
            pass

    mode = bench_timing.TimedMode(bench.ModeRun("replay", "wide"), Runner())
    floors: dict = {}
    args = SimpleNamespace(warmup=1, runs=2, profile_out="prof.md" if profile_points else None,
                           profile_points=list(profile_points))
    timed = bench_timing.time_points([mode], [(8, 1), (16, 1)], float("inf"), args, [])
    assert bench_timing.floor_points(timed, float("inf"), args, "cuda", floors)  # CUDA traced
    return mode.run, floors


def test_back_to_back_floors_keep_cuda_tracing_attached_from_one_to_the_next(monkeypatch):
    """A floor taken right after another session lost its tracing to that session's
    teardown and read 0.0 ms (a GPU run with --profile-points): the sessions keep the
    tracing attached from one to the next, nothing tears it down, and a later pass
    (--attention's next implementation) records too."""
    monkeypatch.delenv("TEARDOWN_CUPTI", raising=False)
    monkeypatch.delenv("DISABLE_CUPTI_LAZY_REINIT", raising=False)
    kineto = _Kineto()
    for _ in (1, 2):
        run, floors = _floors_back_to_back(monkeypatch, kineto)
        assert floors == {"wide": {"8/1": 2.5, "16/1": 2.5}} and run.floor_errors == {}
        assert kineto.attached and kineto.released == 0


def test_a_teardown_the_user_turned_off_stays_off(monkeypatch):
    monkeypatch.setenv("TEARDOWN_CUPTI", "0")
    kineto = _Kineto()
    run, floors = _floors_back_to_back(monkeypatch, kineto)
    assert floors == {"wide": {"8/1": 2.5, "16/1": 2.5}}
    assert kineto.attached and kineto.released == 0 and os.environ["TEARDOWN_CUPTI"] == "0"


def test_a_floor_whose_session_recorded_no_kernels_is_reported_missing_not_zero(monkeypatch):
    monkeypatch.delenv("TEARDOWN_CUPTI", raising=False)
    run, floors = _floors_back_to_back(monkeypatch, _Kineto(lose={2}))
    assert floors == {"wide": {"8/1": 2.5}}
    assert set(run.floor_errors) == {"16/1"} and "recorded no GPU kernels" in run.floor_errors["16/1"]
    report = {"preset": "tiny", "dtype": "float32", "device": "cuda", "torch": "x", "runs": 2, "warmup": 1,
              "max_num_batched_tokens": 64, "results": [vars(run)], "floor_ms": floors}
    text = bench.render(report)
    assert "| 16/1 | " in text and "NO FLOOR" in text and "wide/replay 16/1: the profiler recorded no GPU" in text


def test_trims_by_step_takes_each_place_in_a_run_over_the_runs_that_reach_it():
    runs = [[10.0, 50.0, 90.0], [20.0, 40.0], [30.0, 60.0, 70.0]]
    assert bench_timing.trims_by_step(runs) == [20.0, 50.0, 80.0]
    assert bench_timing.trims_by_step([]) == []


def _tiny_decode_bench(out, conc: str, steps: int, modes: str, *extra: str) -> int:
    """``replay-backend decode-bench`` on a four-layer tiny model at 40 tokens of context."""
    return cli.main(["decode-bench", "--preset", "tiny", "--model-option", "num_layers=4", "--model-option",
                     "kv_source_layer_ids=1,2", "--model-option", "window=16", "--context", "40", "--conc", conc,
                     "--mixed", "24", "--prefill-isl", "64", "--steps", str(steps), "--runs", "1", "--warmup", "1",
                     "--max-num-batched-tokens", "128", "--modes", modes, "--out", str(out), *extra])


def test_decode_bench_runs_each_mode_and_says_how_each_step_ran(tmp_path, capsys):
    """``replay-backend decode-bench`` on a four-layer tiny model: the decode points run
    PIECEWISE under piecewise and FULL under full_and_piecewise, with the same logits
    (fp32), and the report holds every point of both modes."""
    out = tmp_path / "decode.json"
    assert _tiny_decode_bench(out, conc="1,2", steps=2, modes="piecewise,full_and_piecewise") == 0
    report = json.loads(out.read_text())
    runs = {r["mode"]: r for r in report["results"]}
    assert runs["piecewise"]["kinds"] == {"40/1": "piecewise", "40/2": "piecewise"}
    assert runs["full_and_piecewise"]["kinds"] == {"40/1": "full", "40/2": "full"}
    assert runs["full_and_piecewise"]["capture"]["full"]["graphs"] > 0
    for r in runs.values():
        assert not r["error"] and set(r["tpot_ms"]) == set(r["pipelined_ms"]) == set(r["build_ms"]) == {"40/1", "40/2"}
        assert all(0 < r["build_ms"][p] < r["host_ms"][p] <= r["tpot_ms"][p] for p in r["tpot_ms"])
        assert set(r["mixed_ms"]) == {"24"} and set(r["ttft_ms"]) == {"64"}
        assert max(r["max_abs_err_vs_first"].values()) < 1e-4
    out = capsys.readouterr().out
    assert "| 40/2 |" in out and "| piecewise queued | build | host | full_and_piecewise queued | build | host |" in out


def test_the_decode_bench_host_profile_shows_where_a_full_step_spends_host_time(tmp_path):
    """``--host-profile-out`` with a profile point: per mode, cProfile's listing of that
    point's synchronised steps, the FULL graph's replay inside the step's dispatch."""
    out, prof = tmp_path / "decode.json", tmp_path / "host.txt"
    # At the longest context the caches hold: the profiled steps need room of their own.
    assert _tiny_decode_bench(out, "2", 8, "full_and_piecewise", "--context", "1024", "--profile-points", "1024/2",
                              "--host-profile-out", str(prof)) == 0
    text = prof.read_text()
    assert "######## full_and_piecewise decode 1024/2: 8 steps" in text
    assert "Ordered by: cumulative time" in text and "full.py" in text and "(replay)" in text


def _plain_peer(model, kw):
    """The stock peer's place in the bench, without its compile: Dynamo reset, then the
    plain model."""
    from replay_backend.reference.runner import StepRunner

    torch._dynamo.reset()
    return StepRunner(model, **kw), 0.0


@pytest.mark.parametrize("apart", [True, None])
def test_the_decode_bench_times_no_step_after_a_profiler_session_in_its_process(tmp_path, monkeypatch, apart):
    """A profiler session slows every later CUDA launch of its process (a graph's most),
    torn down or not: every timed step of this backend's modes comes before their first
    profile or floor, and so do the host profiles (cProfile). The stock peer follows,
    in a process of its own where their floors traced CUDA (``apart``, as on a GPU;
    the process here is this one, marked), else here (profiles on the CPU trace no CUDA)."""
    log: list[str] = []

    def logged(kind, fn):
        def wrapped(*a, **k):
            log.append(kind)
            return fn(*a, **k)
        return wrapped

    for name in ("_decode_point", "_mixed_point", "_prefill_points"):
        monkeypatch.setattr(decode_bench, name, logged("timed", getattr(decode_bench, name)))
    monkeypatch.setattr(decode_bench, "host_profile_to", logged("host", decode_bench.host_profile_to))
    monkeypatch.setattr(decode_bench, "profile_to", logged("session", decode_bench.profile_to))
    monkeypatch.setattr(decode_bench, "kernel_floor_ms", logged("session", decode_bench.kernel_floor_ms))
    monkeypatch.setattr(decode_bench, "stock_peer", _plain_peer)
    # a process of its own gets its arguments pickled
    monkeypatch.setattr(own_process, "call",
                        lambda fn, *a: log.append("new process") or fn(*pickle.loads(pickle.dumps(a))))
    args = cli.build_parser().parse_args([
        "decode-bench", "--preset", "tiny", "--model-option", "num_layers=4", "--model-option",
        "kv_source_layer_ids=1,2", "--model-option", "window=16", "--context", "40", "--conc", "1,2", "--mixed", "24",
        "--prefill-isl", "64", "--steps", "1", "--runs", "1", "--warmup", "1", "--max-num-batched-tokens", "128",
        "--modes", "piecewise,full_and_piecewise,reduce-overhead", "--profile-points", "40/1,40/2", "--profile-out",
        str(tmp_path / "p.txt"), "--host-profile-out", str(tmp_path / "h.txt")])
    report = decode_bench.run_decode_bench(args, peer_process=apart)
    # this backend's modes: 2 decode points, the mixed and the prefill steps, then 2 x 2 sessions
    cut = log.index("new process") if apart else [i for i, k in enumerate(log) if k == "session"][3] + 1
    ours, peer = log[:cut], log[cut + bool(apart):]
    assert ours.count("timed") == peer.count("timed") == 2 + 1 + 1 and ours.count("session") == 2 * 2, log
    first = ours.index("session")
    assert "timed" not in ours[first:] and "host" not in ours[first:], log
    assert peer.index("session") > max(i for i, k in enumerate(peer) if k in ("timed", "host")), log
    assert log.count("new process") == (1 if apart else 0)
    runs = {r["mode"]: r for r in report["results"]}
    assert list(runs) == ["piecewise", "full_and_piecewise", "reduce-overhead"]
    assert all(not r["error"] and set(r["tpot_ms"]) == {"40/1", "40/2"} for r in runs.values()), runs


def test_the_decode_peer_runs_apart_where_this_backends_floors_traced_cuda():
    assert decode_bench.peer_apart(True, "cuda", None) and not decode_bench.peer_apart(False, "cuda", None)
    assert not decode_bench.peer_apart(True, "cpu", None) and decode_bench.peer_apart(False, "cpu", True)
    assert not decode_bench.peer_apart(True, "cuda", False)


@pytest.mark.parametrize("raised, error", [
    (own_process.OwnProcessFailed("Traceback (most recent call last):\n  ...\nRuntimeError: boom"),
     "RuntimeError: boom"),
    (ValueError("--preset nope: not a preset"), "--preset nope: not a preset"),
])
def test_a_decode_peer_whose_process_fails_is_its_entry_and_the_others_stand(tmp_path, monkeypatch, capsys, raised,
                                                                              error):
    def call(fn, *a):
        raise raised

    monkeypatch.setattr(own_process, "call", call)
    monkeypatch.setattr(decode_bench, "peer_apart", lambda *a: True)
    out = tmp_path / "d.json"
    assert _tiny_decode_bench(out, "1", 1, "piecewise,reduce-overhead") == 1
    runs = {r["mode"]: r for r in json.loads(out.read_text())["results"]}
    assert runs["reduce-overhead"]["error"] == error and not runs["piecewise"]["error"]
    assert set(runs["piecewise"]["tpot_ms"]) == {"40/1"}
    assert "reduce-overhead: failed in its own process:" in capsys.readouterr().err


def test_the_stock_peer_marks_the_token_count_dynamic_for_its_first_trace_only(model, monkeypatch, fresh_dynamo):
    """As a user of reduce-overhead would: later calls are Dynamo's own, so a one-token
    step recompiles to a graph of one token (a token symbol of size one failed in
    Inductor on the GPU). The compile itself is left out: the model runs as it is."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    marked = []
    monkeypatch.setattr(compat_dynamo, "mark_tokens_dynamic", lambda *ts: marked.append(ts))
    runner, _ = bench_modes.stock_peer(model, dict(max_num_seqs=4, max_model_len=MAX_MODEL_LEN))
    runner.prefill({"a": 20})
    runner.step([RequestChunk("a", 1, 21)])
    assert len(marked) == 1 and marked[0][0].shape[0] == model.cfg.window


def test_a_decode_floor_that_fails_leaves_the_modes_times_and_says_why(tmp_path, capsys, monkeypatch):
    """Floors follow every timed step: one that fails (here its profile) is that point's
    NO FLOOR entry, and the mode's times stand."""
    real = decode_bench.profile_to

    def profile_to(path, title, *a):
        if title.startswith("full_and_piecewise"):
            raise RuntimeError("out of memory in the profiler")
        return real(path, title, *a)

    monkeypatch.setattr(decode_bench, "profile_to", profile_to)
    out = tmp_path / "d.json"
    assert _tiny_decode_bench(out, "1", 1, "piecewise,full_and_piecewise", "--profile-points", "40/1",
                              "--profile-out", str(tmp_path / "p.txt")) == 0
    runs = {r["mode"]: r for r in json.loads(out.read_text())["results"]}
    assert runs["full_and_piecewise"]["floor_errors"] == {"40/1": "RuntimeError: out of memory in the profiler"}
    assert not runs["piecewise"]["floor_errors"] and not runs["full_and_piecewise"]["error"]
    assert set(runs["full_and_piecewise"]["tpot_ms"]) == {"40/1"}
    printed = capsys.readouterr().out
    assert "NO FLOOR where the table shows none" in printed and "- full_and_piecewise 40/1: RuntimeError" in printed


def test_the_decode_bench_of_the_stock_peer_alone_prints_its_points_only(tmp_path, capsys, monkeypatch):
    """No line for the modes not asked for: each progress line names a mode's time."""
    monkeypatch.setattr(decode_bench, "stock_peer", _plain_peer)
    assert _tiny_decode_bench(tmp_path / "d.json", "1", 1, "reduce-overhead") == 0
    progress = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(("decode 40", "mixed", "prefill"))]
    assert len(progress) == 3 and all("reduce-overhead" in ln for ln in progress), progress


def test_a_peer_that_fails_while_measured_is_one_entry_with_its_error(tmp_path, capsys, monkeypatch):
    """The stock peer built, then failed at its first point (as torch's own compile can):
    its one report entry carries the error, the tables of the other modes still print,
    and the command's status says a mode failed."""
    from replay_backend.reference.runner import StepRunner

    def failing_peer(model, kw):
        runner = StepRunner(model, **kw)
        runner.prefill = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("CantSplit: the peer's own"))
        return runner, 0.0

    monkeypatch.setattr(decode_bench, "stock_peer", failing_peer)
    out = tmp_path / "decode.json"
    assert _tiny_decode_bench(out, conc="1", steps=1, modes="piecewise,reduce-overhead") == 1
    runs = json.loads(out.read_text())["results"]
    assert [r["mode"] for r in runs] == ["piecewise", "reduce-overhead"]
    assert runs[1]["error"] == "RuntimeError: CantSplit: the peer's own" and not runs[0]["error"]
    printed = capsys.readouterr()
    assert "| 40/1 | " in printed.out and "| reduce-overhead | 0 | RuntimeError: CantSplit" in printed.out
    # The whole traceback on stderr: where inside torch it failed.
    assert "reduce-overhead: failed; its traceback:" in printed.err and "in <lambda>" in printed.err


def test_the_bench_of_a_model_without_replay_layers_runs(tmp_path):
    """Its last layer a KV source: no replay layer, no region, nothing to time per trim."""
    out = tmp_path / "bench.json"
    rc = cli.main(["bench", "--preset", "tiny", "--model-option", "num_layers=4", "--model-option",
                   "kv_source_layer_ids=3", "--isl", "32", "--runs", "1", "--warmup", "0", "--modes", "replay",
                   "--settings", "default", "--option", "compiler=eager", "--max-num-batched-tokens", "64",
                   "--json", str(out)])
    assert rc == 0 and out.exists()


@pytest.mark.parametrize("argv, match", [
    (["--context", "16777215"], r"argument --context: 16777215 is above the limit"),
    (["--conc", "5000000"], r"argument --conc: 5000000 is above the limit of \d+ \(MAX_NUM_SEQS\)"),
    (["--context", "16777000", "--steps", "200"], r"--context 16777000 --conc 64 --steps 200 --warmup 3 \(caches "),
    (["--mixed", "600", "--max-num-batched-tokens", "512"], r"--mixed 600: more tokens than --max-num-batched"),
    (["--conc", "600", "--mixed", "64", "--max-num-batched-tokens", "512"], r"--conc 600: more tokens than"),
    (["--trace-dir", "/tmp"], r"--trace-dir keeps the traces of the profiled steps: give --profile-out"),
    (["--host-profile-out", "/tmp/h.txt"], r"--host-profile-out profiles the points of --profile-points, and none"),
    (["--host-profile-out", "/nonexistent/h.txt", "--profile-points", "1024/1"], r"--host-profile-out"),
    (["--profile-out", "/tmp/p.txt", "--profile-points", "1024/1,1024/4,512/8"],
     r"--profile-points 1024/4,512/8: not a point of --context x --conc"),
    (["--out", "/tmp/same.txt", "--host-profile-out", "/tmp/same.txt", "--profile-points", "1024/1"],
     r"--out and --host-profile-out name the same file '/tmp/same.txt'"),
    (["--context", "16777000", "--steps", "100", "--host-profile-out", "/tmp/h.txt", "--profile-points", "1024/1"],
     r"--steps 100 --warmup 3 --host-profile-out \(caches of"),
])
def test_decode_bench_sizes_out_of_range_are_one_line_before_any_model(argv, match, capsys, monkeypatch):
    monkeypatch.setattr(decode_bench, "bench_model", lambda *a, **k: pytest.fail("a model was built"))
    assert cli.main(["decode-bench", "--preset", "tiny", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(match, err[0]), err


def test_the_decode_report_has_the_piecewise_to_full_column_only_where_both_ran():
    def entry(mode, ms):
        return {"mode": mode, "error": None, "tpot_ms": {"1024/8": ms}, "floor_ms": {"1024/8": 9.0},
                "pipelined_ms": {"1024/8": ms}, "build_ms": {"1024/8": 0.5}, "host_ms": {"1024/8": 1.0},
                "mixed_ms": {}, "ttft_ms": {}, "capture": {}, "build_s": 1.0}

    def table(*runs):
        text = render_decode({"preset": "mini-2k", "device": "x", "torch": "2", "steps": 20, "results": list(runs)})
        return [line for line in text.splitlines() if line.startswith("| context/conc | ") or
                line.startswith("| 1024/8 | 1")][:2]

    assert table(entry("piecewise", 12.0)) == ["| context/conc | piecewise ms (floor, x floor) |",
                                                "| 1024/8 | 12.00 (9.00, 1.33x) |"]
    assert table(entry("piecewise", 12.0), entry("full_and_piecewise", 10.0)) == [
        "| context/conc | piecewise ms (floor, x floor) | full_and_piecewise ms (floor, x floor) "
        "| piecewise / full_and_piecewise |", "| 1024/8 | 12.00 (9.00, 1.33x) | 10.00 (9.00, 1.11x) | 1.20x |"]
