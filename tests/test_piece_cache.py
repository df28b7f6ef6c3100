"""Identical pieces compile once and still compute with their own weights."""
from __future__ import annotations

import pytest
import torch

from replay_backend import RequestChunk, StepRunner

from replay_backend.backend import ReplayBackend
from replay_backend.compat import inductor as compat_inductor
from replay_backend.reference.compare import max_abs_err, max_abs_err_kv
from replay_backend.counters import counters
from replay_backend.compiling.piece_cache import PieceCache, piece_key


@pytest.fixture(autouse=True)
def _reset():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_repeated_layers_share_compiled_pieces(model, monkeypatch):
    compiled = []

    def fake_inductor(gm, args, mode):  # stands in for Inductor: the piece itself, counted
        compiled.append(gm)
        return gm

    monkeypatch.setattr(compat_inductor, "inductor_compile", fake_inductor)
    cache = PieceCache()
    be = ReplayBackend(compiler="inductor", piece_cache=cache, max_num_seqs=4,
                       max_cudagraph_capture_size=64, decoder_replay_trim_threshold=48)
    rc, ro = StepRunner(model, max_model_len=512, backend=be), StepRunner(model, max_model_len=512)
    before = counters.snapshot()
    reqs = [RequestChunk("a", 1, 1), RequestChunk("b", 50, 50)]
    got, want = rc.step(reqs), ro.step(reqs)
    pieces = counters.pieces["graph"] - before["pieces"].get("graph", 0)
    hits = counters.piece_cache_hits - before["piece_cache_hits"]
    # 8 layers: layers 4..7 of the replay region (and layer 2 / 3 boundaries) repeat.
    assert len(compiled) == len(cache) == pieces - hits
    assert hits >= 3
    # A reused piece runs with the weights of the layer it stands for.
    assert max_abs_err(got.logits, want.logits) <= 1e-4
    assert max_abs_err_kv(rc.kv, ro.kv, got.batch) <= 1e-4

    # A second backend sharing the cache compiles nothing new.
    torch._dynamo.reset()
    be2 = ReplayBackend(compiler="inductor", piece_cache=cache, cudagraph_mode="none")
    n = len(compiled)
    StepRunner(model, max_model_len=512, backend=be2).step(reqs)
    assert len(compiled) == n


def test_piece_key_ignores_names_but_not_structure():
    def f(x, w):
        return torch.relu(x @ w)

    def g(x, w):
        return torch.sigmoid(x @ w)

    x, w = torch.randn(4, 8), torch.randn(8, 8)
    a, b, c = (torch.fx.symbolic_trace(fn) for fn in (f, f, g))
    b.graph.nodes.__iter__().__next__().name = "renamed"
    assert piece_key(a, [x, w]) == piece_key(b, [x, w])
    assert piece_key(a, [x, w]) != piece_key(c, [x, w])
    assert piece_key(a, [x, w]) != piece_key(a, [x.double(), w.double()])
