"""Inductor (private torch): compiling one piece, and the options of the stock peer."""
from __future__ import annotations

import contextlib
from typing import Callable

import torch


def inductor_compile(gm: torch.fx.GraphModule, example_inputs: list, mode: str | None) -> Callable:
    """Compile one piece with Inductor for every value of the token count.

    ``compile_fx`` has been the stable entry since torch 2.0 and accepts the fake,
    symbolic example inputs of the surrounding Dynamo trace.
    """
    try:
        from torch._inductor.compile_fx import compile_fx
    except ImportError as e:  # pragma: no cover
        raise RuntimeError(f"this torch ({torch.__version__}) has no torch._inductor.compile_fx: "
                           "use compiler='eager'") from e
    patches = {"max_autotune": True} if mode in ("max-autotune", "max-autotune-no-cudagraphs") else {}
    # Inductor's own cudagraphs must stay off: this backend captures the pieces itself.
    patches["triton.cudagraphs"] = False
    with _floats_of_this_piece_only(gm, example_inputs):
        return compile_fx(gm, example_inputs, config_patches=patches)


def _tensorify_state():
    """Dynamo's record of the float inputs to specialize on a restart, where this torch
    keeps it as a class with a set of symbol names (None elsewhere: nothing to do)."""
    try:
        from torch._dynamo.symbolic_convert import TensorifyState
    except ImportError:  # pragma: no cover
        return None
    names = getattr(TensorifyState, "force_specializations", None)
    return TensorifyState if isinstance(names, set) and hasattr(TensorifyState, "should_specialize") else None


@contextlib.contextmanager
def _floats_of_this_piece_only(gm: torch.fx.GraphModule, example_inputs: list):
    """Dynamo passes a float argument as a 0-dim tensor whose ``.item()`` is a symbolic
    float, and AOT's tensorify pass turns that float's arithmetic back into tensor ops.
    The pass expects to see the whole graph: a symbolic float of the shape environment
    that it did not turn into tensor ops itself, it takes for one it failed on, and it
    restarts Dynamo with the float baked in and its value guarded. Compiled one piece at
    a time, every piece but the one that reads the float would do so, and a call with
    another value would then be a recompile, not a step without graphs. So while this
    piece compiles, the floats it never mentions count as settled; a float it reads but
    cannot turn into tensor ops, or one the trace fixed, is still specialized by the
    pass, as before."""
    state, shape_env = _tensorify_state(), _shape_env(example_inputs)
    if state is None or shape_env is None:
        yield
        return
    from torch.utils._sympy.symbol import SymT, symbol_is_type

    mentioned = _symbols_of(gm, example_inputs)
    values = getattr(shape_env, "backed_var_to_val", None) or getattr(shape_env, "var_to_val", {})
    # A float the trace already fixed to its value (one passed to an op's float
    # argument) is replaced by that value everywhere, so no piece mentions it: it is
    # left to the pass, whose restart bakes it in as the trace did.
    fixed = getattr(shape_env, "replacements", {})
    foreign = {str(s) for s in values if symbol_is_type(s, SymT.FLOAT) and s not in mentioned
               and s not in fixed and not state.should_specialize(str(s))}
    state.force_specializations.update(foreign)
    try:
        yield
    finally:
        state.force_specializations.difference_update(foreign)


def _shape_env(example_inputs: list):
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode(example_inputs)
    return getattr(mode, "shape_env", None)


def _symbols_of(gm: torch.fx.GraphModule, example_inputs: list) -> set:
    """The symbols in the piece's inputs and in the values its nodes compute."""
    found: set = set()

    def add(v) -> None:
        if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            found.update(v.node.expr.free_symbols)
        elif isinstance(v, torch.Tensor):
            for d in (*v.shape, *v.stride()):
                add(d)
        elif isinstance(v, (list, tuple)):
            for x in v:
                add(x)

    add(list(example_inputs))
    for node in gm.graph.nodes:
        add(node.meta.get("example_value", node.meta.get("val")))
    return found


def reduce_overhead_options() -> dict:
    """``torch.compile`` options equal to ``mode="reduce-overhead"`` (CUDA graph trees),
    with graph partition where this torch has it, so ops tagged by
    :func:`step_dependent_tags` run outside the graphs."""
    import torch._inductor.config as inductor_config

    opts = {"triton.cudagraphs": True}
    if hasattr(inductor_config, "graph_partition"):
        opts["graph_partition"] = True
    return opts
