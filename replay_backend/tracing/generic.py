"""One trace for every token count: the traced graph checked generic, its guards relaxed.

A model step is traced once, its token count symbolic. While Dynamo traces and the
backend compiles the pieces, every decision taken on that symbol is recorded as a
guard: a lower bound, a divisibility a reshape needed, an equality a layout needed.
The compiled frame then refuses every count a guard does not admit, which once serving
is a recompile and an error. Every count from 1 to ``max_num_batched_tokens`` must run
on the one graph, so when the graph is built:

* a guard that some count from 2 to the maximum fails means the graph was built for
  some counts only (a view that needs an even count, a size compared with a constant):
  a ``ValueError`` that names the guard and the line that made it, at trace time,
  instead of a recompile in some later step;
* a guard that only the count 1 fails, and a value range that starts at 2, are the
  one-token bound: dropped, so that a lone decode reaches the graph.

Why one token is safe on a graph traced on two or more: the token count is traced as
a size that is never taken to be 1 (``replay_backend.compile`` traces size-obliviously,
and a marked dynamic dimension never specialises on 1), so every decision that would
differ at 1 (broadcasting a size-1 dimension, a squeeze) was taken as for any count:
the graph is the general program, and at 1 it computes the same rows. The test suite
runs every count from 1 to 64 through Inductor pieces against the eager model.

A trace made on one token is another matter: its size hint is 1, and what reads the
hint (the model's own Python, a reshape choosing a view from strides, Inductor's
lowering) may decide for one token only. Such a guard fails at two tokens and is
refused with the advice to trace on more.

The guards live in Dynamo's private shape environment (``compat/shapes.py``). Where
this torch keeps them elsewhere, the check is a counted fallback: the graph still
serves every count the guards admit, and one-token calls through Dynamo recompile.
"""
from __future__ import annotations

from typing import Callable

from ..fallbacks import Fallback
from ..compat import shapes


class TokenCountError(ValueError):
    """The traced graph holds only for some token counts."""


def admit_every_token_count(fake_mode, token_sizes: list, max_tokens: int,
                            fallback: Callable[[str, str], None], relax: bool = True, int_sizes: list = ()) -> None:
    """Check the graph traced under ``fake_mode`` admits every count from 2 to
    ``max_tokens`` and relax what refuses only 1. ``token_sizes``: the token-count
    SymInts of the graph's inputs; ``int_sizes``: its other SymInt inputs (Python ints
    of the call, which graphs hold at their traced values: guards are checked there).
    ``relax=False``: check only (before the pieces are compiled, which may add guards
    of their own: the relaxing comes after them)."""
    env = shapes.shape_env_of(fake_mode)
    if env is None:
        return
    problem = shapes.layout_problem(env)
    syms = shapes.symbols_of(env, token_sizes) if problem is None else set()
    if problem is None and not syms:
        return
    if problem is not None:
        if not relax:  # counted once, by the check after the compile
            return
        fallback(Fallback.TOKEN_GUARDS, f"{problem}: the token count's guards are not checked, and a one-token "
                 "call through Dynamo recompiles")
        return
    one_only = []
    traced = shapes.traced_values(env)
    traced_on_one = any(traced.get(s) == 1 for s in syms)
    for guard in shapes.token_guards(env, syms, shapes.symbols_of(env, int_sizes) - syms):
        try:
            bad = next((n for n in range(2, max_tokens + 1) if not guard.holds(n)), None)
        except Exception as e:  # noqa: BLE001 - a guard that cannot be evaluated for one count
            raise TokenCountError(_message(guard.text, guard.where, f"it cannot be checked per count ({e})")) from None
        if bad is not None:
            raise TokenCountError(_message(guard.text, guard.where, f"it fails at {bad} tokens")
                                  + (ONE_TOKEN_ONLY if bad == 2 and guard.holds(1) and traced_on_one else ""))
        if not guard.holds(1):
            one_only.append(guard.index)
    for s in syms:
        lower, upper = shapes.value_range(env, s)
        if upper is not None and upper < max_tokens:
            raise TokenCountError(_message(f"{s} <= {upper}", "", f"it fails at {upper + 1} tokens"))
        if lower is not None and lower > 2:
            raise TokenCountError(_message(f"{s} >= {lower}", "", f"it fails at {lower - 1} tokens"))
        if lower == 2 and relax:
            shapes.lower_range(env, s, 1)
    if relax:
        shapes.drop_guards(env, one_only)


# A guard that holds at one token and fails at two comes from a trace on one token:
# something decided from the size hint 1 (a branch, a size-1 dimension's arbitrary
# stride, Inductor's lowering) for that count alone.
ONE_TOKEN_ONLY = (". It holds at one token only: the model was traced on a call of one token, and a decision "
                  "was made for that count alone. Make the first call (the trace) at least 2 tokens long. Where "
                  "the recorded line reshapes or views a transposed tensor, its strides agree with a contiguous "
                  "one's at one token only: copying it to token rows first "
                  "(.clone(memory_format=torch.contiguous_format)) lets any first call trace it")


def _message(guard: str, where: str, why: str) -> str:
    at = f" (recorded {where})" if where else ""
    return (f"dsv41_replay: the traced model step holds only for some token counts: its guard `{guard}`{at} "
            f"on the token count is not generic: {why}. Every count from 1 to max_num_batched_tokens must run "
            "on one graph: avoid views, reshapes or branches that need the token count to divide evenly or "
            "to compare with a constant")
