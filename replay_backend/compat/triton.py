"""Triton, where it is installed: the one adapter for Triton's private launcher parts.

The core's row-move kernels and a model's kernels import Triton from here, and run
their PyTorch reference where ``available()`` is false (CPU machines without it)."""
from __future__ import annotations

import inspect
import os
from typing import Callable

import torch

from ..fallbacks import Fallback, process_fallback
from . import graphs as compat_graphs


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
    build does not launch the way the direct call restates. Call it as
    ``launch(grid, stream, *args)`` with every argument of the kernel, constexprs
    included.

    ``build[grid](*args)`` asks torch for the current device and stream, builds a
    launch-metadata dict and hands the launcher the two launch-hook chains, which it
    calls around the launch even when they are empty: host time on every launch. The
    direct call makes the same call of the compiled launcher with the stream, no
    metadata and no hooks. While a launch hook is registered (a profiler such as
    Proton) every launch goes through Triton's path, so the hook sees it.
    """
    launcher = getattr(build, "run", None)  # the compiled launcher (its handles are loaded)
    function, meta = getattr(build, "function", None), getattr(build, "packed_metadata", None)
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if launcher is None or function is None or meta is None or runtime is None:
        return None
    if not launch_layout_verified(type(build)):
        process_fallback(Fallback.TRITON_LAUNCH_LAYOUT, f"this Triton's compiled kernel does not launch as {_LAUNCH}; "
                         "kept kernels launch through Triton's entry")
        return None

    def launch(grid, stream, *args) -> None:
        enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
        if _hooked(enter) or _hooked(leave):
            build[grid](*args, stream=stream)
        else:
            launcher(grid[0], grid[1], grid[2], stream, function, meta, None, None, None, *args)
    return launch


# The call of the compiled launcher that the direct launch makes, as Triton's own
# ``CompiledKernel.__getitem__`` makes it (triton/compiler/compiler.py): the direct launch
# is used only where that method's source holds this call, so a Triton that reorders
# the launcher's arguments falls back to its own entry instead of being misread.
_LAUNCH = ("self.run(grid[0], grid[1], grid[2], stream, self.function, self.packed_metadata, launch_metadata, "
           "knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *args)")


def launch_layout_verified(build_type: type) -> bool:
    """Whether ``build_type.__getitem__`` (Triton's compiled kernel) launches with the
    argument layout the direct launch restates."""
    try:
        source = inspect.getsource(build_type.__getitem__)
    except (AttributeError, OSError, TypeError):
        return False
    squeeze = lambda text: "".join(text.split())  # noqa: E731
    return squeeze(_LAUNCH) in squeeze(source)


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
        self._stream = compat_graphs.raw_stream_getter()

    def __call__(self, key: tuple, grid: tuple[int, int, int], device: torch.device, args: tuple,
                 constexprs: dict) -> None:
        kept = self._kept.get(key)
        if kept is not None:
            kept(grid, self._stream(device.index), *args, *constexprs.values())
            return
        build = self.kernel[grid](*args, **constexprs, **self.options)
        if hasattr(build, "__getitem__"):  # a compiled build (not the interpreter's None)
            self._kept[key] = kept_launch(build)
