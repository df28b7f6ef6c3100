"""``replay-backend bench --tp N --dp N [--enable-expert-parallel]`` on the CPU: its usage
errors, the ranks it spawns (gloo), a rank that fails, and the report rank 0 writes."""
from __future__ import annotations

import json
import re

import pytest
import torch
import torch.distributed as dist

from replay_backend.bench import ranks as bench_ranks
from replay_backend.bench import report as bench_report
from replay_backend.reference import cli_bench
from replay_backend.reference.cli import main

# The tiniest model the bench takes: 4 layers, one KV source, prefills of 100 tokens trim.
TINY = ["--preset", "tiny", "--model-option", "num_layers=4", "--model-option", "kv_source_layer_ids=1",
        "--model-option", "window=16", "--option", "compiler=eager", "--option", "decoder_replay_trim_threshold=48",
        "--settings", "default", "--isl", "100", "--conc", "1", "--runs", "1", "--warmup", "0",
        "--max-num-batched-tokens", "128"]


@pytest.fixture
def no_torchrun(monkeypatch):
    for key in bench_ranks.TORCHRUN_ENV:
        monkeypatch.delenv(key, raising=False)


def _one_line_error(argv, capsys) -> str:
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("replay-backend: error: "), (code, err)
    return err[0]


@pytest.mark.parametrize("argv, match", [
    (["--tp", "0"], r"argument --tp: must be >= 1, got 0"),
    (["--dp", "x"], r"argument --dp: expected an integer, got 'x'"),
    (["--tp", "2", "--modes", "replay,reduce-overhead"], r"--modes reduce-overhead: the stock torch.compile peer "
                                                         r"runs on one process"),
    (["--enable-expert-parallel", "--compile-only"], r"--compile-only times one process's compile"),
])
def test_topology_usage_errors_are_one_line_before_any_rank_starts(argv, match, capsys, no_torchrun, monkeypatch):
    monkeypatch.setattr(bench_ranks, "launch", lambda *a: pytest.fail("a rank was started"))
    line = _one_line_error(["bench", *argv], capsys)
    assert re.search(match, line), line


def test_under_torchrun_the_world_must_be_tp_times_dp(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(bench_ranks, "launch", lambda *a: pytest.fail("a rank was started"))
    line = _one_line_error(["bench", "--tp", "2", *TINY], capsys)
    assert "--tp 2 --dp 1 make 2 ranks, torchrun started 3 (WORLD_SIZE)" in line, line


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the ranks of a GPU run take one GPU each")
def test_more_ranks_than_gpus_are_refused(capsys, no_torchrun):
    n = torch.cuda.device_count()
    line = _one_line_error(["bench", "--dp", str(n + 1)], capsys)
    assert f"make {n + 1} ranks, one GPU each; this machine has {n}" in line, line


def test_topology_leaves_the_stock_peer_out_of_the_default_modes(monkeypatch, no_torchrun):
    seen = []
    monkeypatch.setattr(bench_ranks, "launch", lambda body, args, topo: seen.append((args.modes, topo)) or 0)
    monkeypatch.setattr(cli_bench, "bench_passes", lambda args: seen.append((args.modes, None)) or 0)
    assert main(["bench", "--dp", "2", "--enable-expert-parallel", *TINY[:-14]]) == 0
    assert main(["bench", *TINY[:-14]]) == 0
    assert seen == [(["eager", "off", "parent", "piecewise", "replay"], bench_ranks.Topology(1, 2, True)),
                    (list(bench_report.MODES), None)]


def test_a_rank_the_model_cannot_be_split_for_is_named(capsys, no_torchrun):
    line = _one_line_error(["bench", "--tp", "3", *TINY, "--modes", "eager"], capsys)
    assert re.match(r"replay-backend: error: rank \d: parallel: tp_size=3 does not divide num_heads=4", line), line


def _rank_one_raises(args, ranks) -> int:
    if ranks.rank == 1:
        raise RuntimeError("rank 1 gives up")
    dist.all_reduce(torch.zeros(1), group=ranks.world_group)  # waits for rank 1, which never comes
    return 0


def test_a_rank_that_raises_is_named_and_the_others_are_stopped(capsys, no_torchrun, monkeypatch):
    monkeypatch.setattr(bench_ranks, "KILL_GRACE_S", 1.0)
    code = bench_ranks.launch(_rank_one_raises, None, bench_ranks.Topology(dp=2))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err[-1] == "replay-backend: error: rank 1 raised: RuntimeError: rank 1 gives up", err
    assert "(rank(s) [0] failed or were stopped after it)" in err


@pytest.mark.parametrize("flags", [["--tp", "2"], ["--dp", "2", "--enable-expert-parallel"]],
                         ids=["tp2", "dep2"])
def test_bench_over_two_spawned_ranks_reports_every_mode_from_rank_0(flags, tmp_path, no_torchrun):
    """The CLI spawns two gloo ranks; rank 0 writes the report: every mode timed and as
    exact as the plain model split the same way, the topology, each rank's floors (none
    on the CPU) and, under DEP, the per-step agreement's host time."""
    out = tmp_path / "bench.json"
    assert main(["bench", *flags, *TINY, "--modes", "eager,off,parent,replay", "--json", str(out),
                 "--out", str(tmp_path / "bench.md")]) == 0
    report = json.loads(out.read_text())
    runs = {r["mode"]: r for r in report["results"]}
    assert set(runs) == {"eager", "off", "parent", "replay"}
    for mode, r in runs.items():
        assert r["error"] is None and set(r["ms"]) == {"100/1"}, (mode, r["error"])
        assert r["max_abs_err_vs_eager"] < 1e-4 and not r["drifted"], (mode, r["max_abs_err_vs_eager"])
    assert runs["replay"]["trim_host_us"]  # the 100-token prompt trims
    ep = "--enable-expert-parallel" in flags
    assert report["topology"] == {"tp": 1 if ep else 2, "dp": 2 if ep else 1, "enable_expert_parallel": ep,
                                  "world": 2}
    assert report["floor_ms_by_rank"] == [{}, {}]
    # the data-parallel ranks agree on every step; tensor-parallel ones hold one batch
    assert report["agree_us_median"] > 0 if ep else report["agree_us_median"] is None
    heading = (tmp_path / "bench.md").read_text().splitlines()[0]
    assert ("TP1 x DP2 expert-parallel, 2 ranks" if ep else "TP2 x DP1, 2 ranks") in heading, heading


def test_render_names_the_topology_and_the_other_ranks_floors_that_differ():
    report = {"preset": "mini-2k", "dtype": "torch.bfloat16", "device": "GPU", "torch": "2.13",
              "runs": 10, "warmup": 1, "max_num_batched_tokens": 16384,
              "topology": {"tp": 2, "dp": 2, "enable_expert_parallel": True, "world": 4},
              "floor_ms": {"default": {"1024/1": 20.0, "8192/1": 100.0}},
              "floor_ms_by_rank": [{"default": {"1024/1": 20.0, "8192/1": 100.0}},
                                   {"default": {"1024/1": 20.1, "8192/1": 100.5}},
                                   {"default": {"1024/1": 26.0, "8192/1": 100.0}}, {}],
              "agree_us_median": 41.5,
              "results": [{"mode": "replay", "setting": "default", "compile_s": 2.0, "capture": {}, "error": None,
                           "ms": {"1024/1": 25.0, "8192/1": 110.0}}]}
    text = bench_report.render(report)
    assert "TP2 x DP2 expert-parallel, 4 ranks (rank 0's times)" in text.splitlines()[0]
    assert "floor ms of the other ranks, where more than 2% from rank 0's (the table's):\n" \
           "- rank 2 default: 1024/1 26.0\n" in text
    assert "rank 1" not in text and "rank 3" not in text
    assert "per-step agreement of the data-parallel ranks (one small gloo all-reduce): median 41.5 us" \
           in text


def test_bench_under_torchrun_runs_one_rank_per_process_and_rank_0_reports(tmp_path):
    """``torchrun --nproc-per-node 2`` starts the bench in each process (WORLD_SIZE,
    RANK, LOCAL_RANK from its environment, its rendezvous): the ranks agree on every
    step and rank 0 alone writes the report."""
    import os
    import subprocess
    import sys

    out = tmp_path / "bench.json"
    env = {k: v for k, v in os.environ.items() if k not in bench_ranks.TORCHRUN_ENV}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "replay_backend.reference.cli", "bench", "--dp", "2", "--enable-expert-parallel", *TINY,
           "--modes", "off,replay", "--json", str(out), "--out", str(tmp_path / "bench.md")]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["topology"]["world"] == 2 and report["agree_us_median"] > 0
    runs = {r["mode"]: r for r in report["results"]}
    assert set(runs) == {"off", "replay"} and all(r["error"] is None for r in runs.values())
    assert runs["replay"]["max_abs_err_vs_eager"] < 1e-4
    assert done.stdout.count("| ISL/conc |") == (tmp_path / "bench.md").read_text().count("| ISL/conc |")
