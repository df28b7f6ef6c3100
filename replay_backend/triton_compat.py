"""Triton, where it is installed: the one adapter for Triton's private launcher parts.

The core's row-move kernels and a model's kernels import Triton from here, and run
their PyTorch reference where ``available()`` is false (CPU machines without it)."""
from __future__ import annotations

import os
from typing import Callable

import torch

from . import torch_compat

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - CPU machines without triton
    triton = tl = libdevice = None


# Triton's interpreter (``TRITON_INTERPRET=1``, set before Triton is imported) runs the
# kernels on CPU tensors: the CPU tests use it.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def available() -> bool:
    return triton is not None


def aligned(*tensors: torch.Tensor) -> tuple[bool, ...]:
    """Whether each tensor starts 16-byte aligned: Triton specialises a pointer argument
    on it, so a :class:`KeptKernel` key holds it for every pointer it does not exempt."""
    return tuple(t.data_ptr() % 16 == 0 for t in tensors)


def direct_launcher(build) -> Callable | None:
    """A launch of ``build`` (a kernel's compiled build, as ``kernel[grid](...)``
    returns it) without Triton's per-call Python layers, or None where this Triton's
    build lacks the parts it calls. Call it as ``launch(grid, stream, *args)`` with every
    argument of the kernel, constexprs included.

    ``build[grid](*args)`` asks torch for the current device and stream, builds a
    launch-metadata dict, and hands the launcher the two launch-hook chains, which it
    calls around the launch even when they are empty: host time on every launch. The
    direct call gives the stream and no hooks, to the launcher's C entry itself where
    :func:`_c_entry` allows. While a launch hook is registered (a profiler such as
    Proton) every launch goes through Triton's path, so the hook sees it.
    """
    launcher = getattr(build, "run", None)  # the compiled launcher (its handles are loaded)
    function, meta = getattr(build, "function", None), getattr(build, "packed_metadata", None)
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if launcher is None or function is None or meta is None or runtime is None:
        return None
    c_launch, flags = _c_entry(launcher) or (None, ())

    def launch(grid, stream, *args) -> None:
        enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
        if _hooked(enter) or _hooked(leave):
            build[grid](*args, stream=stream)
        elif c_launch is not None:
            c_launch(grid[0], grid[1], grid[2], stream, function, *flags, meta, None, None, None, *args)
        else:
            launcher(grid[0], grid[1], grid[2], stream, function, meta, None, None, None, *args)
    return launch


# Triton versions whose compiled launcher's C entry (``launcher.launch``) takes the grid,
# stream and function, then the cooperative-grid and PDL flags and the global and profile
# scratch buffers, then the build's packed metadata, the launch metadata and the two hook
# chains, then the kernel's arguments (triton/backends/nvidia/driver.py, ``make_launcher``).
C_LAUNCH_VERSIONS = ("3.6.",)


def _c_entry(launcher) -> tuple[Callable, tuple] | None:
    """The compiled launcher's C entry and the flags it takes before the metadata, where
    this Triton's layout is known and the build needs no scratch memory. The Python call
    around it (``CudaLauncher.__call__``) builds a closure and checks both scratch sizes
    on every launch, to allocate what such a build needs; without any, it only forwards."""
    if triton is None or not str(getattr(triton, "__version__", "")).startswith(C_LAUNCH_VERSIONS):
        return None
    c_launch = getattr(launcher, "launch", None)
    if not callable(c_launch) or getattr(launcher, "global_scratch_size", 1) \
            or getattr(launcher, "profile_scratch_size", 1):
        return None
    coop, pdl = getattr(launcher, "launch_cooperative_grid", None), getattr(launcher, "launch_pdl", None)
    if coop is None or pdl is None:
        return None
    return c_launch, (coop, pdl, None, None)


def _hooked(hook) -> bool:
    """A launch hook is set: ``None`` (older Triton) or an empty chain (newer) is not."""
    return hook is not None and bool(getattr(hook, "calls", True))


def kept_launch(build) -> Callable:
    """``launch(grid, stream, *args)`` of a kept build: direct where this Triton allows."""
    direct = direct_launcher(build)
    return direct if direct is not None else (lambda grid, stream, *args: build[grid](*args))


class KeptKernel:
    """A kernel whose build the caller's key fixes, launched directly after its first call.

    Triton's entry derives a kernel's build from all its arguments on every call (an
    integer is specialised when it is 1 or a multiple of 16, a pointer when it is
    16-byte aligned), then finds the device and stream and calls the launch hooks:
    tens of microseconds of host time per launch, for kernels whose work may take a
    few. The key must name everything that fixes the build: the constexprs, the
    tensors' dtypes, and for each pointer not declared ``do_not_specialize_on_alignment``
    whether it is 16-byte aligned. Every other integer argument must be declared
    ``do_not_specialize`` (and fit in 32 bits). Then the build kept by the key serves
    every later call with that key. Under Triton's interpreter every call takes
    Triton's entry (it returns no build). ``options``: compile options of every build
    (e.g. ``enable_fp_fusion=False``), given to Triton's entry only."""

    def __init__(self, kernel, **options) -> None:
        self.kernel, self.options = kernel, options
        self._kept: dict[tuple, Callable] = {}
        self._stream = torch_compat.raw_stream_getter()

    def __call__(self, key: tuple, grid: tuple[int, int, int], device: torch.device, args: tuple,
                 constexprs: dict) -> None:
        kept = self._kept.get(key)
        if kept is not None:
            kept(grid, self._stream(device.index), *args, *constexprs.values())
            return
        build = self.kernel[grid](*args, **constexprs, **self.options)
        if hasattr(build, "__getitem__"):  # a compiled build (not the interpreter's None)
            self._kept[key] = kept_launch(build)
