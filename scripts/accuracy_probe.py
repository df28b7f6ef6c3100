"""How far a 16-bit model is from its fp32 copy, plain and compiled (CPU or GPU).

For each layer count and prompt length: the last-row logits of the plain 16-bit model
and of the same model compiled by this backend (``off`` mode: compiled pieces, no
graphs, no trimming), as relative L2 distances to those of an fp32 copy (the same
weights, upcast), next to the bench gate's rounding-noise band (``bench_accuracy``:
fp32 copies whose embedding is nudged by half a step of the model's dtype, i.e. how far
one rounding at the input moves the logits after the model's depth). A deep 16-bit
model amplifies rounding, so compiled and plain may land anywhere within a few times
the band. The decisive check is ``--dtype float32``: it compiles the fp32 model itself
and compares it with its plain run, where rounding noise is ~1e-6 and a piece that
reads a wrong layout stands out at any depth.

usage: python3 scripts/accuracy_probe.py [--layers 4,40] [--isl 1024,4096]
           [--model-option num_experts=4 ...] [--compiler inductor]
           [--dtype float32] [--plain-only]
"""
from __future__ import annotations

import argparse
import time

import torch

from replay_backend.backend import ReplayBackend
from replay_backend.reference.accuracy import CHECK, yardstick
from replay_backend.reference.cli_options import parse_options
from replay_backend.reference.compare import max_abs_err
from replay_backend.config import ReplayConfig
from replay_backend.reference import build_model, preset
from replay_backend.reference.runner import StepRunner

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="mini-2k")
    ap.add_argument("--layers", default="40", help="comma-separated layer counts")
    ap.add_argument("--isl", default="1024", help="comma-separated prompt lengths")
    ap.add_argument("--model-option", action="append", default=[], help="KEY=VALUE model config override")
    ap.add_argument("--compiler", default="inductor")
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--plain-only", action="store_true", help="the plain model and the band, no compiled model")
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
        plain, compiled = StepRunner(model, **kw), StepRunner(model, backend=backend, **kw)
        for isl in isls:
            t0 = time.perf_counter()
            out = []
            for runner in (plain,) if args.plain_only else (plain, compiled):
                out.append(runner.prefill({CHECK: isl})[CHECK].float())
                runner.free(CHECK)
            gate = yardstick(model, out[0], isl, args.max_num_batched_tokens)
            if args.plain_only:
                print(f"{cfg.name} {args.dtype} {layers} layers, {isl} tokens, rel L2 to the fp32 copy: "
                      f"plain {gate.plain_err:.3g}, nudged fp32 {gate.noise_err:.3g} "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
                continue
            err = gate.error(out[1])
            print(f"{cfg.name} {args.dtype} {layers} layers, {isl} tokens, rel L2 to the fp32 copy: "
                  f"plain {gate.plain_err:.3g}, nudged fp32 {gate.noise_err:.3g}, compiled {err:.3g}"
                  f"{' (DRIFT: above ' + format(gate.limit, '.3g') + ')' if gate.drifted(err) else ''}; "
                  f"compiled vs plain max|d| {max_abs_err(out[1], out[0]):.3g} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
        del model, plain, compiled, backend
        if cuda:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
