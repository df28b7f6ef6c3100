"""The benchmark's accuracy gate: every mode's logits against an fp32 yardstick.

Each mode's last-row logits for one prompt are compared with the plain model's, but in
bf16 that distance alone does not say whether a mode is right: compiled pieces round
differently, and a piece that reads a wrong layout still gives plausible numbers (a
Sinkhorn fed the wrong rows stays doubly stochastic). So the bench also runs the prompt
through an fp32 copy of the model (the same weights, upcast) and flags a mode whose
distance to it is well above the plain 16-bit model's own.
"""
from __future__ import annotations

import copy

import torch

from .runner import StepRunner

# A mode may be this many times further from the fp32 copy than the plain model is.
DRIFT_FACTOR = 2.0


def fp32_reference(model, prompt_len: int, max_num_batched_tokens: int) -> torch.Tensor | None:
    """Last-row logits of a ``prompt_len``-token prompt from an fp32 copy of a 16-bit
    ``model``; None when the model is fp32 already (its plain run is the yardstick)."""
    if next(model.parameters()).dtype == torch.float32:
        return None
    exact = copy.deepcopy(model).float()
    runner = StepRunner(exact, max_num_seqs=1, max_model_len=max(prompt_len, model.cfg.window) + 2,
                        max_num_batched_tokens=max_num_batched_tokens)
    logits = runner.prefill({"check": prompt_len})["check"].float()
    del runner, exact
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return logits


def drifted(err: float, plain_err: float, scale: float) -> bool:
    """True when a mode's distance to the fp32 copy (``err``) exceeds ``DRIFT_FACTOR``
    times the plain model's (``plain_err``), with a floor of 1e-3 of the logits' scale."""
    return err > DRIFT_FACTOR * plain_err + 1e-3 * scale
