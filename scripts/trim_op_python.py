"""The trim op's own Python per trimming step, on its served path and on its general
path (``ReplayRuntime._served_trim`` / ``_dispatch``), with every graph replay stubbed
out: what is left is the op's host work without any CUDA call, on any machine.

usage: python3 scripts/trim_op_python.py [--isl 1024] [--steps 40] [--rounds 2]

The steps are one-prompt prefills of ``--isl`` tokens (tiny preset, 8 layers, pieces
as plain FX, main graphs at 512 and 1,024 tokens), each op call after the step's main
layers as in a served step, so the host's caches are as cold as they are there. The
paths alternate by rounds; each line is the median of one round's steps after five.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from replay_backend import ReplayBackend, RequestChunk, StepRunner, build_model, preset
from replay_backend.bench_timing import host_probe
from replay_backend.runtime import graphs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--isl", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_model(preset("tiny").with_layers(8, (1, 3)), device, torch.float32)
    be = ReplayBackend(compiler="eager", max_num_seqs=2, cudagraph_capture_sizes=[512, 1024],
                       decoder_replay_trim_threshold=512)
    runner = StepRunner(model, backend=be, max_num_seqs=2, max_model_len=args.isl + 256)
    runner.capture()
    rep = be.model.replay
    graphs.StaticGraph.replay = lambda self, a: self.outputs  # no graph runs: host work only
    served = rep._served
    for k in range(args.rounds):
        for name, plans in (("served path", served), ("general path", {})):
            rep._served = plans
            rep.host_us.clear()
            for i in range(args.steps):
                rid = f"{name}{k}.{i}"
                out = runner.step([RequestChunk(rid, args.isl, args.isl)])
                runner.free(rid)
            if not (out.trim.trimmed and out.trim.io_graphs):
                raise SystemExit(f"--isl {args.isl}: steps do not trim into graphs ({out.trim})")
            print(f"{name}: {statistics.median(list(rep.host_us)[5:]):.1f} us per trimming step")
    print("host speed (small CPU op / tiny CUDA launch, us):", host_probe())


if __name__ == "__main__":
    main()
