"""``replay-backend``: demo, verify, inspect and bench (SPEC §8)."""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from .batch_spec import parse_batch_spec
from .compare import default_tolerance, max_abs_err, max_abs_err_kv
from .models import PRESETS, build_model, preset
from .runner import StepRunner

DEFAULT_BATCH = "d:1/300,p:250,p:60/260,k:140"


def _device_defaults(args) -> tuple[str, str, torch.dtype]:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    name = args.preset or ("mini-2k" if device.startswith("cuda") else "tiny")
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    return device, name, dtype


def _timed(fn):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, (time.perf_counter() - t0) * 1e3


def cmd_demo(args) -> int:
    device, name, dtype = _device_defaults(args)
    cfg = preset(name)
    print(f"model   : DSv4.1-mini preset {name!r}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
          f"window {cfg.window}, KV sources {list(cfg.kv_source_layer_ids)}, replay layers "
          f"{cfg.replay_layers.start}..{cfg.replay_layers.stop - 1}; {device}, {dtype}")
    model = build_model(cfg, device, dtype)
    reqs = parse_batch_spec(args.batch)
    runners = {m: StepRunner(model, max_num_seqs=len(reqs), max_model_len=args.max_model_len)
               for m in ("off", "parent")}
    for m, r in runners.items():
        r.prefill_context(reqs)
    batch = runners["off"].build_batch(reqs)
    print(f"batch   : {args.batch}  ({batch.num_tokens} tokens, {len(reqs)} requests, "
          f"{batch.replay.num_rows} replay rows, floors {list(batch.view.kv_start)})")
    outs = {}
    for m, r in runners.items():
        outs[m], ms = _timed(lambda: r.step(reqs, eager_replay=m))
        print(f"mode    : eager {m:<7s} {ms:8.1f} ms")
    err = max_abs_err(outs["off"].logits, outs["parent"].logits)
    kv_err = max_abs_err_kv(runners["off"].kv, runners["parent"].kv, batch)
    tol = default_tolerance(dtype)
    ok = err <= tol and kv_err <= tol
    print(f"agree   : off vs parent: logits max|d| {err:.2e}, replay KV max|d| {kv_err:.2e} "
          f"(tolerance {tol:.0e}) -> {'OK' if ok else 'MISMATCH'}")
    return 0 if ok else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="replay-backend", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="run the main job on the embedded default model")
    d.add_argument("--preset", choices=sorted(PRESETS))
    d.add_argument("--device")
    d.add_argument("--batch", default=DEFAULT_BATCH)
    d.add_argument("--max-model-len", type=int, default=1024)
    d.set_defaults(fn=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except ValueError as e:
        print(f"replay-backend: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
