"""Is every served step right? A serving soak of the compiled backend against the oracle.

One captured, serving runner (the backend's defaults unless --option says otherwise)
takes random mixed traffic: decodes, speculative decodes, first prefills, chunks after
cached context, keep-all prefills and prefills with a later floor. Each step also runs
through the eager oracle, and the logits and every cache slot the step wrote are
compared (replay_backend/soak.py). Prints the seed, the step kinds covered, the largest
error per compared part and every mismatch with its step in ``verify --batch`` form;
exits 1 on any mismatch or fallback.

    python3 scripts/soak.py --preset mini-1k --dtype float32 --steps 500 --seed 1
    python3 scripts/soak.py --preset mini-2k --dtype bfloat16 --steps 500 --seed 2
    python3 scripts/soak.py --preset mini-2k --dtype bfloat16 --model-option attention_impl=flashinfer \
        --oracle-option attention_impl=reference
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from replay_backend.reference.cli_options import model_config, parse_options
from replay_backend.reference import PRESETS, build_model
from replay_backend.reference.soak import soak


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="mini-1k")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--option", action="append", metavar="KEY=VALUE", help="a backend option")
    ap.add_argument("--model-option", action="append", metavar="KEY=VALUE",
                    help="a model config field, e.g. attention_impl=flashinfer")
    ap.add_argument("--oracle-option", action="append", metavar="KEY=VALUE",
                    help="a model config field of the oracle only, on top of --model-option (same weights); "
                         "e.g. attention_impl=reference checks FlashInfer against PyTorch's attention")
    ap.add_argument("--max-seconds", type=float, help="stop taking steps after this long (capture not counted)")
    ap.add_argument("--json", metavar="PATH", help="write the report here too")
    args = ap.parse_args()
    t0 = time.perf_counter()
    dtype = getattr(torch, args.dtype)
    try:
        cfg = model_config(args.preset, args.model_option)
        oracle_cfg = model_config(args.preset, (args.model_option or []) + (args.oracle_option or []),
                                  "--oracle-option")
    except ValueError as e:
        ap.error(str(e))
    model = build_model(cfg, args.device, dtype)
    oracle = None
    if args.oracle_option:
        oracle = build_model(oracle_cfg, args.device, dtype)
        oracle.load_state_dict(model.state_dict())
    report = soak(model, args.steps, args.seed, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                  max_num_batched_tokens=args.max_num_batched_tokens, options=parse_options(args.option),
                  log=lambda line: print(line, flush=True), max_seconds=args.max_seconds,
                  oracle_model=oracle)
    print(f"{args.preset} on {args.device}: {time.perf_counter() - t0:.0f} s with capture")
    print(report.render())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"preset": args.preset, "device": args.device, "model_options": args.model_option or [],
                       "oracle_options": args.oracle_option or [], "seed": report.seed, "steps": report.steps,
                       "dtype": report.dtype, "measure": report.measure, "limits": report.limits,
                       "kinds": dict(report.kinds), "worst": report.worst, "noise": report.noise, "counters_moved": report.counters_moved,
                       "mismatches": [vars(m) for m in report.mismatches]}, f, indent=2)
    return 1 if report.mismatches or report.counters_moved.get("fallbacks") else 0


if __name__ == "__main__":
    sys.exit(main())
