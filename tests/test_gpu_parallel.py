"""The parallel reference model on one GPU (NCCL, world size 1): the tensor-parallel
all-reduce and the expert-parallel exchange run inside captured CUDA graphs, with
Inductor pieces, against the single-process model; the bench at ``--tp 1`` likewise;
skipped without CUDA."""
from __future__ import annotations

import json

import pytest
import torch

from ranks import run_ranks
from test_parallel import check_one_rank, serve_one_rank

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("how", ["tp", "dep"])
def test_collectives_inside_captured_graphs_on_one_gpu(how):
    graphs, steps = run_ranks(serve_one_rank, 1, how, "cuda", "inductor", backend="nccl", timeout=400)[0]
    check_one_rank(graphs, steps)


def test_the_bench_at_tp1_on_one_gpu_runs_the_all_reduce_inside_its_graphs(tmp_path, monkeypatch):
    """``replay-backend bench --tp 1``: one rank spawned by the CLI (NCCL, world size 1),
    whose tensor-parallel all-reduce runs inside every captured graph of this backend's
    modes; every mode measured and within the rounding noise, and replay's floor taken
    on the rank."""
    from replay_backend.bench import ranks as bench_ranks
    from replay_backend.reference.cli import main

    for key in bench_ranks.TORCHRUN_ENV:
        monkeypatch.delenv(key, raising=False)
    out = tmp_path / "bench.json"
    code = main(["bench", "--tp", "1", "--preset", "mini-2k", "--model-option", "num_layers=8",
                 "--model-option", "kv_source_layer_ids=2,4", "--modes", "off,parent,replay",
                 "--settings", "default", "--isl", "1024", "--conc", "1", "--runs", "2", "--warmup", "1",
                 "--max-seconds", "400", "--json", str(out)])
    report = json.loads(out.read_text())
    runs = {r["mode"]: r for r in report["results"]}
    assert set(runs) == {"off", "parent", "replay"}
    for mode, r in runs.items():
        assert r["error"] is None and not r["drifted"] and set(r["ms"]) == {"1024/1"}, (mode, r)
    assert runs["replay"]["capture"]["main"]["graphs"] > 0
    assert report["floor_ms"]["default"]["1024/1"] > 0
    assert report["topology"] == {"tp": 1, "dp": 1, "enable_expert_parallel": False, "world": 1}
    assert report["floor_ms_by_rank"] == [report["floor_ms"]]
    assert code == 0
