"""The one adapter over private torch APIs, with feature detection (torch >= 2.11).

Everything in the package that touches ``torch._inductor``, fake-tensor helpers, shape
environment configuration or structured tracing goes through here, so a torch upgrade
that moves one of them breaks one file, with a clear message.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch


def torch_version() -> tuple[int, int]:
    major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    return major, minor


def detect_fake_mode(inputs) -> Any:
    from torch._guards import detect_fake_mode as _detect

    return _detect(inputs)


def fakeify(fake_mode, inputs: list) -> list:
    """Example inputs as fake tensors of ``fake_mode`` (Dynamo may hand real ones)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) and not isinstance(x, FakeTensor)
            else x for x in inputs]


@contextlib.contextmanager
def size_oblivious() -> Iterator[None]:
    """Trace without specialising the token count on 0/1, so a one-token step does not
    recompile. Without the knob (older torch) callers must avoid 1-token traces."""
    cfg = getattr(torch.fx.experimental, "_config", None)
    if cfg is not None and hasattr(cfg, "backed_size_oblivious"):
        with cfg.patch(backed_size_oblivious=True):
            yield
    else:  # pragma: no cover - depends on torch build
        yield


def no_recompile() -> contextlib.AbstractContextManager:
    """Make any Dynamo recompile raise (after warm-up a recompile is an error)."""
    return torch._dynamo.config.patch(error_on_recompile=True)


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


def symbolic_dims(t) -> list[int]:
    """Indices of the dimensions of a (fake) tensor that are symbolic."""
    return [i for i, s in enumerate(t.shape) if isinstance(s, torch.SymInt) and not _is_constant(s)]


def _is_constant(s: torch.SymInt) -> bool:
    try:
        return s.node.is_constant() or not s.node.expr.free_symbols
    except AttributeError:  # pragma: no cover
        return False


def is_symint(x) -> bool:
    return isinstance(x, torch.SymInt) and not _is_constant(x)


def trace_structured(name: str, payload: Callable[[], str]) -> None:
    """Emit an artifact into TORCH_TRACE (tlparse) when structured tracing is available."""
    try:
        from torch._logging import trace_structured as _ts
    except ImportError:  # pragma: no cover
        return
    _ts("artifact", metadata_fn=lambda: {"name": name, "encoding": "string"}, payload_fn=payload)
