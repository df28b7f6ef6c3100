"""Triton, where it is installed: the models' kernels import it from here, and run
their PyTorch reference where ``available()`` is false (CPU machines without it)."""
from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU machines without triton
    triton = tl = None


def available() -> bool:
    return triton is not None
