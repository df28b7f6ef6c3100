"""The trim op's own Python per trimming step, on its served path and on its general
path (``ReplayRuntime._served_trim`` / ``_dispatch``), with every graph replay and row
move stubbed out: what is left is the op's host work without any CUDA call, on any
machine.

usage: python3 scripts/trim_op_python.py [--steps 40] [--rounds 2]

The steps are one-prompt prefills (tiny preset, 8 layers, pieces as plain FX, main
graphs at 512 and 1,024 tokens) of 1,024 tokens, whose gathers and scatter are graphs,
and of 2,048, whose main layers run without graphs (the row moves); each op call comes
after the step's main layers as in a served step, so the host's caches are as cold as
they are there. The paths alternate by rounds; each line is the median of one round's
steps after five.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from replay_backend import ReplayBackend, RequestChunk, StepRunner, build_model, preset
from replay_backend.bench.timing import host_probe
from replay_backend.capture import graphs
from replay_backend.dispatch import row_moves


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_model(preset("tiny").with_layers(8, (1, 3)), device, torch.float32)
    be = ReplayBackend(compiler="eager", max_num_seqs=2, cudagraph_capture_sizes=[512, 1024],
                       decoder_replay_trim_threshold=512)
    runner = StepRunner(model, backend=be, max_num_seqs=2, max_model_len=2048 + 256)
    runner.capture()
    rep = be.model.replay
    # host work only: no graph runs, no rows move
    graphs.StaticGraph.replay = lambda self, a: self.outputs
    row_moves.RowMoves.gather = row_moves.RowMoves.scatter = lambda self, *a: None
    pad = rep._served_pad
    for isl, kind in ((1024, "graphed main layers"), (2048, "main layers without graphs")):
        for k in range(args.rounds):
            for name, served in (("served path", pad), ("general path", [])):
                rep._served_pad = served  # empty: the served path is off
                rep.host_us.clear()
                for i in range(args.steps):
                    rid = f"{isl}{name}{k}.{i}"
                    out = runner.step([RequestChunk(rid, isl, isl)])
                    runner.free(rid)
                if not (out.trim.trimmed and out.trim.graph):
                    raise SystemExit(f"{isl} tokens: steps do not trim into replay graphs ({out.trim})")
                print(f"{isl} tokens, {kind}, {name}: {statistics.median(list(rep.host_us)[5:]):.1f} us "
                      "per trimming step")
    print("host speed (small CPU op / tiny CUDA launch, us):", host_probe())


if __name__ == "__main__":
    main()
