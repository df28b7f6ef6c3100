"""FULL graphs: a whole step at one padded size in one graph, attention included.

A FULL step runs no host code of the model: the graph replays the kernels of the step
it was captured on, attention's among them. What it reads must therefore sit where it
sat at capture, with the same shapes: the token inputs in the compiled model's buffers,
and the step's metadata in the fixed graph layout of the backend's metadata buffer
(``StepBatch.graph``). :class:`FullGraph` records those addresses and checks the
metadata's on every replay, the arguments' on the first (every replay with
``debug_check_addresses``).

Without CUDA a FULL graph is emulated as faithfully as the pieces are
(capture/graphs.py): a replay re-runs the captured step's work *under the captured
step's forward context*, on the captured tensors, and copies into the captured
outputs. Device metadata is read where the new step wrote it; every host value (a
request count, a sequence length, a plan) is the captured step's. An attention op that
reads a host value inside a FULL graph so computes the captured step's answer on the
CPU exactly as its kernels would on a GPU, and the tests against the oracle see it.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Callable

import torch

from ..counters import counters
from ..fallbacks import Fallback
from ..forward_context import set_forward_context
from .graphs import STABLE_INPUTS, GraphResources, addresses, capture_into, collection_paused, copy_outputs


def watched(view) -> list[tuple[str, torch.Tensor]]:
    """The device metadata a FULL graph reads from a step's graph view, named."""
    g = view.graph
    return [("slot_mapping", g.slot_mapping), *sorted(g.derived.items())]


class FullGraph:
    """One whole step at ``size`` padded tokens, captured (or emulated). ``args``: the
    step's arguments (token buffers, weights, fixed scalars), whose addresses the graph
    recorded as well."""

    def __init__(self, size: int, run: Callable[[], tuple], ctx, reads: list[tuple[str, torch.Tensor]],
                 args: list, res: GraphResources) -> None:
        self.size, self.res = size, res
        self.where = [(name, t.data_ptr(), tuple(t.shape)) for name, t in reads]
        self.arg_ptrs = addresses(args)
        self.replays = 0
        if res.use_cuda:
            self.graph = torch.cuda.CUDAGraph()
            run()  # Triton builds and first kernel loads outside the capture
            self.outputs = capture_into(self.graph, res, run)
            self.graph.replay()  # capturing records the step without running it
        else:
            self.graph = None
            # As the context is at capture: the step goes on to point it elsewhere. A
            # replay runs no host code, so none of the model's host planning either:
            # the step plans before the graph replays (compiled.py).
            self.run, self.ctx = run, copy.copy(ctx)
            self.ctx.prepare_view = None
            with collection_paused():
                self.outputs = run()

    def check(self, reads: list[tuple[str, torch.Tensor]]) -> None:
        for (name, ptr, shape), (_, t) in zip(self.where, reads):
            if t.data_ptr() != ptr or tuple(t.shape) != shape:
                raise RuntimeError(
                    f"FULL graph [{self.size}]: the step's {name} is at {t.data_ptr():#x} {tuple(t.shape)}, the graph "
                    f"reads {ptr:#x} {shape}: it would read another step's metadata. A FULL step's batch must be "
                    "built by the backend (build_batch), into its metadata buffer's graph layout.")

    def check_args(self, args: list) -> None:
        for i, (got, want) in enumerate(zip(addresses(args), self.arg_ptrs)):
            if got != want:
                raise RuntimeError(f"FULL graph [{self.size}]: argument {i} of the step changed since capture "
                                   f"({want!r} -> {got!r}): the graph would read stale memory. {STABLE_INPUTS} "
                                   "(design.md, Graph invariants).")

    def replay(self, reads: list[tuple[str, torch.Tensor]], args: list) -> tuple:
        # The metadata's few addresses on every replay: a batch laid out elsewhere would
        # be read as another step's. The arguments, many, as the pieces' are checked.
        self.check(reads)
        if self.replays == 0 or self.res.check_every_replay:
            self.check_args(args)
        self.replays += 1
        if self.graph is not None:
            self.graph.replay()
        else:
            with set_forward_context(self.ctx):
                copy_outputs(self.outputs, self.run())
        return self.outputs


class FullGraphs:
    """A compiled model's FULL graphs, one per padded size, captured while the backend
    may capture (``capture()``) and replayed from then on."""

    def __init__(self, res: GraphResources) -> None:
        self.res = res
        self.graphs: dict[int, FullGraph] = {}

    def run(self, size: int, run: Callable[[], tuple], ctx, args: list, fallback: Callable[[], tuple]) -> tuple:
        """The step at ``size`` with arguments ``args``: its graph's replay, captured now
        where the backend may capture; without one, ``fallback()`` (the same step in
        pieces), counted."""
        if self.res.lifecycle.measuring:  # the graph's work without the graph: its memory (capture/memory.py)
            return run()
        reads = watched(ctx.active)
        graph = self.graphs.get(size)
        if graph is not None:
            return graph.replay(reads, args)
        if not self.res.lifecycle.may_capture:
            self.res.fallback(Fallback.UNCAPTURED_SIZE, f"FULL graph for size {size} was not captured before "
                              "serving; running the step in pieces")
            return fallback()
        graph = self.graphs[size] = FullGraph(size, run, ctx, reads, args, self.res)
        counters.captures["full"] += 1
        return graph.outputs


def full_capture_step(model, setup, metadata, policy) -> Callable[[int], None] | None:
    """``run(n)``: capture's dummy step at FULL size ``n`` of ``model`` (a
    CompiledReplayModel), a batch ``policy`` takes, laid out for FULL graphs in
    ``metadata``; None without FULL graphs. Sizes that no such batch pads to leave the
    policy."""
    from ..dispatch.decide import StepKind
    from ..dispatch.direct import run_dummy

    if policy is None:
        return None
    shapes = policy.dummy_shapes(setup.layout.num_blocks, setup.layout.max_model_len)
    if not shapes:
        limit = setup.layout.max_model_len
        why = (f"a decode of more tokens than the cache's max_model_len={limit} fits no sequence"
               if policy.uniform_len > limit else
               "the sizes stop below the trim threshold and at max_num_seqs such decodes")
        model.res.fallback(Fallback.CUDAGRAPH_MODE, f"no FULL size {list(policy.sizes)} holds a batch of uniform "
                           f"decodes of {policy.uniform_len} tokens, so no step runs as a FULL graph ({why})")
        model.use_full_policy(None)
        return None
    policy = dataclasses.replace(policy, sizes=tuple(shapes), rows=max(shapes))
    model.use_full_policy(policy)

    def run(n: int) -> None:
        tokens, per_request = shapes[n]
        run_dummy(model, setup, tokens, graph_rows=policy.rows, metadata=metadata, per_request=per_request)
        ran = model.last_plan
        if (ran.kind, ran.padded_tokens) != (StepKind.FULL, n):  # the policy and its dummy disagree
            raise RuntimeError(f"dsv41_replay: capture's dummy step for FULL size {n} ran as {ran.kind.value} at "
                               f"{ran.padded_tokens}")
    return run
