"""``replay-backend decode-bench``: time per decode step (TPOT) of each graph mode.

A decode point is ``conc`` requests with ``context`` tokens cached each, stepping one
token at a time: the median wall time of a step, each synchronised as a server's is
(its sampled token returns to the host before the next step), with the step's kernel
floor (its GPU kernel time, profiled). A mixed point is one step of ``mixed`` tokens
below the trim threshold: a new prompt's chunk beside decodes. The prefill points time
whole prompts (TTFT) under the same modes, so that one run shows what a mode costs
the steps it does not target.

Modes: this backend's ``piecewise`` and ``full_and_piecewise`` (built first, timed in
turns point by point, so a slow phase of the host falls on both alike, then their
floors and profiles: a profiler session slows the process's later launches,
CudaTracing), then torch's own ``reduce-overhead`` (CUDA graph trees), which resets
Dynamo and runs alone: on a GPU, after this backend's modes, in a process of its own.
"""
from __future__ import annotations

import functools
import statistics
import time
from dataclasses import asdict

import torch

from ..backend import ReplayBackend
from ..compiling.piece_cache import PieceCache
from ..config import ReplayConfig
from ..reference.compare import max_abs_err
from ..reference.runner import StepRunner
from ..requests import RequestChunk
from . import own_process
from .cuda_tracing import CudaTracing
from .decode_mode import DecodeRun, Mode
from .profile import NoKernelsRecorded, host_profile_to, kernel_floor_ms, profile_to
from .modes import bench_model, mode_failed, release_memory, stock_peer
from .watch import sync

OURS = {"piecewise": {"cudagraph_mode": "piecewise"},
        "full_and_piecewise": {"cudagraph_mode": "full_and_piecewise"}}
PEER = "reduce-overhead"
DECODE_MODES = (*OURS, PEER)


def _build(mode: str, model, kw: dict, args, cache: PieceCache) -> Mode:
    run = DecodeRun(mode)
    t0 = time.perf_counter()
    if mode == PEER:
        runner, _ = stock_peer(model, kw)
    else:
        opts = {**OURS[mode], "max_num_batched_tokens": args.max_num_batched_tokens, "max_num_seqs": kw["max_num_seqs"]}
        runner = StepRunner(model, backend=ReplayBackend(ReplayConfig.from_options(opts), piece_cache=cache), **kw)
        run.capture = runner.capture()
    sync()
    run.build_s = time.perf_counter() - t0
    print(f"{mode}: ready in {run.build_s:.1f} s; capture {run.capture}", flush=True)
    return Mode(run, runner)


def _decode_point(modes: list[Mode], context: int, conc: int, args) -> None:
    """Every mode's steps at one point, timed in turns, and the host profiles asked for
    (cProfile: no CUDA tracing)."""
    point = f"{context}/{conc}"
    live = {id(m): m.start(f"d{context}x{conc}", context, conc) for m in modes}
    first = None
    for m in modes:  # warm-up, and each mode's first step checked against the first mode's
        for w in range(args.warmup):
            *_, out = m.decode(live[id(m)])
            if w == 0:
                first = out.logits if first is None else first
                m.run.max_abs_err_vs_first[point] = max_abs_err(out.logits.float(), first.float())
                m.run.kinds[point] = out.result.kind.value if out.result is not None else "dynamo"
    times: dict[int, list[tuple[float, float, float]]] = {id(m): [] for m in modes}
    for _ in range(args.steps):
        for m in modes:
            times[id(m)].append(m.decode(live[id(m)])[:3])
    for m in modes:
        m.run.tpot_ms[point] = statistics.median(t[0] for t in times[id(m)])
        m.run.build_ms[point] = statistics.median(t[1] for t in times[id(m)])
        m.run.host_ms[point] = statistics.median(t[2] for t in times[id(m)])
        m.run.pipelined_ms[point] = m.pipelined(live[id(m)], args.steps)
    if args.host_profile_out and point in args.profile_points:
        for m in modes:
            host_profile_to(args.host_profile_out, f"{m.run.mode} decode {point}",
                            functools.partial(m.step_ms, live[id(m)]), args.steps)
    for m in modes:
        m.end(live[id(m)])
    print(f"decode {point}: " + ", ".join(f"{m.run.mode} {m.run.tpot_ms[point]:.2f} ms "
                                          f"(queued {m.run.pipelined_ms[point]:.2f}, "
                                          f"build {m.run.build_ms[point]:.2f}, "
                                          f"host {m.run.host_ms[point]:.2f}, {m.run.kinds.get(point)})"
                                          for m in modes), flush=True)


def _floor_point(modes: list[Mode], context: int, conc: int, args, tracing: CudaTracing) -> None:
    """Each mode's profile (where asked for) and kernel floor of one decode step at one
    point, its requests cached anew. A mode whose floor fails keeps its times: the
    failure is its ``floor_errors`` entry for the point."""
    point = f"{context}/{conc}"
    for m in modes:
        ids: list[str] = []
        try:
            ids = m.start(f"f{context}x{conc}", context, conc)
            step = functools.partial(m.step_ms, ids)
            step()  # the point's first step, as the timed steps' warm-up
            if args.profile_out and point in args.profile_points:
                profile_to(args.profile_out, f"{m.run.mode} decode {point}", step, args.trace_dir, tracing)
            if torch.cuda.is_available():
                m.run.floor_ms[point] = kernel_floor_ms(step, tracing)
        except NoKernelsRecorded as e:
            m.run.floor_errors[point] = str(e)
        except Exception as e:  # noqa: BLE001 - after every timed step, which the failure leaves standing
            m.run.floor_errors[point] = mode_failed(f"{m.run.mode} floor at {point}", e)
        finally:
            if ids:
                m.end(ids)
    if not torch.cuda.is_available() and not any(point in m.run.floor_errors for m in modes):
        return  # profiles only: no floor to tell
    print(f"floors {point}: " + ", ".join(
        f"{m.run.mode} " + (f"{m.run.floor_ms[point]:.2f} ms" if point in m.run.floor_ms
                            else f"none ({m.run.floor_errors.get(point, 'no CUDA')})") for m in modes), flush=True)


def _mixed_point(modes: list[Mode], tokens: int, args) -> None:
    """``tokens`` in one step: a new prompt's first chunk beside 8 decodes."""
    decodes = min(8, tokens // 2)
    for m in modes:
        ids = m.start("mix", 1024, decodes)
        samples = []
        for k in range(args.warmup + args.steps):
            reqs = [RequestChunk(rid, 1, m.seq[rid] + 1) for rid in ids]
            for rid in ids:
                m.seq[rid] += 1
            reqs.append(RequestChunk(f"mix-new{k}", tokens - decodes, tokens - decodes))
            sync()
            t0 = time.perf_counter()
            m.runner.step(reqs)
            sync()
            samples.append((time.perf_counter() - t0) * 1e3)
            m.runner.free(f"mix-new{k}")
        m.run.mixed_ms[str(tokens)] = statistics.median(samples[args.warmup:])
        m.end(ids)
    print(f"mixed {tokens}: " + ", ".join(f"{m.run.mode} {m.run.mixed_ms[str(tokens)]:.2f} ms" for m in modes),
          flush=True)


def _prefill_points(modes: list[Mode], args) -> None:
    for isl in args.prefill_isl:
        times: dict[int, list[float]] = {id(m): [] for m in modes}
        for k in range(args.warmup + args.runs):
            for m in modes:
                sync()
                t0 = time.perf_counter()
                m.runner.prefill({f"p{isl}-{k}": isl})
                sync()
                if k >= args.warmup:
                    times[id(m)].append((time.perf_counter() - t0) * 1e3)
                m.runner.free(f"p{isl}-{k}")
        for m in modes:
            m.run.ttft_ms[str(isl)] = statistics.median(times[id(m)])
        print(f"prefill {isl}: " + ", ".join(f"{m.run.mode} {m.run.ttft_ms[str(isl)]:.1f} ms" for m in modes),
              flush=True)


def points(args) -> list[tuple[int, int]]:
    """The decode points: every ``--context`` with every ``--conc``."""
    return [(context, conc) for context in args.context for conc in args.conc]


def _measure(modes: list[Mode], args) -> None:
    """Every point of every mode, timed: decode, mixed and prefill steps."""
    if not modes:  # none of this backend's modes asked for, or none built
        return
    for context, conc in points(args):
        _decode_point(modes, context, conc, args)
    for tokens in args.mixed:
        _mixed_point(modes, tokens, args)
    _prefill_points(modes, args)


def _floors(modes: list[Mode], args) -> None:
    """Every decode point's floors and profiles, after the process's last timed step: a
    profiler session slows the process's later launches (CudaTracing)."""
    if not modes:
        return
    tracing = CudaTracing()
    for context, conc in points(args):
        if torch.cuda.is_available() or (args.profile_out and f"{context}/{conc}" in args.profile_points):
            _floor_point(modes, context, conc, args, tracing)


def cache_size(args) -> tuple[int, int]:
    """The runners' ``max_model_len`` and ``max_num_seqs``: the longest context or prompt
    with the tokens every decode step of a point adds (even: blocks hold pairs), and the
    most requests of a point (nine at least: the mixed point's). A point's steps: warm-up,
    timed, queued and the host profile's; its floor's requests, cached anew, take three."""
    host_profiled = args.steps if args.host_profile_out else 0
    longest = max([*args.context, 1024, *args.prefill_isl]) + 2 * (args.warmup + args.steps + 2) + host_profiled + 2
    return longest + longest % 2, max(max(args.conc), 9)


def _peer_here(model, kw: dict, args, cache: PieceCache) -> DecodeRun:
    """The stock peer built, timed and floored in this process: its report entry."""
    run = DecodeRun(PEER)
    try:
        peer = _build(PEER, model, kw, args, cache)
        run = peer.run
        _measure([peer], args)
        _floors([peer], args)
    except Exception as e:  # noqa: BLE001 - the peer's own failure is its entry, with what it measured
        run.error = mode_failed(PEER, e)
    return run


def peer_apart(ours_floored: bool, device: str, peer_process: bool | None) -> bool:
    """Whether the stock peer runs in a process of its own: as ``peer_process`` says, by
    default where this backend's floors before it traced CUDA."""
    return (ours_floored and device == "cuda") if peer_process is None else peer_process


def run_decode_bench(args, peer_process: bool | None = None) -> dict:
    """Every mode of ``args.modes`` at every point; returns the report.
    ``peer_process``: the stock peer runs in a process of its own (bench/own_process.py),
    untouched by this backend's floors before it; by default where they traced CUDA."""
    model, device = bench_model(args)
    max_model_len, max_num_seqs = cache_size(args)
    kw = dict(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
              max_num_batched_tokens=args.max_num_batched_tokens)
    cache = PieceCache()
    runs: list[DecodeRun] = []
    ours = []
    for mode in [m for m in args.modes if m in OURS]:
        try:
            ours.append(_build(mode, model, kw, args, cache))
        except Exception as e:  # noqa: BLE001 - one mode's failure is its entry, the others go on
            runs.append(DecodeRun(mode, error=mode_failed(mode, e)))
    runs += [m.run for m in ours]
    _measure(ours, args)
    _floors(ours, args)
    apart = peer_apart(bool(ours), device, peer_process)
    ours.clear()
    if PEER in args.modes:
        torch._dynamo.reset()  # this backend's pieces and graphs go before the peer builds
        if apart:
            model = cache = None  # the process of its own builds its own
            release_memory()
            runs.append(DecodeRun(**{"mode": PEER, **own_process.one_mode(run_decode_bench, args, PEER, False)}))
        else:
            release_memory()
            runs.append(_peer_here(model, kw, args, cache))
    return {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
            "preset": args.preset, "steps": args.steps, "warmup": args.warmup, "runs": args.runs,
            "max_num_batched_tokens": args.max_num_batched_tokens, "results": [asdict(r) for r in runs]}
