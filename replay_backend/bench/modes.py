"""How the benchmarks build each mode's runner: this backend's modes from one shared
Dynamo trace, the stock ``reduce-overhead`` peer on its own, and the model they run."""
from __future__ import annotations

import copy
import gc
import sys
import time
import traceback

import torch

from ..backend import ReplayBackend
from ..compat import dynamo as compat_dynamo
from ..compat import inductor as compat_inductor
from ..config import ReplayConfig
from ..reference import build_model
from ..reference.cli_options import model_config, parse_options
from ..reference.parallel import shard
from ..reference.runner import StepRunner
from .report import UNGRAPHED
from .timing import ModeRun
from .watch import sync

MODE_OPTIONS = {
    "off": {"cudagraph_mode": "none", "decoder_replay": False},
    "parent": {"cudagraph_mode": "none", "cudagraph_decoder_replay": False},
    "piecewise": {"cudagraph_decoder_replay": False},
    "replay": {},
}
WIDE_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


def mode_failed(mode: str, e: BaseException) -> str:
    """What a mode's report entry says of its failure, its whole traceback printed to
    stderr first: a compile failure inside torch is unreadable from one line."""
    print(f"{mode}: failed; its traceback:", file=sys.stderr, flush=True)
    traceback.print_exception(e, file=sys.stderr)
    return f"{type(e).__name__}: {e}"[:500]


class SharedTrace:
    """One Dynamo trace for every backend mode: the trace (the slow part of compiling a
    40-layer model) hands its graph to each mode's backend, and calls run the model of
    the mode selected now. Only the bench needs this; a server runs one mode."""

    def __init__(self, backends: dict[str, ReplayBackend]) -> None:
        self.backends = backends
        self.current: str | None = None
        self.build_s: dict[str, float] = {}

    def __call__(self, gm, example_inputs):
        for key, be in self.backends.items():
            t0 = time.perf_counter()
            be(copy.deepcopy(gm), example_inputs)
            self.build_s[key] = time.perf_counter() - t0
        return self.step

    def step(self, *args):
        return self.backends[self.current].model(*args)


def model_config_of(args):
    """The model config of the bench's ``--preset`` and ``--model-option``s."""
    return model_config(args.preset, getattr(args, "model_option", None))


# What each mode and the wide setting decide; --option may not set these.
_MODE_KEYS = {k for opts in MODE_OPTIONS.values() for k in opts} | {
    "max_num_batched_tokens", "max_cudagraph_capture_size", "cudagraph_capture_sizes"}


def backend_config(mode: str, setting: str, args) -> ReplayConfig:
    """The backend options of this backend's ``mode`` at capture ``setting`` (default or
    wide), over the bench's ``--option``s."""
    opts = parse_options(getattr(args, "option", None))
    clash = sorted(set(opts) & _MODE_KEYS)
    if clash:
        raise ValueError(f"--option {clash[0]}: set by the bench's modes and capture settings, not an option")
    opts.update(MODE_OPTIONS[mode], max_num_batched_tokens=args.max_num_batched_tokens)
    if setting == "wide" and opts.get("cudagraph_mode") != "none":
        opts.update(max_cudagraph_capture_size=args.max_num_batched_tokens,
                    cudagraph_capture_sizes=[s for s in WIDE_SIZES if s <= args.max_num_batched_tokens])
    return ReplayConfig.from_options(opts)


def plan_modes(args) -> list[tuple[str, str]]:
    """(mode, setting) in the order given, the stock peer last. Modes without graphs of
    this backend run once, at the default setting, whichever settings were asked for."""
    order = []
    for mode in args.modes:
        for setting in ["default"] if mode in UNGRAPHED else args.settings:
            order.append((mode, setting))
    # The stock peer last: it resets Dynamo, which drops the shared trace.
    return sorted(order, key=lambda ms: ms[0] == "reduce-overhead")


def release_memory() -> None:
    """Give back what modes no longer held left: Python's cycles, the CUDA cache."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def build_shared_mode(key: str, model, kw: dict, shared: SharedTrace, shared_fwd) -> tuple[StepRunner, float]:
    """A runner for this backend's mode ``key``, its model built: the shared forward's
    first call traces once and builds every mode. Returns it and the seconds of its
    first step (the trace and builds, when it was the first)."""
    shared.current = key
    runner = StepRunner(model, forward=shared_fwd, backend=shared.backends[key], **kw)
    t0 = time.perf_counter()
    runner.run(runner.dummy_batch(model.cfg.window), use_graphs=False)
    sync()
    return runner, time.perf_counter() - t0


def stock_peer(model, kw: dict) -> tuple[StepRunner, float]:
    """A runner of the stock ``torch.compile(mode="reduce-overhead")`` peer (CUDA graph
    trees), its first trace dynamic in the token count like ours, and the seconds of its
    first step (trace, compile).
    It resets Dynamo first: this backend's modes are done before it."""
    torch._dynamo.reset()
    peer = torch.compile(model, options=compat_inductor.reduce_overhead_options())
    traced = False

    def forward(ids, pos):
        nonlocal traced
        # The token count marked dynamic for the first trace only, as a user would: later
        # calls are Dynamo's own, so a one-token step recompiles as stock torch does (a
        # graph of exactly one token) instead of tracing a symbol of size one.
        if not traced:
            traced = True
            compat_dynamo.mark_tokens_dynamic(ids, pos)
        return peer(ids, pos)

    runner = StepRunner(model, forward=forward, **kw)
    t0 = time.perf_counter()
    runner.run(runner.dummy_batch(model.cfg.window))
    sync()
    return runner, time.perf_counter() - t0


def prepare_mode(run: ModeRun, model, kw: dict, shared: SharedTrace, shared_fwd, device: str):
    """A runner for ``run``'s mode, compiled and captured. Returns it and, for the first
    of this backend's modes, the seconds of the shared Dynamo trace (else None)."""
    key = f"{run.mode}/{run.setting}"
    if run.mode == "eager":
        return StepRunner(model, **kw), None
    if run.mode == "reduce-overhead":
        runner, run.compile_s = stock_peer(model, kw)
        return runner, None
    first = not shared.build_s
    runner, secs = build_shared_mode(key, model, kw, shared, shared_fwd)
    traced = secs - sum(shared.build_s.values()) if first else None
    run.compile_s = shared.build_s[key]
    be = runner.backend
    if not be.config.graphs_enabled:
        runner.start_serving()  # nothing to capture: served steps as in the graphed modes
        return runner, traced
    if device == "cuda":
        run.memory_estimate_gib = runner.estimate_graph_memory().total_gib
    run.capture = runner.capture()
    run.split_warmup_s = runner.split_warmup_s
    for level, c in run.capture.items():
        print(f"{key}: captured {level} graphs: {c['graphs']} graphs over {c['sizes']} sizes, "
              f"{c['seconds']:.1f} s, {c['gib']:.2f} GiB", flush=True)
    return runner, traced


def bench_model(args, ranks=None):
    """The benchmark model: bf16 on CUDA, float32 on the CPU, this rank's share of it
    over several ranks; returns it and its device."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_model(model_config_of(args), device, torch.bfloat16 if device == "cuda" else torch.float32)
    if ranks is not None:  # every rank builds the same model (same seed), then keeps its share
        shard(model, ranks.parallel)
    return model, device
