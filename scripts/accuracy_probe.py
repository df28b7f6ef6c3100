"""How far a 16-bit model is from its fp32 copy, plain and compiled (CPU or GPU).

For each layer count and prompt length: the last-row logits of the plain 16-bit model,
of the same model compiled by this backend (``off`` mode: compiled pieces, no graphs,
no trimming) and of an fp32 copy (the same weights, upcast); the max |d| and the
relative L2 distance of each to the fp32 copy. A compiled model much further from the
fp32 copy than the plain one, growing with depth, points at a compiled piece rather
than at 16-bit rounding.

Two controls tell rounding from a wrong piece. ``--dtype float32`` compiles the fp32
model itself and compares it with its plain run, where rounding noise is ~1e-6 and a
piece that reads a wrong layout stands out at any depth. ``--sensitivity`` also runs the
fp32 copy with its embedding table nudged by half a bf16 step (relative 2^-9, random
sign): how far one rounding at the input moves the logits after the model's depth
(routing flips in the MoE layers amplify it).

usage: python3 scripts/accuracy_probe.py [--layers 4,40] [--isl 1024,4096]
           [--model-option num_experts=4 ...] [--compiler inductor]
           [--dtype float32] [--sensitivity]
"""
from __future__ import annotations

import argparse
import copy
import time

import torch

from replay_backend.backend import ReplayBackend
from replay_backend.bench_accuracy import fp32_reference
from replay_backend.cli_options import parse_options
from replay_backend.compare import max_abs_err
from replay_backend.config import ReplayConfig
from replay_backend.models import build_model, preset
from replay_backend.runner import StepRunner

CHECK = "check"  # the request id fp32_reference prefills (a prompt's tokens follow its id)


def distances(got: torch.Tensor, want: torch.Tensor) -> str:
    rel = ((got.float() - want).norm() / want.norm()).item()
    return f"max|d| {max_abs_err(got, want):.3g}, rel L2 {rel:.3g}"


def nudged_copy(model) -> torch.nn.Module:
    """An fp32 copy of ``model`` whose embedding rows are off by half a bf16 step."""
    nudged = copy.deepcopy(model).float()
    gen = torch.Generator().manual_seed(0)
    sign = torch.randint(0, 2, nudged.embed.shape, generator=gen).float().mul_(2).sub_(1)
    with torch.no_grad():
        nudged.embed.mul_(1 + 2.0 ** -9 * sign.to(nudged.embed.device))
    return nudged


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="mini-2k")
    ap.add_argument("--layers", default="40", help="comma-separated layer counts")
    ap.add_argument("--isl", default="1024", help="comma-separated prompt lengths")
    ap.add_argument("--model-option", action="append", default=[], help="KEY=VALUE model config override")
    ap.add_argument("--compiler", default="inductor")
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--sensitivity", action="store_true", help="also an fp32 copy with a nudged embedding")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    isls = [int(x) for x in args.isl.split(",")]
    base = preset(args.preset, **parse_options(args.model_option, "--model-option"))
    sources = base.kv_source_layer_ids
    for layers in (int(x) for x in args.layers.split(",")):
        # keep the sources that fit, at least the first: the cut model still has replay layers
        cfg = base.with_layers(layers, tuple(s for s in sources if s < layers - 1) or sources[:1])
        model = build_model(cfg, device, getattr(torch, args.dtype))
        kw = dict(max_num_seqs=1, max_model_len=max(isls) + 2,
                  max_num_batched_tokens=args.max_num_batched_tokens)
        backend = ReplayBackend(ReplayConfig.from_options({
            "compiler": args.compiler, "cudagraph_mode": "none", "decoder_replay": False,
            "max_num_batched_tokens": args.max_num_batched_tokens}))
        runners = {"plain": StepRunner(model, **kw), "compiled": StepRunner(model, backend=backend, **kw)}
        if args.sensitivity:
            runners["nudged fp32"] = StepRunner(nudged_copy(model), **kw)
        for isl in isls:
            t0 = time.perf_counter()
            out = {}
            for name, runner in runners.items():
                out[name] = runner.prefill({CHECK: isl})[CHECK].float()
                runner.free(CHECK)
            # an fp32 model is its own yardstick: its plain run
            exact = fp32_reference(model, isl, args.max_num_batched_tokens)
            exact = out["plain"] if exact is None else exact
            others = "; ".join(f"{name} {distances(got, exact)}" for name, got in out.items())
            print(f"{cfg.name} {args.dtype} {layers} layers, {isl} tokens "
                  f"(largest fp32 |logit| {exact.abs().max().item():.3g}) vs fp32: {others}; "
                  f"compiled vs plain max|d| {max_abs_err(out['compiled'], out['plain']):.3g} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
        del model, runners, backend
        if cuda:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
