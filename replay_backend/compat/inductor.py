"""Inductor (private torch): compiling one piece, and the options of the stock peer."""
from __future__ import annotations

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
    return compile_fx(gm, example_inputs, config_patches=patches)


def reduce_overhead_options() -> dict:
    """``torch.compile`` options equal to ``mode="reduce-overhead"`` (CUDA graph trees),
    with graph partition where this torch has it, so ops tagged by
    :func:`step_dependent_tags` run outside the graphs."""
    import torch._inductor.config as inductor_config

    opts = {"triton.cudagraphs": True}
    if hasattr(inductor_config, "graph_partition"):
        opts["graph_partition"] = True
    return opts
