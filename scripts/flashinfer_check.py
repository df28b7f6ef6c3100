"""Where does attention through FlashInfer go wrong on a batch? Call by call, on the GPU.

Runs each batch (``verify --batch`` form, as the soak prints a failing step) after its
cached context through an uncompiled runner of the model with
``attention_impl="flashinfer"``, and

1. holds every FlashInfer call (each layer's SWA part and global part) to FlashInfer's
   documented semantics (reference/flashinfer_semantics.py) run on the same plan in
   fp32: the worst row's relative L2 of the output, over rows that see a key;
2. compares the step as a whole (logits, every cache slot it wrote) with the same
   weights under PyTorch's attention, by the worst row's relative L2, against the
   rounding noise of that model with its embedding one rounding away.

A call above ``--limit`` prints its plan (requests as rows/keys, window, split) and its
worst row's request. Exits 1 when a call or the step as a whole is out of bounds. The
first tells a kernel or plan fault apart from one in this project's key sets (which the
CPU tests hold to the same semantics); an uncompiled step that agrees while the soak
fails points at serving (graphs, plans of replay views) instead.

    python3 scripts/flashinfer_check.py --preset tiny \\
        --batch "d:1/58,d:4/5,d:1/72,p:869/1091@971" --batch "d:4/67,d:1/5,p:664/664"
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import asdict, dataclass, replace

import torch

from replay_backend.reference import PRESETS, build_model
from replay_backend.reference.accuracy import noise_limit, nudged_copy
from replay_backend.reference.batch_spec import parse_batch_spec
from replay_backend.reference.cli_options import model_config
from replay_backend.reference.compare import row_rel_l2, worst_row_rel_l2
from replay_backend.reference.flashinfer_semantics import EmulatedPrefillWrapper
from replay_backend.reference.runner import StepRunner
from replay_backend.reference.step_compare import compare_step


DUMPS = 4


@dataclass(frozen=True)
class PlanSummary:
    """What one FlashInfer plan asked for."""
    qo_indptr: tuple[int, ...]
    kv_indptr: tuple[int, ...]
    window_left: int
    split: bool  # FlashInfer may split the keys across programs

    @property
    def part(self) -> str:
        return "swa" if self.window_left >= 0 else "global"

    def request_of(self, row: int) -> int:
        return next(i for i in range(len(self.qo_indptr) - 1) if self.qo_indptr[i] <= row < self.qo_indptr[i + 1])


@dataclass(frozen=True)
class Call:
    """One FlashInfer run, held to the semantics."""
    index: int
    err: float  # the worst row's relative L2 (inf where FlashInfer's row is not finite)
    row: int  # that row, in the call's own order
    plan: PlanSummary

    def render(self) -> str:
        qo, kv = self.plan.qo_indptr, self.plan.kv_indptr
        reqs = [f"{qo[i + 1] - qo[i]}/{kv[i + 1] - kv[i]}" for i in range(len(qo) - 1)]
        return (f"call {self.index} ({self.plan.part}, window_left {self.plan.window_left}, "
                f"split {'allowed' if self.plan.split else 'off'}): worst row {self.row} "
                f"(request {self.plan.request_of(self.row)}) rel L2 {self.err:.3g}; "
                f"requests rows/keys: {' '.join(reqs)}")


class Checked:
    """A FlashInfer wrapper whose every run is also computed by the semantics.
    ``no_split``: plan every call unsplit, to see whether a fault follows FlashInfer's
    split-KV path. ``dump``: where the first ``DUMPS`` calls above ``limit`` are saved
    (each holds the whole cache it read), named by ``tag()`` and the call."""

    def __init__(self, real, calls: list[Call], no_split: bool, limit: float, dump: str | None,
                 dumped: list[str], tag) -> None:
        self.real, self.calls, self.no_split, self.limit = real, calls, no_split, limit
        self.dump, self.dumped, self.tag = dump, dumped, tag
        self.semantics = EmulatedPrefillWrapper(None)
        self.plan_summary: PlanSummary | None = None

    # Every call through run(), where it is checked: none straight to the kernels
    # (flashinfer_compat.DirectCalls).
    direct_calls = False

    # The real wrapper's own state (underscored) is its own, read and written through
    # this one: the attention hands it staging buffers in turns (flashinfer_compat).
    def __getattr__(self, name):
        real = self.__dict__.get("real")
        if real is None:
            raise AttributeError(name)
        return getattr(real, name)

    def __setattr__(self, name, value) -> None:
        if name.startswith("_"):
            setattr(self.real, name, value)
        else:
            object.__setattr__(self, name, value)

    def plan(self, **kw) -> None:
        if self.no_split:
            kw["disable_split_kv"] = True
        self.real.plan(**kw)
        self.semantics.plan(**kw)
        self.plan_summary = PlanSummary(tuple(kw["qo_indptr"].tolist()), tuple(kw["paged_kv_indptr"].tolist()),
                                        kw["window_left"], not kw["disable_split_kv"])

    def run(self, q, kv, *, out, lse, return_lse) -> None:
        self.real.run(q, kv, out=out, lse=lse, return_lse=return_lse)
        want = torch.empty(out.shape, dtype=torch.float32, device=out.device)
        want_lse = torch.empty_like(lse)
        self.semantics.run(q, kv, out=want, lse=want_lse, return_lse=True)
        seen = torch.isfinite(want_lse).all(dim=1)  # rows with a key: rows without weigh nothing
        rows = row_rel_l2(out.flatten(1)[seen], want.flatten(1)[seen])
        worst = int(rows.argmax()) if rows.numel() else 0
        call = Call(len(self.calls), rows.max().item() if rows.numel() else 0.0,
                    seen.nonzero().flatten()[worst].item() if rows.numel() else 0, self.plan_summary)
        self.calls.append(call)
        if self.dump and not call.err <= self.limit and len(self.dumped) < DUMPS:
            # Everything the call read and wrote, to find offline which keys the kernel used.
            path = os.path.join(self.dump, f"{self.tag()}-call{call.index}.pt")
            torch.save({"plan": asdict(call.plan), "q": q.cpu(), "kv": kv[0].cpu(),
                        "kv_indices": self.semantics.indices.cpu(), "out": out.cpu(), "lse": lse.cpu(),
                        "want": want.cpu(), "want_lse": want_lse.cpu(), "scale": self.semantics.scale}, path)
            self.dumped.append(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--model-option", action="append", metavar="KEY=VALUE", help="a model config field")
    ap.add_argument("--batch", action="append", required=True, help="one step, e.g. d:1/58,p:869/1091@971")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--limit", type=float, default=0.02,
                    help="largest worst-row relative L2 of one call against the semantics (bf16 output)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--no-split", action="store_true",
                    help="plan every FlashInfer call with its split-KV path off")
    ap.add_argument("--dump", metavar="DIR", help=f"save the first {DUMPS} calls above --limit here (torch.save)")
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    cfg = model_config(args.preset, args.model_option)
    model = build_model(cfg.replace(attention_impl="flashinfer"), args.device, torch.bfloat16)
    ref = build_model(cfg.replace(attention_impl="reference"), args.device, torch.bfloat16)
    ref.load_state_dict(model.state_dict())
    kw = dict(max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
              max_num_batched_tokens=max(sum(r.query_len for r in parse_batch_spec(b)) for b in args.batch))
    runner, oracle = StepRunner(model, **kw), StepRunner(ref, **kw)
    noise = StepRunner(nudged_copy(ref, args.seed), **kw)
    calls: list[Call] = []
    dumped: list[str] = []
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
    phase = ["context"]  # names the dumps: the batch, and whether its context or its step
    make = runner.attention.factory
    runner.attention.factory = lambda buffers: Checked(make(buffers), calls, args.no_split, args.limit, args.dump,
                                                       dumped, lambda: phase[0])
    bad = False
    for n, spec in enumerate(args.batch):
        reqs = [replace(r, req_id=f"b{n}{r.req_id}") for r in parse_batch_spec(spec)]
        phase[0] = f"batch{n}-context"
        for r in (runner, oracle, noise):
            r.prefill_context(reqs)
        context_over = sum(not c.err <= args.limit for c in calls)
        calls.clear()
        phase[0] = f"batch{n}"
        got, want, nudged = runner.step(reqs), oracle.step(reqs), noise.step(reqs)
        errs = compare_step(runner.kv, oracle.kv, reqs, got, want, worst_row_rel_l2)
        envelope = compare_step(noise.kv, oracle.kv, reqs, nudged, want, worst_row_rel_l2)
        over = [c for c in calls if not c.err <= args.limit]
        far = {k: v for k, v in errs.items() if not v <= noise_limit(envelope[k])}
        worst = max(calls, key=lambda c: c.err, default=None)
        print(f"{spec}: {len(calls)} FlashInfer calls, worst {worst.err if worst else 0:.3g}; "
              f"{len(over)} above {args.limit} (and {context_over} while building its context)")
        print("  step vs PyTorch attention (worst row rel L2 / noise): "
              + ", ".join(f"{k} {v:.3g}/{envelope[k]:.3g}" for k, v in errs.items()))
        for c in over[:8]:
            print("  " + c.render())
        if far:
            print(f"  OUT OF BOUNDS: {sorted(far)}")
        bad = bad or bool(over or far or context_over)
        for r in (runner, oracle, noise):
            for q in reqs:
                r.free(q.req_id)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
