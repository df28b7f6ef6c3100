"""Is every served step of an own model right? The serving soak of tests/own_soak.py.

An own model (tests/llama_swa.py or tests/gqa_rope.py), compiled with
``replay_backend.compile``, captured and serving, takes seeded random chained traffic:
new and chunked prefills (some longer than W, some keep_all, some with a later floor),
lone one-token steps, batches of decodes and 2-4 token speculative decodes, finished
requests whose cache blocks later requests reuse. Every step also runs on the eager
model (the oracle, same weights), and each request's last-row logits and every cache
entry the step wrote that a later step may read are compared in fp32. Prints the step
kinds seen, the largest errors and every mismatch with its step's requests; exits 1 on
any mismatch, or on a recompile, trace, capture or fallback while serving.

    python3 scripts/own_soak.py --model gqa --steps 200 --compiler eager
    python3 scripts/own_soak.py --model llama --steps 100 --compiler inductor
    python3 scripts/own_soak.py --model gqa --device cuda --steps 300   # real CUDA graphs, Inductor
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import torch  # noqa: E402

from own_soak import MODELS, make_soak  # noqa: E402


def sizes(text: str) -> list[int]:
    try:
        out = sorted({int(s) for s in text.split(",") if s.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated sizes, got {text!r}") from None
    if not out or out[0] < 1:
        raise argparse.ArgumentTypeError(f"sizes must be positive integers, got {text!r}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="gqa")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--compiler", choices=("inductor", "eager"),
                    help="how the graph pieces compile (default: inductor on CUDA, eager on the CPU)")
    ap.add_argument("--capture-sizes", type=sizes, default=[1, 2, 4, 8, 16, 32, 64], metavar="N,N,...",
                    help="main graph sizes (default 1,2,4,8,16,32,64)")
    ap.add_argument("--replay-sizes", type=sizes, metavar="N,N,...",
                    help="replay graph sizes (default: the backend's, from W and --max-num-seqs)")
    ap.add_argument("--trim-threshold", type=int, default=32, help="decoder_replay_trim_threshold (default 32)")
    ap.add_argument("--max-num-seqs", type=int, default=8, help="cache blocks, the most requests at once")
    ap.add_argument("--max-num-batched-tokens", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--tolerance", type=float, help="fp32 tolerance: |d| <= tol * (1 + |want|) (default 1e-5)")
    ap.add_argument("--threads", type=int, default=1,
                    help="intra-op CPU threads (default 1: the models are tiny, and more threads only wait on "
                         "each other, far worse on a shared machine)")
    ap.add_argument("--quiet", action="store_true", help="no progress lines")
    args = ap.parse_args()
    if args.steps < 1:
        ap.error("--steps must be at least 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: CUDA is not available")
    if args.threads < 1:
        ap.error("--threads must be at least 1")
    torch.set_num_threads(args.threads)
    compiler = args.compiler or ("inductor" if args.device == "cuda" else "eager")
    log = None if args.quiet else (lambda line: print(line, flush=True))
    t0 = time.perf_counter()
    try:
        soak = make_soak(args.model, args.seed, device=args.device, compiler=compiler,
                         capture_sizes=args.capture_sizes, trim_threshold=args.trim_threshold,
                         replay_sizes=args.replay_sizes, max_num_seqs=args.max_num_seqs,
                         max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                         tolerance=args.tolerance, log=log)
    except ValueError as e:  # an option the backend or the cache refuses, before any step
        ap.error(str(e))
    report = soak.run(args.steps, log)
    print(report.render())
    print(f"{args.model} on {args.device}: {time.perf_counter() - t0:.1f} s with compile and capture")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
