"""The parallel reference model on one GPU (NCCL, world size 1): the tensor-parallel
all-reduce and the expert-parallel exchange run inside captured CUDA graphs, with
Inductor pieces, against the single-process model; skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

from ranks import run_ranks
from test_parallel import check_one_rank, serve_one_rank

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("how", ["tp", "dep"])
def test_collectives_inside_captured_graphs_on_one_gpu(how):
    graphs, steps = run_ranks(serve_one_rank, 1, how, "cuda", "inductor", backend="nccl", timeout=400)[0]
    check_one_rank(graphs, steps)
