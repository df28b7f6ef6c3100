"""Where a graphed prefill step's time goes on the host, per attention implementation.

Builds and captures one ``replay`` runner per implementation (mini-2k, the bench's wide
capture sizes up to --max-tokens) and times, in turns, one step of --isl x --conc
prompt tokens:

* ``full``: as the bench times it (build the batch, run it, the logits, synchronised);
* ``prebuilt``: the batch built untimed, then the step run and synchronised;
* ``preplanned``: FlashInfer's whole-batch plan made untimed too;
* ``build`` and ``plan``: those two on their own, host time;
* ``to_launch``: from the step's start to the compiled model's first call;
* ``ret`` / ``ret_pp``: when ``run()`` returns, before the synchronisation: a step
  whose host returns near its own end was host-bound throughout.

Then each implementation's kernel-time floor (bench/profile.py). Medians in ms. On a
CPU it runs as a dry run (fp32, eager pieces, no floor).

    python3 scripts/step_phases.py --attention triton,flashinfer --isl 1024 --conc 1
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from typing import Callable

import torch

from replay_backend import ReplayBackend, ReplayConfig
from replay_backend.batch import RequestChunk
from replay_backend.bench.profile import NoKernelsRecorded, kernel_floor_ms
from replay_backend.bench.modes import WIDE_SIZES
from replay_backend.bench.watch import host_probe
from replay_backend.bench.cuda_tracing import CudaTracing
from replay_backend.dispatch.direct import DirectEntry
from replay_backend.reference import build_model, preset
from replay_backend.reference.runner import StepRunner


WARMUP = 3  # rounds before the timed ones


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def add_samples(samples: dict, got: dict) -> None:
    """One round's timings (seconds) added to ``samples`` (ms per key)."""
    for key, s in got.items():
        samples.setdefault(key, []).append(s * 1e3)


def floor_ms(step_ms: Callable[[], float], tracing: CudaTracing, label: str) -> float | None:
    """The kernel-time floor of the step ``step_ms`` runs (returning its ms); None on a
    CPU, or where the profiler recorded no kernels (said, under ``label``)."""
    if not torch.cuda.is_available():
        return None
    try:
        return kernel_floor_ms(step_ms, tracing)
    except NoKernelsRecorded as e:
        print(f"{label}: no floor: {e}")
        return None


def floor_step(phases: "Phases", isl: int, conc: int) -> float:
    """One step of ``isl`` x ``conc`` as the bench times it, its ms: what a floor profiles.
    The floor is the kernel time of every step its callable runs, so exactly one."""
    phases.isl, phases.conc = isl, conc
    return phases.full("floor")["full"] * 1e3


def build_runner(impl: str, args) -> StepRunner:
    """A captured ``replay`` runner of ``args.preset`` with attention ``impl``, for steps of
    up to ``args.conc`` requests of ``args.isl`` tokens."""
    torch._dynamo.reset()  # each implementation traces its own model
    torch.manual_seed(0)
    cuda = torch.cuda.is_available()  # on a CPU: a dry run of the script, eager pieces
    model = build_model(preset(args.preset, attention_impl=impl), "cuda" if cuda else "cpu",
                        torch.bfloat16 if cuda else torch.float32)
    config = ReplayConfig.from_options(dict(
        max_num_batched_tokens=args.max_tokens, max_cudagraph_capture_size=args.max_tokens,
        cudagraph_capture_sizes=[s for s in WIDE_SIZES if s <= args.max_tokens],
        **({} if cuda else {"compiler": "eager"})))
    runner = StepRunner(model, backend=ReplayBackend(config), max_num_seqs=max(8, args.conc),
                        max_model_len=args.isl + 2, max_num_batched_tokens=args.max_tokens)
    runner.capture()
    return runner


class _FirstCall:
    """The compiled graph, noting on its owner the time of its first call of a step."""

    def __init__(self, phases: "Phases", model) -> None:
        self.phases, self.model, self.needs_context = phases, model, model.needs_context

    def __call__(self, *args):
        if self.phases.launch is None:
            self.phases.launch = time.perf_counter()
        return self.model(*args)


class Phases:
    """One runner's timed variants of the step."""

    def __init__(self, runner: StepRunner, isl: int, conc: int) -> None:
        self.runner, self.isl, self.conc = runner, isl, conc
        self.launch: float | None = None
        # The served steps' direct entry calls the compiled graph: that call is the step's
        # first launch, so the entry gets a graph that notes when it is first called.
        entry = runner.compiled._learned
        if not isinstance(entry, DirectEntry):
            raise RuntimeError(f"served steps go through Dynamo ({entry}): nothing to time the first launch by")
        runner.compiled._learned = dataclasses.replace(entry, model=_FirstCall(self, entry.model))

    def _ids(self, tag: str) -> list[str]:
        return [f"{tag}-{k}" for k in range(self.conc)]

    def _free(self, tag: str) -> None:
        for rid in self._ids(tag):
            self.runner.free(rid)

    def full(self, tag: str) -> dict:
        sync()
        self.launch = None
        t0 = time.perf_counter()
        self.runner.prefill({rid: self.isl for rid in self._ids(tag)})
        sync()
        t1 = time.perf_counter()
        self._free(tag)
        return {"full": t1 - t0, "to_launch": self.launch - t0}

    def prebuilt(self, tag: str, planned: bool) -> dict:
        r = self.runner
        batch = r.build_batch([RequestChunk(rid, self.isl, self.isl) for rid in self._ids(tag)])
        if planned:
            r.plan_batch(batch, r.backend.replays_in_region)
        sync()
        t0 = time.perf_counter()
        r.run(batch)
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        self._free(tag)
        return {"preplanned": t2 - t0, "ret_pp": t1 - t0} if planned else {"prebuilt": t2 - t0, "ret": t1 - t0}

    def host(self, tag: str) -> dict:
        r = self.runner
        sync()
        t0 = time.perf_counter()
        batch = r.build_batch([RequestChunk(rid, self.isl, self.isl) for rid in self._ids(tag)])
        t1 = time.perf_counter()
        out = {"build": t1 - t0}
        if r.attention is not None:
            r.plan_batch(batch, r.backend.replays_in_region)
            out["plan"] = time.perf_counter() - t1
        sync()
        self._free(tag)
        return out

    def all(self, k: str) -> dict:
        return {**self.full(f"f{k}"), **self.prebuilt(f"b{k}", False), **self.prebuilt(f"p{k}", True),
                **self.host(f"h{k}")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--attention", type=lambda s: s.split(","), default=["triton", "flashinfer"])
    p.add_argument("--preset", default="mini-2k")
    p.add_argument("--isl", type=int, default=1024)
    p.add_argument("--conc", type=int, default=1)
    p.add_argument("--runs", type=int, default=15)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--json", help="write every sample (ms) here")
    args = p.parse_args()
    phases = {impl: Phases(build_runner(impl, args), args.isl, args.conc) for impl in args.attention}
    samples: dict = {impl: {} for impl in phases}
    for k in range(args.runs + WARMUP):
        for impl, ph in phases.items():  # in turns: a slow phase of the host falls on each alike
            got = ph.all(str(k))
            if k >= WARMUP:
                add_samples(samples[impl], got)
    print(f"host at the end: {host_probe()}")
    point = f"{args.isl}/{args.conc}"
    for impl, ph in phases.items():
        med = {key: statistics.median(v) for key, v in samples[impl].items()}
        print(f"{impl} {point}: " + ", ".join(f"{key} {v:.3f}" for key, v in med.items()), flush=True)
    tracing = CudaTracing()
    for impl, ph in phases.items():
        floor = floor_ms(lambda ph=ph: floor_step(ph, args.isl, args.conc), tracing, impl)
        samples[impl]["floor"] = floor
        print(f"{impl} {point}: floor {floor if floor is None else round(floor, 3)}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(samples, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
