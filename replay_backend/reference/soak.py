"""A serving soak: one compiled, serving runner against the eager oracle, step by step.

Random mixed traffic (decodes, speculative decodes, first prefills, chunks after
cached context, keep-all prefills, prefills with a later floor) drives a runner as a
server would: requests arrive, are prefilled in chunks, decode, finish and give their
cache block back. Every step runs on the compiled runner and on the oracle (the eager
model, replay layers on every row), and every cache slot the step wrote is compared:
each layer's SWA KV (the replay layers' for kept rows only, the ones a later step
reads), each source's global entries and raw halves, and each request's last-row
logits. Then the compiled runner's written slots take the oracle's values, so every
step starts from the same context and a mismatch is reported for the step that made it.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from ..requests import RequestChunk
from .step_compare import compare_layers, first_over, per_part, written_slots
from .traffic import Traffic
from .accuracy import noise_limit, nudged_copy
from .config import IMPLEMENTATION_FIELDS
from .compare import default_tolerance, max_abs_err, worst_row_rel_l2
from ..counters import counters
from .runner import StepOutput, StepRunner


def step_kind(out: StepOutput) -> str:
    """The path a step took: main graphs or eager, trimmed or not, the replay region in
    a replay graph or eagerly, the trim op's gathers and scatter in graphs or not."""
    t = out.trim
    parts = [out.step.kind if out.step is not None else "eager", "trimmed" if t and t.trimmed else "untrimmed",
             "replay-graph" if t and t.graph else "replay-eager"]
    if t and t.io_graphs:
        parts.append("io-graphs")
    return "/".join(parts)


def spec_of(chunks: list[RequestChunk]) -> str:
    """The step in ``verify --batch`` form (``kv_start`` shown as ``@floor``)."""
    def one(c):
        kind = "k" if c.keep_all else ("d" if c.context_len and c.query_len <= 4 else "p")
        return f"{kind}:{c.query_len}/{c.seq_len}" + (f"@{c.kv_start}" if c.kv_start is not None else "")
    return ",".join(one(c) for c in chunks)


@dataclass
class Mismatch:
    step: int
    spec: str
    kind: str
    what: str
    err: float
    # The lowest layer whose cache rows of this part are beyond the limit: where the
    # step first went wrong, since every later layer reads that layer's output (None:
    # the logits).
    layer: int | None = None

    def render(self) -> str:
        where = "" if self.layer is None else f" (first at layer {self.layer})"
        return f"MISMATCH step {self.step} [{self.kind}] {self.spec}: {self.what} {self.err:.3g}{where}"


@dataclass
class SoakReport:
    seed: int
    steps: int
    dtype: str
    measure: str  # "max |d|" (fp32), or the largest relative L2 of one row (16-bit)
    limits: dict = field(default_factory=dict)  # per compared part
    kinds: Counter = field(default_factory=Counter)
    worst: dict = field(default_factory=dict)  # per compared part, the largest error seen
    # 16-bit: per part, the largest error of the noise runner (the model with its
    # embedding one rounding away) against the oracle: the rounding-noise envelope
    noise: dict = field(default_factory=dict)
    mismatches: list[Mismatch] = field(default_factory=list)
    counters_moved: dict = field(default_factory=dict)

    def render(self) -> str:
        lines = [f"soak: seed {self.seed}, {self.steps} steps, {self.dtype}, {self.measure}", "step kinds:"]
        lines += [f"  {n:5d}  {k}" for k, n in sorted(self.kinds.items())]
        lines.append("per part, largest error / limit: " + ", ".join(
            f"{k} {v:.3g} / {self.limits.get(k, float('nan')):.3g}" for k, v in sorted(self.worst.items())))
        if self.noise:
            lines.append("rounding-noise envelope per part: " + ", ".join(
                f"{k} {v:.3g}" for k, v in sorted(self.noise.items())))
        lines.append(f"counters moved while serving: {self.counters_moved or 'none'}")
        lines += [m.render() for m in self.mismatches]
        lines.append(f"{len(self.mismatches)} mismatches")
        return "\n".join(lines)


class Soak:
    """Runs the traffic through ``runner`` (compiled, captured, serving) and ``oracle``.

    fp32 models compare max |d| with ``default_tolerance``. A 16-bit model's rounding
    noise depends on the step, so a 16-bit soak also runs every step through ``noise``,
    the oracle's model with its embedding one rounding away, and measures each part by
    its worst row (relative L2, so one wrong row is not averaged away). A step fails
    when the compiled runner lies farther from the oracle than ``noise_limit`` of the
    largest noise the whole run showed for that part (1.5 times it)."""

    def __init__(self, runner: StepRunner, oracle: StepRunner, traffic: Traffic, seed: int,
                 noise: StepRunner | None = None) -> None:
        self.runner, self.oracle, self.traffic, self.noise = runner, oracle, traffic, noise
        dtype = runner.dtype
        self.exact = dtype in (torch.float32, torch.float64)
        if not self.exact and noise is None:
            raise ValueError(f"a {dtype} soak needs a noise runner (the model with its embedding one rounding away)")
        self.tolerance = default_tolerance(dtype) if self.exact else None
        self.report = SoakReport(seed, 0, str(dtype).replace("torch.", ""),
                                 "max |d|" if self.exact else "worst row's relative L2")
        # 16-bit: each step's errors by part and layer, judged once the envelope is known
        self._steps: list[tuple[int, str, str, dict]] = []
        # per part of a step: the compiled runner, the oracle, the noise runner (16-bit), the checks
        self.seconds: dict[str, float] = {}

    def _err(self, got: torch.Tensor, want: torch.Tensor) -> float:
        if got.numel() == 0:
            return 0.0
        if self.exact:
            return max_abs_err(got, want)
        return worst_row_rel_l2(got, want)

    def _compare(self, got: StepOutput, want: StepOutput, runner: StepRunner, chunks) -> dict[str, list]:
        return compare_layers(runner.kv, self.oracle.kv, chunks, got, want, self._err)

    @staticmethod
    def _beyond(i: int, spec: str, kind: str, errs: dict[str, list], limits: dict[str, float]) -> list[Mismatch]:
        found = ((part, first_over(layers, limits[part])) for part, layers in errs.items())
        return [Mismatch(i, spec, kind, part, over[1], over[0]) for part, over in found if over is not None]

    def _sync(self, runner: StepRunner, got: StepOutput, want: StepOutput, chunks) -> None:
        """Every slot the step wrote takes the oracle's value, trimmed rows included."""
        everything = zip(written_slots(runner.kv, chunks, got.batch, kept_only=False).values(),
                         written_slots(self.oracle.kv, chunks, want.batch, kept_only=False).values())
        for mine_part, theirs_part in everything:
            for (mine_t, slots, _), (theirs_t, _, _) in zip(mine_part, theirs_part):
                mine_t.index_copy_(0, slots, theirs_t.index_select(0, slots))

    def run(self, steps: int, log=None, every: int = 50, max_seconds: float | None = None) -> SoakReport:
        """``steps`` steps, or fewer where ``max_seconds`` run out first; ``log`` (e.g.
        ``print``) hears of progress every ``every`` steps and of every fp32 mismatch
        when it happens (16-bit ones once the run's noise envelope is known), so a run
        stopped from outside has told what it saw."""
        before = counters.state()
        t0 = time.perf_counter()
        rep = self.report
        for i in range(steps):
            if max_seconds is not None and time.perf_counter() - t0 > max_seconds:
                break
            seen = len(rep.mismatches)
            self.one(i)
            if log is not None:
                for m in rep.mismatches[seen:]:
                    log(m.render())
                if (i + 1) % every == 0:
                    log(self._progress(i + 1, time.perf_counter() - t0))
        if not self.exact:
            rep.limits, judged = self._judged()
            rep.mismatches += judged
        rep.counters_moved = {k: v for k, v in counters.moved_since(before).items()
                              if k in ("fallbacks", "recompiles", "captures", "graphs_seen", "compilations")}
        return rep

    def _judged(self) -> tuple[dict, list[Mismatch]]:
        """16-bit: the limits from the envelope the run has shown so far, and the steps
        beyond them."""
        limits = {part: noise_limit(env) for part, env in self.report.noise.items()}
        return limits, [m for step in self._steps for m in self._beyond(*step, limits)]

    def _progress(self, done: int, seconds: float) -> str:
        rep, spent = self.report, self.seconds
        if self.exact:
            verdict = f"{len(rep.mismatches)} mismatches"
        else:  # judged against the envelope so far: the run's last line is the verdict
            verdict = (f"{len(self._judged()[1])} steps beyond the noise envelope so far "
                       f"({max(rep.noise.values()):.3g})")
        where = ", ".join(f"{k} {v / done * 1e3:.0f} ms" for k, v in spent.items())
        return (f"step {done}: {seconds:.0f} s, {verdict}, largest error {max(rep.worst.values()):.3g}; "
                f"per step: {where}")

    def one(self, i: int) -> None:
        clock = time.perf_counter
        t0 = clock()
        chunks = self.traffic.step()
        got = self.runner.step(chunks)
        t1 = clock()
        want = self.oracle.step(chunks)
        t2 = clock()
        parts = {"compiled": t1 - t0, "oracle": t2 - t1}
        kind = step_kind(got)
        rep = self.report
        rep.steps += 1
        rep.kinds[kind] += 1
        errs = self._compare(got, want, self.runner, chunks)
        for part, err in per_part(errs).items():
            rep.worst[part] = max(rep.worst.get(part, 0.0), err)
        if self.exact:
            rep.limits = dict.fromkeys(errs, self.tolerance)
            rep.mismatches += self._beyond(i, spec_of(chunks), kind, errs, rep.limits)
        else:
            n0 = clock()
            ref = self.noise.step(chunks)
            parts["noise"] = clock() - n0
            for part, err in per_part(self._compare(ref, want, self.noise, chunks)).items():
                rep.noise[part] = max(rep.noise.get(part, 0.0), err)
            self._steps.append((i, spec_of(chunks), kind, errs))
            self._sync(self.noise, ref, want, chunks)
        self._sync(self.runner, got, want, chunks)
        for req_id in self.traffic.advance(chunks):
            for runner in (self.runner, self.oracle, self.noise):
                if runner is not None:
                    runner.free(req_id)
        # Where a soak's time goes, host wall time (a runner's step waits for its results);
        # the checks are the comparisons and cache syncs alone.
        parts["checks"] = clock() - t2 - parts.get("noise", 0.0)
        for part, seconds in parts.items():
            self.seconds[part] = self.seconds.get(part, 0.0) + seconds


def soak(model, steps: int, seed: int, *, max_num_seqs: int = 16, max_model_len: int = 8192,
         max_num_batched_tokens: int = 4096, options: dict | None = None, log=None,
         max_seconds: float | None = None, oracle_model=None) -> SoakReport:
    """Capture a serving runner for ``model`` (a ReplayBackend with ``options``) and
    soak it against the oracle for ``steps`` steps of traffic drawn from ``seed``. The
    oracle is ``model`` run eagerly, or ``oracle_model`` (the same weights in another
    implementation, e.g. PyTorch's attention under a FlashInfer model) where given."""
    from ..backend import ReplayBackend

    oracle_model = model if oracle_model is None else oracle_model
    mine, theirs = next(model.parameters()), next(oracle_model.parameters())
    if (theirs.dtype, theirs.device) != (mine.dtype, mine.device):
        raise ValueError(f"the oracle model is {theirs.dtype} on {theirs.device}, the served model {mine.dtype} "
                         f"on {mine.device}: a soak compares one dtype on one device")
    other = model.cfg.differs_beyond_implementation(oracle_model.cfg)
    if other:
        raise ValueError(f"the oracle model differs from the served model in {', '.join(other)}: a soak compares "
                         f"implementations of one model, which may differ only in {', '.join(IMPLEMENTATION_FIELDS)}")
    opts = {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens, **(options or {})}
    backend = ReplayBackend(**opts)
    kw = dict(max_num_seqs=max_num_seqs, max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens)
    runner = StepRunner(model, backend=backend, **kw)
    t0 = time.perf_counter()
    runner.capture()
    if log is not None:
        log(f"compiled and captured in {time.perf_counter() - t0:.0f} s")
    cfg = backend.config
    traffic = Traffic(seed, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                      max_num_batched_tokens=max_num_batched_tokens, window=model.cfg.window,
                      trim_threshold=cfg.decoder_replay_trim_threshold,
                      max_capture_size=max(cfg.capture_sizes() or [0]))
    dtype = next(model.parameters()).dtype
    noise = None
    if dtype not in (torch.float32, torch.float64):
        noise = StepRunner(nudged_copy(oracle_model, seed), **kw)  # the oracle one rounding away
    return Soak(runner, StepRunner(oracle_model, **kw), traffic, seed, noise).run(steps, log,
                                                                                max_seconds=max_seconds)
