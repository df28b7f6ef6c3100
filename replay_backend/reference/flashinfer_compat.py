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

from dataclasses import dataclass

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
    plain value, else the plan keeps ``run()``, reported once through
    ``fallback(detail)``; as is, once, a wrapper without the module. A later call whose
    tensors differ in shape, dtype, device or aliasing from the recorded ones (the
    values ``run()`` derives from them, and checks) goes through ``run()``. A wrapper
    whose ``direct_calls`` is false (a checking wrapper, whose ``run()`` must see every
    call) always keeps ``run()``."""

    def __init__(self, wrapper, fallback) -> None:
        self.wrapper, self.fallback = wrapper, fallback
        self.enabled = getattr(wrapper, "direct_calls", True)
        self.planned()

    def planned(self) -> None:
        """A new plan (called before it is made: a plan that fails leaves nothing learned)."""
        self.first = None  # the plan's first recorded call: (arguments, shapes)
        self.learned = None  # (module, arguments, places of the call's tensors, shapes); False: keeps run()

    def __call__(self, q, kv, out, lse) -> None:
        tensors = (q, kv[0], kv[1], out, lse)
        learned = self.learned
        if learned:
            module, args, places, shapes = learned
            if _shapes(tensors) == shapes:
                args = args.copy()
                for i, role in places:
                    args[i] = tensors[role]
                module.paged_run(*args)
                return
        if learned is not None or not self.enabled:
            self._run(tensors)
            return
        module = getattr(self.wrapper, _MODULE, None)
        if not hasattr(module, "paged_run"):
            self.enabled = False
            self.fallback(f"the wrapper ({type(self.wrapper).__name__}) keeps no kernel module with paged_run")
            self._run(tensors)
            return
        recorder = _Recorder(module)
        setattr(self.wrapper, _MODULE, recorder)
        try:
            self._run(tensors)
        finally:
            setattr(self.wrapper, _MODULE, module)
        call = (_entries(recorder.args, tensors), _shapes(tensors))
        if self.first is None:
            self.first = call
            return
        (a, shapes), (b, _) = self.first, call
        self.first = None
        why = _disagreement(a, b) or (None if call[1] == shapes else "the call's tensors differ in shape")
        if why is not None:
            self.learned = False
            self.fallback(why)
            return
        places = [(i, e.tensor) for i, e in enumerate(a) if isinstance(e, _Role)]
        self.learned = (module, [None if isinstance(e, _Role) else e for e in a], places, shapes)

    def _run(self, tensors) -> None:
        q, k, v, out, lse = tensors
        self.wrapper.run(q, (k, v), out=out, lse=lse, return_lse=True)


class _Recorder:
    """A kernel module whose ``paged_run`` keeps its arguments and runs the module's."""

    def __init__(self, module) -> None:
        self.module, self.args = module, None

    def paged_run(self, *args):
        self.args = list(args)
        return self.module.paged_run(*args)


@dataclass(frozen=True)
class _Role:
    """A recorded argument that was one of the call's tensors (its index among them)."""

    tensor: int


def _entries(args, tensors) -> list | None:
    """A recorded argument list with the call's tensors replaced by their roles (the
    first, where the key and value caches are one tensor), so that it holds none of them."""
    if args is None:
        return None
    roles: dict[int, int] = {}
    for k, t in enumerate(tensors):
        roles.setdefault(id(t), k)  # the call's tensors are alive: no other object has their ids
    return [_Role(roles[id(a)]) if id(a) in roles else a for a in args]


def _shapes(tensors) -> tuple:
    return (*((t.shape, t.dtype, t.device) for t in tensors), tensors[1] is tensors[2])


_PLAIN = (bool, int, float, str, type(None))


def _disagreement(a, b) -> str | None:
    """Why two recorded calls of one plan (:func:`_entries`) do not agree, or None."""
    if a is None or b is None or len(a) != len(b):
        return "run() did not call paged_run once with as many arguments each time"
    for i, (x, y) in enumerate(zip(a, b)):
        if isinstance(x, _Role) or isinstance(y, _Role):
            if not (isinstance(x, _Role) and isinstance(y, _Role) and x.tensor == y.tensor):
                return f"argument {i} is a different tensor of the call from one call to the next"
        elif not (x is y or (type(x) is type(y) and isinstance(x, _PLAIN) and x == y)):
            return f"argument {i} ({type(x).__name__}) changes from one call to the next of one plan"
    if not {0, 3, 4} <= {x.tensor for x in a if isinstance(x, _Role)}:
        return "paged_run's arguments do not hold the call's query, output and log-sum-exp"
    return None
