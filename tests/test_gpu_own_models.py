"""The own models' serving soak on CUDA (tests/own_soak.py): real CUDA graphs, Inductor
pieces, fp32, each step against the model's eager run; skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

from own_soak import soak

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fresh_dynamo"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("model_name", ["llama", "gqa"])
def test_the_own_models_soak_on_cuda_graphs_with_inductor_pieces(model_name):
    report = soak(model_name, 100, seed=11, device="cuda", compiler="inductor")
    report.assert_clean()  # no mismatch, no recompile, capture or fallback while serving
    assert report.steps == 100 and report.device.startswith("cuda")
    # Real graphs: captured into CUDA graph memory (the CPU emulation holds none).
    assert report.capture["main"]["graphs"] > 0 and report.capture["replay"]["graphs"] > 0, report.render()
    assert report.capture["main"]["gib"] > 0, report.render()
    assert sum(report.lone.values()) >= 5, report.render()  # lone one-token steps
    trimmed_in_graphs = {k: n for k, n in report.kinds.items() if "/trimmed/replay-graph" in k}
    assert sum(trimmed_in_graphs.values()) >= 5, report.render()
    assert {"piecewise/trimmed/replay-graph/io-graphs", "piecewise/untrimmed/replay-graph",
            "eager/trimmed/replay-graph"} <= set(report.kinds), report.render()


def test_every_token_count_runs_on_the_one_trace_on_cuda_graphs():
    """Every step size from 1 to 64 and a lone one-token decode after each prefill, on
    CUDA graphs with Inductor pieces: one trace, no recompile, no fallback, each step
    equal to the eager model's in fp32."""
    from test_own_models import every_token_count

    kinds = every_token_count("cuda")
    assert (1, False) in kinds and (64, True) in kinds


@pytest.mark.parametrize("case", [0, 1, 2, 3])
def test_python_numbers_on_cuda_graphs_with_inductor_pieces(case):
    """Plain ``torch.compile(dynamic=True)``: a float argument, which Dynamo passes as a
    host tensor and a CUDA graph holds by value, runs in graphs only at the value they
    were captured with, and every step matches the eager model (tests/test_serving.py)."""
    from test_serving import NUMBER_STEPS, serve_numbers

    serve_numbers(*NUMBER_STEPS[case], device="cuda", compiler="inductor", tol=1e-4)

