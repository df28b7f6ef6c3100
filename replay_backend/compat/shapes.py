"""Dynamo's shape environment: the guards recorded on the token count (private torch).

While Dynamo traces a graph and a backend compiles it, every decision taken on a
symbolic size is recorded in the graph's ``ShapeEnv``: ``guards`` holds one
``ShapeGuard(expr, sloc, size_oblivious)`` per decision and ``var_to_range`` each
symbol's value range. After the backend returns, Dynamo turns both into the guards of
the compiled frame, which refuse a call they do not admit (a recompile). Nothing here
is public torch API: :func:`layout_problem` checks the layout this module reads before
anything reads it, and the caller treats a mismatch as a counted fallback.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch


@dataclass(frozen=True)
class TokenGuard:
    """One recorded guard that involves the token count."""

    index: int  # its place in ``shape_env.guards``
    text: str  # the guard as Python over the token symbols
    where: str  # where it was recorded: the model's line, where torch knows it
    holds: Callable[[int], bool]  # the guard with every token symbol set to one count


def shape_env_of(fake_mode) -> Any | None:
    return getattr(fake_mode, "shape_env", None) if fake_mode is not None else None


def layout_problem(shape_env) -> str | None:
    """Why this torch's ShapeEnv is not the layout read here, or None."""
    guards = getattr(shape_env, "guards", None)
    ranges = getattr(shape_env, "var_to_range", None)
    if not isinstance(guards, list) or not isinstance(ranges, dict):
        return f"torch {torch.__version__}'s ShapeEnv keeps no guards list and var_to_range dict"
    if any(not hasattr(g, "expr") for g in guards):
        return f"torch {torch.__version__}'s shape guards have no expr"
    try:
        from torch.utils._sympy.printers import PythonPrinter  # noqa: F401
        from torch.utils._sympy.value_ranges import ValueRanges  # noqa: F401
    except ImportError as e:
        return f"torch {torch.__version__} has no {e.name}"
    return None


def symbols_of(shape_env, values: Iterable) -> set:
    """The free symbols of the given SymInts (the token counts of the graph's inputs),
    and the symbols the shape environment replaced by them (a second input's length,
    found equal to the first's while tracing)."""
    out: set = set()
    for v in values:
        if isinstance(v, torch.SymInt):
            out |= set(v.node.expr.free_symbols)
    replaced = getattr(shape_env, "replacements", None) or {}
    for s, expr in replaced.items():
        free = getattr(expr, "free_symbols", None)
        if free and set(free) <= out:
            out.add(s)
    return out


def _compiled(expr, symbols: set) -> tuple[str, Callable[[int], bool]]:
    """``expr`` as Python code and as a function of one token count (every token symbol
    set to it): printed the way Dynamo prints guard code, so evaluating it for every
    count of a step is cheap."""
    from torch.utils._sympy.printers import PythonPrinter

    code = PythonPrinter().doprint(expr)
    names = sorted(s.name for s in symbols)
    fn = eval(f"lambda {', '.join(names)}: {code}", {"math": math, "torch": torch})  # noqa: S307 - printed by torch

    def holds(n: int) -> bool:
        return bool(fn(*([n] * len(names))))

    return code, holds


def token_guards(shape_env, symbols: set, fixed: Iterable = ()) -> list[TokenGuard]:
    """The recorded guards whose expression involves token symbols, with each symbol of
    ``fixed`` (a value the graphs hold fixed, a Python int of the call) set to the value
    it was traced with. Those with other symbols are returned too, their ``holds``
    raising: the caller refuses them."""
    values = traced_values(shape_env)
    known = {s: values[s] for s in fixed if s in values}
    out = []
    for i, g in enumerate(shape_env.guards):
        free = set(g.expr.free_symbols)
        if not free & symbols:
            continue
        where = guard_location(getattr(g, "sloc", None))
        if free - symbols - set(known):
            text = str(g.expr)

            def holds(n: int, _text=text) -> bool:
                raise ValueError(f"{_text} relates the token count to other sizes")
        else:
            expr = g.expr.subs(known) if free - symbols else g.expr
            text, holds = _compiled(expr, free & symbols)
        out.append(TokenGuard(i, text, where, holds))
    return out


def guard_location(sloc) -> str:
    """Where a guard was recorded, for a message: the model's line where torch knows it.
    A guard without one was added by torch's own code after Dynamo's trace (Inductor's
    lowering, or its cache replaying the guards of an earlier compile), whose frame
    alone would send the user to torch's source."""
    if sloc is None:
        return ""
    user = getattr(sloc, "maybe_user_loc", None)
    if user:
        return f"at {sloc}"
    if not hasattr(sloc, "framework_loc"):  # a torch whose guards keep another record
        return f"at {sloc}" if str(sloc) else ""
    return (f"by torch itself, at {str(sloc).strip('()')}, with no line of the model: Inductor's lowering "
            "or its cache of an earlier compile made it; TORCH_LOGS=+dynamic shows the decision with its stack")


def traced_values(shape_env) -> dict:
    """Each symbol's value in the traced call (its hint), or nothing where this torch
    keeps them elsewhere."""
    for name in ("backed_var_to_val", "var_to_val"):  # the newer name first: the older warns
        values = getattr(shape_env, name, None)
        if isinstance(values, dict):
            return values
    return {}


def drop_guards(shape_env, indices: Iterable[int]) -> None:
    drop = set(indices)
    shape_env.guards[:] = [g for i, g in enumerate(shape_env.guards) if i not in drop]


def value_range(shape_env, symbol) -> tuple[int | None, int | None]:
    """The symbol's range: (lower, upper), None where unbounded."""
    r = shape_env.var_to_range.get(symbol)
    if r is None:
        return None, None

    def finite(x):
        if getattr(x, "is_finite", True) is False:  # sympy's and torch's infinities
            return None
        try:
            return int(x)
        except Exception:  # noqa: BLE001 - an infinity this torch spells otherwise
            return None

    return finite(r.lower), finite(r.upper)


def lower_range(shape_env, symbol, lower: int) -> None:
    """Lower the symbol's range to start at ``lower`` (its upper bound kept)."""
    from torch.utils._sympy.value_ranges import ValueRanges

    r = shape_env.var_to_range[symbol]
    shape_env.var_to_range[symbol] = ValueRanges(lower, r.upper)
