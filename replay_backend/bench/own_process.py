"""One call in a process of its own: a profiler session slows every later CUDA launch of
its process (CudaTracing), so a mode timed after another's floors runs in a fresh one."""
from __future__ import annotations

import traceback
from typing import Any, Callable


class OwnProcessFailed(RuntimeError):
    """The call raised in its process (its traceback is the message) or the process
    ended without a result (out of memory, a signal)."""


def call(fn: Callable, *args) -> Any:
    """``fn(*args)`` in a spawned process: its result (picklable, as ``fn`` and ``args``
    are), or :class:`OwnProcessFailed`. The process shares this one's stdout and
    stderr, so what it prints reads in place."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")  # CUDA is not fork-safe
    recv, send = ctx.Pipe(duplex=False)
    # Not daemonic: its Inductor may start compile workers of its own.
    proc = ctx.Process(target=_run, args=(fn, args, send))
    proc.start()
    send.close()  # its end only: its result, or EOF when it dies without one
    try:
        ok, value = recv.recv()
    except EOFError:
        proc.join()
        raise OwnProcessFailed(f"{getattr(fn, '__name__', fn)}'s process ended (exit status {proc.exitcode}) "
                               "before its result") from None
    finally:
        recv.close()
    proc.join()
    if not ok:
        raise OwnProcessFailed(value)
    return value


def _run(fn: Callable, args: tuple, send) -> None:
    try:
        send.send((True, fn(*args)))
    except BaseException:  # noqa: BLE001 - the caller raises it, with this traceback
        send.send((False, traceback.format_exc()))
    send.close()
