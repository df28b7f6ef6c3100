"""Whether FlashInfer can serve ``attention_impl="flashinfer"`` here, and its import.

flashinfer-python is imported only by a runner that uses it: the import takes seconds,
and a broken install must not break the other kernels.
"""
from __future__ import annotations

import importlib
import importlib.util

import torch


def available() -> bool:
    """Whether flashinfer-python is installed (not imported)."""
    return importlib.util.find_spec("flashinfer") is not None


def load():
    """The flashinfer module; a ValueError naming why where it does not import."""
    try:
        return importlib.import_module("flashinfer")
    except Exception as e:  # noqa: BLE001 - installed but not importable, for any reason
        raise ValueError(f"attention_impl='flashinfer': importing flashinfer failed: {type(e).__name__}: {e}") from e


def check_supported(device: torch.device, dtype: torch.dtype) -> None:
    """Raise a ValueError naming what rules out ``attention_impl="flashinfer"`` here."""
    if not available():
        raise ValueError("attention_impl='flashinfer' needs the flashinfer-python package: "
                         "pip install 'dsv41-replay[gpu]' (docs/configuration.md)")
    load()
    if torch.device(device).type != "cuda":
        raise ValueError(f"attention_impl='flashinfer' runs on CUDA only, the model is on {device}")
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"attention_impl='flashinfer' needs a bfloat16 or float16 model, got {dtype} "
                         "(FlashInfer's prefill kernels have no fp32 variant)")
