"""Host time of building a step's metadata (``build_step_batch``), on the CPU.

Every step builds its metadata on the host before its first kernel can run, so this
time is on the critical path of a step's TTFT (docs/benchmarks.md, runs 18-19). The
probe times the build for mini-2k's window at a few request shapes, with the runner's
prompt tokens made beforehand, as the median of ``--runs`` builds in one process.

``--baseline REV`` times the build as it is at git revision REV in turns with this
checkout's, in the same process, and checks that both build the same metadata.

    python3 scripts/batch_probe.py --baseline 715c54d
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from replay_backend import batch as current
from replay_backend.kv_cache import CacheLayout
from replay_backend.reference import preset
from replay_backend.reference.runner import PromptTokens

SHAPES = {"1x1024": [1024], "8x1024": [1024] * 8, "1x4096": [4096], "16x1024": [1024] * 16}


def load_baseline(rev: str):
    """``replay_backend/batch.py`` and the attention row blocks it imports as they are at
    git revision ``rev``, loaded beside this checkout's."""
    def source(path: str) -> str:
        return subprocess.run(["git", "show", f"{rev}:{path}"], check=True, capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent.parent).stdout

    def load(name: str, src: str):
        tmp = Path(tempfile.mkdtemp()) / f"{name}.py"
        tmp.write_text(src)
        spec = importlib.util.spec_from_file_location(name, tmp)
        mod = sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    load("baseline_attention", source("replay_backend/models/attention_triton.py")
         .replace("from ._triton", "from replay_backend.triton_compat"))
    return load("baseline_batch", source("replay_backend/batch.py")
                .replace("from .models.attention_triton", "from baseline_attention")
                .replace("from .", "from replay_backend."))


def same(a, b) -> bool:
    pairs = [(a.input_ids, b.input_ids), (a.positions, b.positions), (a.logits_indices, b.logits_indices),
             (a.replay.count_rows, b.replay.count_rows), (a.view.slot_mapping, b.view.slot_mapping),
             (a.replay.view.slot_mapping, b.replay.view.slot_mapping)]
    pairs += [(a.view.derived[k], b.view.derived[k]) for k in a.view.derived]
    pairs += [(a.replay.view.derived[k], b.replay.view.derived[k]) for k in a.replay.view.derived]
    return all(torch.equal(x, y) for x, y in pairs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=400)
    ap.add_argument("--baseline", metavar="REV", help="a git revision whose build to time in turns with this one")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # the step's metadata is small: one thread, as a busy server's host
    cfg = preset("mini-2k")
    layout = CacheLayout(16386, 16)
    tokens = PromptTokens(cfg.vocab_size, layout.max_model_len)
    versions = {"this": current}
    if args.baseline:
        versions = {"baseline": load_baseline(args.baseline), **versions}
    for name, qlens in SHAPES.items():
        reqs = [current.RequestChunk(f"r{i}", q, q) for i, q in enumerate(qlens)]
        toks = [tokens(r.req_id, 0, r.seq_len) for r in reqs]
        times: dict = {k: [] for k in versions}
        built = {}
        for _ in range(args.runs):
            for key, mod in versions.items():  # in turns: a slow phase of the host hits both
                rq = [mod.RequestChunk(r.req_id, r.query_len, r.seq_len) for r in reqs]
                t0 = time.perf_counter()
                built[key] = mod.build_step_batch(rq, toks, list(range(len(rq))), layout, cfg.window, "cpu")
                times[key].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
        line = f"{name}: " + ", ".join(f"{k} {v:.0f} us" for k, v in med.items())
        if args.baseline:
            line += f", {med['baseline'] / med['this']:.2f}x; same metadata: {same(built['baseline'], built['this'])}"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
