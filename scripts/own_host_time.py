"""Host time of an own model's served steps: direct calls against Dynamo's entry.

Serves the same steps of an own model (tests/llama_swa.py or tests/gqa_rope.py, Inductor
pieces, graphs captured) twice, once with ``direct_dispatch`` on (calls reach the graph
directly) and once off (every call through Dynamo's guards and argument prologue), and
prints the median host time per step of the model call alone and of the whole step
(``build_batch``, the context, the call), and the ratio. The GPU is idle at each step's
start (synchronised), so the times are the host's: what a server pays before its
step's first kernel is queued.

    python3 scripts/own_host_time.py --model gqa --steps 300
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import torch  # noqa: E402

import replay_backend  # noqa: E402
from replay_backend import RequestChunk, set_forward_context  # noqa: E402
from own_soak import MODELS  # noqa: E402
from own_server import OwnServer  # noqa: E402

# (name, requests of one step): a lone decode, a decode batch, a graphed prefill that trims
SHAPES = [("lone decode", [(1, 100)]), ("8 decodes", [(1, 100)] * 8), ("prefill 48", [(48, 48)])]


def serve(model_name: str, device: str, direct: bool):
    make_model, make_cache = MODELS[model_name]
    model = make_model().to(device).eval()
    compiled = replay_backend.compile(model, ("input_ids", "positions"), options={
        "compiler": "inductor", "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64],
        "decoder_replay_trim_threshold": 32, "max_num_seqs": 8, "max_num_batched_tokens": 256,
        "direct_dispatch": direct})
    server = OwnServer(model, make_cache, compiled, max_model_len=512, max_num_seqs=8)
    server.serve()
    return server, compiled


def time_shape(server, compiled, reqs: list[tuple[int, int]], steps: int) -> tuple[float, float]:
    """Median host microseconds of the model call and of the whole step."""
    call_us, step_us = [], []
    requests = [RequestChunk(f"r{i}", q, s) for i, (q, s) in enumerate(reqs)]
    blocks = [server.block(r.req_id) for r in requests]
    tokens = [server.default_tokens(r) for r in requests]
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    with torch.no_grad():
        for k in range(steps + 10):
            sync()
            t0 = time.perf_counter()
            batch = compiled.build_batch(requests, tokens, blocks)
            with set_forward_context(server.setup.context(batch)):
                t1 = time.perf_counter()
                compiled(batch.input_ids, batch.positions)
                t2 = time.perf_counter()
            if k >= 10:  # the first steps of a shape warm the host's caches
                call_us.append((t2 - t1) * 1e6)
                step_us.append((t2 - t0) * 1e6)
    return statistics.median(call_us), statistics.median(step_us)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="gqa")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = {}
    for direct in (True, False):
        torch._dynamo.reset()
        server, compiled = serve(args.model, args.device, direct)
        assert compiled.direct is direct
        for name, reqs in SHAPES:
            rows.setdefault(name, {})[direct] = time_shape(server, compiled, reqs, args.steps)
    print(f"{args.model} on {args.device}, torch {torch.__version__}: median host us per step over {args.steps}")
    print("| step | call, direct | call, Dynamo | ratio | whole step, direct | whole step, Dynamo | ratio |")
    print("|---|---|---|---|---|---|---|")
    for name, by in rows.items():
        (cd, sd), (cy, sy) = by[True], by[False]
        print(f"| {name} | {cd:.0f} | {cy:.0f} | {cy / cd:.2f} | {sd:.0f} | {sy:.0f} | {sy / sd:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
