"""The errors a rank raises when its group cannot run a step together, and whether
every rank already knows of a step's failure.

Both the rank checks (parallel.py) and the step's agreement (dispatch/agree.py) raise
these, so they live apart from either.
"""
from __future__ import annotations

from .compat import dynamo as compat_dynamo


class RankFailed(RuntimeError):
    """Another data-parallel rank failed this step before the ranks agreed on it."""


class RanksApart(RuntimeError):
    """The data-parallel ranks met in different places: one captures, another serves."""


# Set on an error once every rank knows of its step's failure (this rank joined the
# agreement as failed, or the error is the RankFailed the agreement raised): a caller
# that reports it again (a build_batch refusal or a RankFailed caught by a server's own
# fail_step) must not join the next step's agreement with it.
_TOLD = "_dsv41_replay_step_failed"


def told(error: BaseException) -> bool:
    """Whether every rank already knows of the step failure ``error`` reports, itself or
    an error it wraps (a refusal Dynamo wrapped while compiling)."""
    return any(getattr(e, _TOLD, False) for e in compat_dynamo.error_chain(error))


def mark_told(error: BaseException) -> None:
    try:
        setattr(error, _TOLD, True)
    except AttributeError:  # an exception type without a __dict__: told, unmarked
        pass
