"""One call in a process of its own: a profiler session slows every later CUDA launch of
its process (CudaTracing), so a mode timed after another's floors runs in a fresh one."""
from __future__ import annotations

import copy
import sys
import traceback
from typing import Any, Callable

from ..compat import dynamo as compat_dynamo


class OwnProcessFailed(RuntimeError):
    """The call raised in its process (its traceback is the message) or the process
    ended without a result (out of memory, a signal)."""


def call(fn: Callable, *args) -> Any:
    """``fn(*args)`` in a spawned process: its result (picklable, as ``fn`` and ``args``
    are). A ValueError there (a usage error) is raised here as a ValueError with its
    message, anything else as :class:`OwnProcessFailed`. The process shares this one's
    stdout and stderr, and does not outlive this call: an interrupt here stops it."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")  # CUDA is not fork-safe
    recv, send = ctx.Pipe(duplex=False)
    # Not daemonic: its Inductor may start compile workers of its own.
    proc = ctx.Process(target=_run, args=(fn, args, send))
    sys.stdout.flush()
    sys.stderr.flush()
    proc.start()
    send.close()  # its end only: its result, or EOF when it dies without one
    got = False
    try:
        ok, value, user = recv.recv()
        got = True
    except EOFError:  # died without a word (out of memory, a signal)
        proc.join()
        raise OwnProcessFailed(f"{getattr(fn, '__name__', fn)}'s process ended (exit status {proc.exitcode}) "
                               "before its result") from None
    finally:
        recv.close()
        if not got and proc.is_alive():  # this call interrupted: the process goes with it
            proc.kill()
        proc.join()
    if user is not None:
        raise ValueError(user)
    if not ok:
        raise OwnProcessFailed(value)
    return value


def _run(fn: Callable, args: tuple, send) -> None:
    try:
        result = (True, fn(*args), None)
    except BaseException as e:  # noqa: BLE001 - the caller raises it, with this traceback
        err = compat_dynamo.user_error(e)
        result = (False, traceback.format_exc(), None if err is None else str(err))
    try:
        send.send(result)
    finally:
        send.close()


def one_mode(bench: Callable, args, mode: str, *rest) -> dict:
    """``bench(args', *rest)`` in a process of its own, ``args'`` a copy of ``args`` with
    ``mode`` its only mode: that mode's report entry (a dict), or ``{"error": ...}``
    where the process failed (its traceback printed here). A benchmark's other modes,
    measured already, keep their entries whatever happens there."""
    own = copy.copy(args)
    own.modes = [mode]
    try:
        (entry,) = call(bench, own, *rest)["results"]
    except (OwnProcessFailed, ValueError) as e:
        print(f"{mode}: failed in its own process:\n{e}", file=sys.stderr, flush=True)
        return {"error": (str(e).strip().splitlines() or [type(e).__name__])[-1][:500]}
    return entry
