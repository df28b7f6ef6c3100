"""Data parallelism: every rank replays if any does, all pad to one size."""
from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from replay_backend import RequestChunk, StepRunner, build_model, preset
from replay_backend.backend import ReplayBackend
from replay_backend.reference.compare import max_abs_err, max_abs_err_kv

CFG = preset("tiny").with_layers(6, (1, 2)).replace(window=16)
# Rank 0 has a long prefill (33 replay rows); rank 1 only decodes (nothing to trim).
STEPS = {0: [RequestChunk("a", 70, 70), RequestChunk("b", 17, 17)],
         1: [RequestChunk("c", 1, 30), RequestChunk("d", 1, 9)]}


def _worker(rank: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    model = build_model(CFG)
    be = ReplayBackend(compiler="eager", max_num_seqs=4, max_cudagraph_capture_size=64,
                       decoder_replay_trim_threshold=48, dp_group=dist.group.WORLD)
    rc, ro = StepRunner(model, max_model_len=256, backend=be), StepRunner(model, max_model_len=256)
    reqs = STEPS[rank]
    for r in (rc, ro):
        r.prefill_context(reqs, forward=model)
    got, want = rc.step(reqs), ro.step(reqs)
    torch.save({"trim": got.trim, "kind": got.step.kind, "err": max_abs_err(got.logits, want.logits),
                "kv": max_abs_err_kv(rc.kv, ro.kv, got.batch)}, f"{out}/{rank}.pt")
    dist.destroy_process_group()


def test_ranks_agree_on_replay():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(f"file://{os.path.join(tmp, 'store')}", tmp), nprocs=2, join=True)
        res = [torch.load(f"{tmp}/{r}.pt", weights_only=False) for r in range(2)]
    # Rank 0: an eager step (87 tokens > 64) trimming to 16 + 16 rows. Rank 1: a 2-token
    # PIECEWISE step below the threshold, nothing of its own to trim, replays anyway (all
    # its rows are replay rows), padded to the replay graph that fits rank 0's rows.
    assert res[0]["kind"] == "eager" and res[1]["kind"] == "piecewise"
    assert res[0]["trim"].trimmed and res[0]["trim"].rows == 32
    assert res[1]["trim"].trimmed and res[1]["trim"].rows == 2
    assert res[0]["trim"].padded == res[1]["trim"].padded == 32
    for r in res:
        assert r["err"] <= 1e-4 and r["kv"] <= 1e-4


def test_ranks_pad_to_the_largest_rank():
    from replay_backend.dispatch import trim_op

    calls = []

    class FakeGroup:
        pass

    def fake_all_reduce(t, op, group):  # the other rank needs 90 rows
        calls.append(t.tolist())
        t.copy_(torch.maximum(t, torch.tensor([1, 90])))

    mp_ = pytest.MonkeyPatch()
    mp_.setattr(dist, "get_backend", lambda g: "gloo")
    mp_.setattr(dist, "all_reduce", fake_all_reduce)
    try:
        assert trim_op.dp_agree(False, 0, FakeGroup()) == (True, 90)
        assert trim_op.dp_agree(True, 120, FakeGroup()) == (True, 120)
    finally:
        mp_.undo()
    assert calls == [[0, 0], [1, 120]]
