"""Compiled step vs the eager oracle: the engine of ``replay-backend verify``."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from ..backend import ReplayBackend
from ..requests import RequestChunk
from .compare import default_tolerance, max_abs_err, max_abs_err_kv
from ..config import ReplayConfig
from ..kv_cache import CacheLayout
from .dsv41_mini import DSv41Mini
from .runner import StepRunner


@dataclass
class VerifyResult:
    ok: bool
    num_tokens: int
    padded_tokens: int
    step_kind: str
    trimmed: bool
    replay_rows: int
    replay_padded: int | None
    replay_graph: bool
    max_abs_err_logits: float
    max_abs_err_kv: float
    tolerance: float
    io_graphs: bool = False  # the trim op's gathers and scatter ran as graphs too

    def as_dict(self) -> dict:
        return asdict(self)


def check_tolerance(tolerance, name: str = "tolerance") -> float | None:
    """``tolerance`` as a float: a finite number >= 0 (a max |d| is compared to it;
    nan or a negative one would report a mismatch at a difference of 0), or None."""
    if tolerance is None:
        return None
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not math.isfinite(tolerance) \
            or tolerance < 0:
        raise ValueError(f"{name} must be a finite number >= 0 (a bound on max |d|), got {tolerance!r}")
    return float(tolerance)


def runner_sizes(requests: list[RequestChunk], window: int, config: ReplayConfig) -> dict:
    """The sizes :func:`verify_step` builds its two runners with: one cache block per
    request, each long enough for the longest request (even, and two windows at least)."""
    max_len = max(r.seq_len for r in requests)
    max_len += max_len % 2
    return dict(max_num_seqs=len(requests), max_model_len=max(max_len, 2 * window),
                max_num_batched_tokens=config.max_num_batched_tokens)


def verify_step(model: DSv41Mini, requests: list[RequestChunk], config: ReplayConfig,
                capture: bool = False, tolerance: float | None = None) -> VerifyResult:
    """Run ``requests`` as one step through the compiled backend and the eager oracle,
    each after building the same cached context, and compare last-row logits and the
    SWA KV the replay layers wrote for kept rows.

    ``capture=True`` captures every graph size before the step (as a server would);
    otherwise the sizes the step needs are captured on first use.
    """
    tolerance = check_tolerance(tolerance)
    if not requests:
        raise ValueError("verify_step: no requests (a step needs at least one)")
    kw = runner_sizes(requests, model.cfg.window, config)
    CacheLayout(kw["max_model_len"], kw["max_num_seqs"])  # its sizes refused before a model runs
    backend = ReplayBackend(config)
    compiled = StepRunner(model, backend=backend, **kw)
    oracle = StepRunner(model, **kw)
    if capture:
        compiled.capture()
    for runner in (compiled, oracle):
        runner.prefill_context(requests, forward=model)
    got = compiled.step(requests)
    want = oracle.step(requests)
    tol = tolerance if tolerance is not None else default_tolerance(next(model.parameters()).dtype)
    err = max_abs_err(got.logits, want.logits)
    kv_err = max_abs_err_kv(compiled.kv, oracle.kv, got.batch)
    trim = got.trim
    step = got.step
    return VerifyResult(
        ok=bool(err <= tol and kv_err <= tol and torch.isfinite(got.logits).all()),
        num_tokens=got.batch.num_tokens,
        padded_tokens=step.padded_tokens if step.kind == "piecewise" else got.batch.num_tokens,
        step_kind=step.kind,
        trimmed=bool(trim and trim.trimmed),
        replay_rows=trim.rows if trim else got.batch.num_tokens,
        replay_padded=trim.padded if trim else None,
        replay_graph=bool(trim and trim.graph),
        io_graphs=bool(trim and trim.io_graphs),
        max_abs_err_logits=err,
        max_abs_err_kv=kv_err,
        tolerance=tol,
    )
