"""The first served steps after capture (GPU): each step's wall time and the Triton JIT
builds inside it. A build inside a served step is a hiccup a user sees (about 1 s per
variant): capture should have built every variant a step can need.

usage: python3 scripts/first_steps_probe.py [--preset mini-2k] [--layers 8]
           [--shapes 1024/1,1024/2,1024/8,1024/8,2048/1,4096/2]

Default capture setting (main sizes up to 1,024), ``max_num_batched_tokens`` 16384,
Inductor pieces; ``--shapes`` are ISL/concurrency prompt sets, prefilled one after
another. The builds listed are those of ``@triton.jit`` kernels (the attention,
Sinkhorn and row-moves kernels), seen through Triton's post-compile hook; Inductor's
own kernels are built at compile time and do not go through it.
"""
from __future__ import annotations

import argparse
import time

import torch
import triton

from replay_backend.backend import ReplayBackend
from replay_backend.bench.timing import ttft
from replay_backend.config import ReplayConfig
from replay_backend.reference import build_model, preset
from replay_backend.reference.runner import StepRunner


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="mini-2k")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--shapes", default="1024/1,1024/2,1024/8,1024/8,2048/1,4096/2")
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("/")) for s in args.shapes.split(",")]
    cfg = preset(args.preset)
    if args.layers:
        cfg = cfg.with_layers(args.layers, (1, 3))
    model = build_model(cfg, "cuda", torch.bfloat16)
    be = ReplayBackend(ReplayConfig.from_options({"max_num_batched_tokens": 16384}))
    runner = StepRunner(model, backend=be, max_num_seqs=max(c for _, c in shapes),
                        max_model_len=max(i for i, _ in shapes) + 2)
    builds: list[str] = []

    def seen(*, repr, **_) -> None:  # noqa: A002 - Triton's keyword
        builds.append(repr)
    triton.knobs.runtime.jit_post_compile_hook = seen
    t0 = time.perf_counter()
    runner.capture()
    # capture() starts with the first trace and compile: this is not the graphs' time
    print(f"compile, warm-up and capture: {time.perf_counter() - t0:.1f} s, {len(builds)} Triton builds"
          + (f" (the attention's split warm-up step {runner.split_warmup_s:.1f} s)" if runner.split_warmup_s else ""))
    builds.clear()
    for k, (isl, conc) in enumerate(shapes):
        ms = ttft(runner, isl, conc, f"p{k}")  # as the bench times a run: synchronised, then freed
        print(f"{isl}/{conc}: {ms:.1f} ms, {len(builds)} Triton builds")
        for b in builds:
            print(f"  built {b[:300]}")
        builds.clear()


if __name__ == "__main__":
    main()
