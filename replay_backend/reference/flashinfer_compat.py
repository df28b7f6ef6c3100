"""FlashInfer's private parts that the FlashInfer attention relies on: the one adapter.

A plan's work list (which request and which row tile each thread block of the kernel
takes) is written on the host into a pinned staging buffer, then copied into the
wrapper's int workspace on the device by a copy queued on the stream.

Two facts about that memory matter here:

* A CUDA-graph plan that does not split its keys launches the graph's worst-case count
  of blocks, more than the list holds, and only a plan that splits tells the extra
  blocks to stop: without a split they read the list past its end, where no plan of
  this size writes, so they take whatever that memory held (a reused pinned block holds
  an earlier tensor's bytes) as a request index and read out of bounds. Cleared when
  the wrapper is made, that memory holds only zeros and the entries of the wrapper's
  earlier plans, each a (request, tile) of the graph's fixed request count: work that
  reads the request's own keys and writes only the rows it owns, which the block that
  the plan gives that tile writes with the same values.
* The queued copy reads the staging buffer when the GPU reaches it, so a plan must not
  write into a staging buffer whose previous copy is still queued. FlashInfer takes the
  staging buffer from the wrapper at each ``plan()``, so a caller may hand it one of
  several buffers in turn (:func:`stage_plans_in`) instead of waiting for the GPU.
"""
from __future__ import annotations

import torch

# FlashInfer 0.6.13's names (prefill.py) of the pinned staging buffer and the int
# workspace it is copied into.
_HOST, _DEVICE = "_pin_memory_int_workspace_buffer", "_int_workspace_buffer"


def plan_memory(wrapper) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``wrapper``'s staging buffer and int workspace, or None where this FlashInfer does
    not keep them as the adapter knows them (two byte tensors of one size, the first on
    the host)."""
    host, device = getattr(wrapper, _HOST, None), getattr(wrapper, _DEVICE, None)
    known = (isinstance(host, torch.Tensor) and isinstance(device, torch.Tensor)
             and host.dtype == device.dtype == torch.uint8 and host.numel() == device.numel()
             and host.device.type == "cpu")
    return (host, device) if known else None


def clear_plan_memory(wrapper) -> bool:
    """Zero ``wrapper``'s staging buffer and int workspace; False, touching nothing,
    where :func:`plan_memory` does not find them."""
    memory = plan_memory(wrapper)
    if memory is not None:
        for t in memory:
            t.zero_()
    return memory is not None


def staging_buffer(wrapper) -> torch.Tensor:
    """``wrapper``'s staging buffer, which the start-up probe found on a wrapper like it."""
    memory = plan_memory(wrapper)
    if memory is None:
        raise RuntimeError("a FlashInfer wrapper without the plan memory that the start-up probe's had")
    return memory[0]


def stage_plans_in(wrapper, host: torch.Tensor) -> None:
    """Make ``host`` (a byte tensor of :func:`staging_buffer`'s size) the staging buffer
    of ``wrapper``'s next plans."""
    own = staging_buffer(wrapper)
    if host.dtype != torch.uint8 or host.numel() != own.numel():
        raise ValueError(f"a staging buffer of {host.numel()} {host.dtype} for one of {own.numel()} bytes")
    setattr(wrapper, _HOST, host)


# ---- calling a planned wrapper's kernels without its run()'s checks ---------------------
# FlashInfer 0.6.13's wrapper keeps, once planned, the module of its kernels here, and its
# run() ends in ``module.paged_run(*args)``. run()'s own checks and argument assembly
# are host time on the critical path of every attention call (tens of microseconds, a
# step's worth of milliseconds at a host-bound step); the arguments of one plan's calls
# differ only in the call's tensors.
_MODULE = "_cached_module"


class DirectCalls:
    """A wrapper's calls, straight to its kernel module once learned.

    No argument layout is restated here: after each plan the first two calls go through
    the wrapper's own ``run()``, with the module's ``paged_run`` recorded, and the later
    calls of that plan pass the same arguments with the call's tensors (query, key and
    value caches, output, log-sum-exp) put where the two recordings had theirs. The two
    recordings must agree on everything else, each argument the same object or an equal
    plain value, else the plan keeps ``run()``, reported through ``fallback(detail)``;
    as is a wrapper without the module."""

    def __init__(self, wrapper, fallback) -> None:
        self.wrapper, self.fallback = wrapper, fallback
        self.planned()

    def planned(self) -> None:
        """A new plan: what was learned is of the plan before."""
        self.first = None  # the first call's (arguments, tensors)
        self.learned = None  # (module, arguments with the call's tensors left out, their places)

    def __call__(self, q, kv, out, lse) -> None:
        tensors = (q, kv[0], kv[1], out, lse)
        if self.learned is not None:
            module, args, places = self.learned
            args = args.copy()
            for i, role in places:
                args[i] = tensors[role]
            module.paged_run(*args)
            return
        module = getattr(self.wrapper, _MODULE, None)
        if not hasattr(module, "paged_run"):
            self.fallback(f"the wrapper ({type(self.wrapper).__name__}) keeps no kernel module with paged_run")
            self.wrapper.run(q, kv, out=out, lse=lse, return_lse=True)
            return
        recorder = _Recorder(module)
        setattr(self.wrapper, _MODULE, recorder)
        try:
            self.wrapper.run(q, kv, out=out, lse=lse, return_lse=True)
        finally:
            setattr(self.wrapper, _MODULE, module)
        if self.first is None:
            self.first = (recorder.args, tensors)
            return
        learned = _template(*self.first, recorder.args, tensors)
        self.first = None
        if isinstance(learned, str):
            self.fallback(learned)
            return
        self.learned = (module, *learned)


class _Recorder:
    """A kernel module whose ``paged_run`` keeps its arguments and runs the module's."""

    def __init__(self, module) -> None:
        self.module, self.args = module, None

    def paged_run(self, *args):
        self.args = list(args)
        return self.module.paged_run(*args)


_PLAIN = (bool, int, float, str, type(None))


def _template(a, ta, b, tb):
    """Two recorded calls' arguments ``a``, ``b`` and their calls' tensors ``ta``, ``tb``:
    ``(arguments with the call's tensors left out, [(place, which tensor)])``, or why
    the two do not agree."""
    if a is None or b is None or len(a) != len(b):
        return "run() did not call paged_run once with as many arguments each time"
    args, places = [], []
    for i, (x, y) in enumerate(zip(a, b)):
        rx = next((k for k, t in enumerate(ta) if x is t), None)
        ry = next((k for k, t in enumerate(tb) if y is t), None)
        if rx is not None or ry is not None:
            if rx != ry:
                return f"argument {i} is a different tensor of the call from one call to the next"
            places.append((i, rx))
            args.append(None)
        elif x is y or (type(x) is type(y) and isinstance(x, _PLAIN) and x == y):
            args.append(x)
        else:
            return f"argument {i} ({type(x).__name__}) changes from one call to the next of one plan"
    if not {0, 3, 4} <= {r for _, r in places}:
        return "paged_run's arguments do not hold the call's query, output and log-sum-exp"
    return args, places
