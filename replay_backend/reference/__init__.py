"""DSv4.1-mini, the reference model family."""
from .config import PRESETS, ModelConfig, preset
from .dsv41_mini import DSv41Mini

__all__ = ["DSv41Mini", "ModelConfig", "PRESETS", "preset", "build_model"]


def build_model(cfg: ModelConfig, device="cpu", dtype=None):
    """The reference model with seeded random weights, on ``device`` in ``dtype``."""
    import torch

    model = DSv41Mini(cfg)
    return model.to(device=device, dtype=dtype or torch.float32).eval()
