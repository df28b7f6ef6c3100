"""Where the trim op's host time goes (GPU): host time per phase of the trimming steps
of one prompt after another, as in served steps, then a cProfile of the op without its
region.

usage: python3 scripts/trim_probe.py [--preset tiny] [--layers N] [--isl 1024] [--steps 50] [--no-study]
       [--sizes 512,1024]

The main sizes captured are ``--sizes`` (512 and 1024 unless told): ``--isl 1024`` takes
the graphed path (the gathers and scatter as graphs, trim_io.py), ``--isl 2048`` the
path of steps whose main layers run without graphs (one row-moves launch each way,
row_moves.py; their host times are printed too); ``--isl 4096 --sizes 512,1024,4096``
the graphed path at 4,096 tokens. ``--layers N`` keeps the first N layers with KV
sources 1 and 3 (fast to compile; the trim op's host work does not depend on the layer
count).

On the GPU it then looks at where the op waits for the device inside real steps
(``trim_launches.py``; docs/benchmarks.md, trim op host time).
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch

from replay_backend.backend import ReplayBackend
from replay_backend.batch import RequestChunk
from replay_backend.bench.timing import host_probe
from replay_backend.config import ReplayConfig
from replay_backend.counters import counters
from replay_backend.reference import build_model, preset
from replay_backend.reference.runner import StepRunner
from replay_backend.dispatch import row_moves
from replay_backend.dispatch import trim_io


def _timed(cls, name: str, into: dict) -> None:
    fn = getattr(cls, name)

    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            into.setdefault(name, []).append((time.perf_counter() - t0) * 1e6)
    setattr(cls, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--isl", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--sizes", default="512,1024", help="main capture sizes")
    ap.add_argument("--no-study", action="store_true", help="skip trim_launches.py's study (GPU)")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()  # on the CPU the graphs are emulated: a smoke test only
    cfg = preset(args.preset)
    if args.layers:
        cfg = cfg.with_layers(args.layers, (1, 3))
    model = build_model(cfg, "cuda" if cuda else "cpu", torch.bfloat16 if cuda else torch.float32)
    sizes = [int(v) for v in args.sizes.split(",")]
    be = ReplayBackend(ReplayConfig.from_options({"compiler": "eager", "cudagraph_capture_sizes": sizes}))
    runner = StepRunner(model, backend=be, max_num_seqs=2, max_model_len=args.isl + 256)
    runner.capture()
    rep = be.model.replay
    if rep is None:
        raise SystemExit(f"{cfg.num_layers} layers leave no replay layers to trim: keep more (--layers)")

    def prompts(tag: str, n: int, spin: int = 0, sync: bool = True) -> list[float]:
        """``n`` one-prompt prefills; the region's host time (us) in each. ``spin``: a
        kernel of that many cycles queued first, so the host launches the whole step
        while the device is busy (as in a GPU-bound step). ``sync``: wait for each
        prompt, as the bench does at the end of each timed run; without it the host runs
        prompts ahead until the launch queue to the device is full (trim_launches.py)."""
        region = []
        for i in range(n):
            if spin:
                torch.cuda._sleep(spin)
            runner.prefill({f"{tag}{i}": args.isl})
            runner.free(f"{tag}{i}")
            region.append(rep._region_s * 1e6)
            if sync and cuda:
                torch.cuda.synchronize()
        return region

    prompts("w", 5)
    phases: dict = {}
    _timed(trim_io.TrimIO, "stage", phases)
    _timed(trim_io.TrimIO, "run", phases)  # includes the region
    for name in ("gather", "scatter"):  # the path without trim I/O graphs
        _timed(row_moves.RowMoves, name, phases)
    rep.host_us.clear()
    copies = counters.trim_index_copies
    region_us = prompts("m", args.steps)
    op_us = list(rep.host_us)
    copies = counters.trim_index_copies - copies  # 0: the gather graphs read the rows in place
    served, rep._served_pad = rep._served_pad, []  # the same steps through the op's general path
    rep.host_us.clear()
    prompts("g", args.steps)
    general_us = list(rep.host_us)
    rep._served_pad = served
    # The graphed path against the same step without graphs: a fast wrong op is no result.
    batch = runner.build_batch([RequestChunk("last", args.isl, args.isl)])
    last = runner.run(batch)
    plain = runner.run(batch, use_graphs=False)
    runner.free("last")
    print(f"logits, graphed trim vs no graphs: max|d| {(last.logits - plain.logits).abs().max().item():.3g}")
    if not op_us or not last.trim.trimmed:
        raise SystemExit(f"--isl {args.isl} gives steps that do not trim ({last.trim}): use one at or above "
                         f"the trim threshold ({be.config.decoder_replay_trim_threshold})")
    print(f"step {last.step}, trim {last.trim}")
    print(f"trim op host us (no region), median of {len(op_us)} steps: {statistics.median(op_us):.1f}"
          f" ({copies} of them copied their rows to the gather graphs' index)")
    if served and general_us:
        print(f"  the same steps through the op's general path (ReplayRuntime._dispatch): median "
              f"{statistics.median(general_us):.1f} us")
    for k, v in phases.items():
        print(f"  {k}: median {statistics.median(v):.1f} us over {len(v)}")
    print(f"  region (graphs + eager attention): median {statistics.median(region_us):.0f} us")
    print("host speed (small CPU op / tiny CUDA launch, us):", host_probe())
    if cuda and not args.no_study:
        from trim_launches import study  # beside this script

        study(runner, rep, prompts, last, args.steps)
    prof = cProfile.Profile()
    call = type(rep).__call__

    def profiled(self, *a):
        prof.enable()
        try:
            return call(self, *a)
        finally:
            prof.disable()
    type(rep).__call__ = profiled
    run_region = rep.run_region

    def region_unprofiled(*a):  # the op's own host work only
        prof.disable()
        try:
            return run_region(*a)
        finally:
            prof.enable()
    rep.run_region = region_unprofiled
    prompts("p", args.steps)
    st = pstats.Stats(prof).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, callers)
    calls = args.steps
    print(f"\ncProfile of the op without its region, us per trimming step (of {calls}):")
    print(f"{'self us':>9} {'cum us':>9} {'calls':>6}  function")
    for (f, line, name), (_, nc, tt, ct, _) in sorted(st.items(), key=lambda kv: -kv[1][2])[:30]:
        where = name if f == "~" else f"{f.rsplit('/', 2)[-1]}:{line}({name})"
        print(f"{tt / calls * 1e6:9.1f} {ct / calls * 1e6:9.1f} {nc / calls:6.1f}  {where}")


if __name__ == "__main__":
    main()
