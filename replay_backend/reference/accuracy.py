"""The benchmark's accuracy gate: every mode's logits against an fp32 yardstick.

A mode's last-row logits for one prompt are compared with those of an fp32 copy of
the model (the same weights, upcast), by relative L2 distance. The reference model is
initialised to be well-conditioned (docs/design.md): in bf16 its logits stay within
about 0.01 of the fp32 copy's, and a rounding step at the input moves them about as
far, so a 16-bit mode that reads a wrong layout or wrong rows stands out.

The gate measures that spread on the same prompt: the rounding-noise band is the
larger of the plain model's distance and that of fp32 copies whose embedding is
nudged by half a step of the model's dtype (two seeds). A mode is flagged when it is
more than ``DRIFT_FACTOR`` times the band (plus ``REL_FLOOR``) away. It cannot see an
error smaller than the model's own rounding noise, which the fp32 tests
(``tests/test_gpu.py``, ``scripts/soak.py``) bound instead.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from .compare import BAND_FACTOR, rel_l2
from . import attention_ops
from .runner import StepRunner

DRIFT_FACTOR = BAND_FACTOR  # the same rule as every 16-bit comparison (compare.py)
# Below this relative distance logits agree in any dtype (fp32 reassociation at depth).
REL_FLOOR = 1e-3
NUDGE_SEEDS = (0, 1)


def noise_limit(envelope: float) -> float:
    """How far a 16-bit result may lie from its oracle, given the rounding noise
    ``envelope`` of the same comparison (the oracle one rounding away)."""
    return BAND_FACTOR * max(envelope, REL_FLOOR)
CHECK = "check"  # the request id of the check prompt (its tokens follow from the id)


def nudge_size(dtype: torch.dtype) -> float:
    """The relative nudge standing for one rounding in ``dtype``: half a step for a
    16-bit type (exact in the fp32 copy); a whole step for fp32, where half a step
    would round back to the weight itself."""
    eps = torch.finfo(dtype).eps
    return eps if dtype == torch.float32 else eps / 2


def fp32_copy(model, nudge_seed: int | None = None, nudge: float = 0.0):
    """An fp32 copy of ``model``; with a seed, its embedding rows are scaled by
    ``1 ± nudge`` (a random sign per entry), configured by :func:`fp32_config`."""
    exact = copy.deepcopy(model).float()
    cfg = fp32_config(model.cfg)
    if cfg != model.cfg:
        for module in exact.modules():  # the blocks hold the config too
            if getattr(module, "cfg", None) is not None:
                module.cfg = cfg
    if nudge_seed is not None:
        with torch.no_grad():
            exact.embed.copy_(_nudged(exact.embed, nudge_seed, nudge))
    return exact


def fp32_config(cfg):
    """The config of :func:`fp32_copy`: FlashInfer has no fp32 kernels, so a model that
    attends through it is copied attending through the default implementation."""
    return cfg.replace(attention_impl="auto") if cfg.attention_impl == "flashinfer" else cfg


def nudged_copy(model, nudge_seed: int):
    """A copy of ``model`` in its own dtype and attention implementation, its embedding
    one rounding away: nudged as :func:`fp32_copy` nudges it (in fp32) by a whole step
    of the dtype, then rounded back, so that each entry lands on a neighbour."""
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.embed.copy_(_nudged(other.embed.float(), nudge_seed, torch.finfo(other.embed.dtype).eps))
    return other


def _nudged(embed: torch.Tensor, seed: int, nudge: float) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    sign = torch.randint(0, 2, embed.shape, generator=gen).float().mul_(2).sub_(1)
    return embed * sign.mul_(nudge).add_(1).to(embed.device)


def last_logits(model, prompt_len: int, max_num_batched_tokens: int) -> torch.Tensor:
    """Last-row fp32 logits of the ``prompt_len``-token check prompt from a plain run."""
    runner = StepRunner(model, max_num_seqs=1, max_model_len=max(prompt_len, model.cfg.window) + 2,
                        max_num_batched_tokens=max_num_batched_tokens)
    return runner.prefill({CHECK: prompt_len})[CHECK].float()


@dataclass(frozen=True)
class Yardstick:
    exact: torch.Tensor  # the fp32 copy's last-row logits of the check prompt
    plain_err: float  # relative L2 of the plain model's logits to ``exact`` (0 in fp32)
    noise_err: float  # the largest relative L2 of the nudged fp32 copies' logits

    @property
    def limit(self) -> float:
        return DRIFT_FACTOR * max(self.plain_err, self.noise_err) + REL_FLOOR

    def error(self, got: torch.Tensor) -> float:
        return rel_l2(got, self.exact)

    def drifted(self, err: float) -> bool:
        return err > self.limit


def yardstick(model, plain: torch.Tensor, prompt_len: int, max_num_batched_tokens: int,
              shared: dict | None = None) -> Yardstick:
    """The gate for ``model`` on the check prompt, given the plain model's logits.

    ``shared`` keeps a 16-bit model's fp32 results by what they depend on for a model
    built from its config (as the bench's are: the config fixes the weights): the fp32
    copy's config with its attention as it runs, the dtype, the prompt and the step
    budget. A bench pass in another attention implementation, whose fp32 copies compute
    the same, reuses them instead of running the copies again."""
    dtype = next(model.parameters()).dtype
    if dtype == torch.float32:  # the plain model is its own fp32 copy
        return Yardstick(plain.float(), 0.0, _noise(model, dtype, plain.float(), prompt_len, max_num_batched_tokens))
    cfg = fp32_config(model.cfg)
    device = next(model.parameters()).device
    key = (cfg.replace(attention_impl=attention_ops.effective_attention(cfg.attention_impl, device)),
           dtype, prompt_len, max_num_batched_tokens, str(device))
    result = shared.get(key) if shared is not None else None
    if result is None:
        exact = last_logits(fp32_copy(model), prompt_len, max_num_batched_tokens)
        result = (exact, _noise(model, dtype, exact, prompt_len, max_num_batched_tokens))
        if shared is not None:
            shared[key] = result
    exact, noise = result
    return Yardstick(exact, rel_l2(plain, exact), noise)


def _noise(model, dtype, exact: torch.Tensor, prompt_len: int, max_num_batched_tokens: int) -> float:
    noise = max(rel_l2(last_logits(fp32_copy(model, seed, nudge_size(dtype)), prompt_len,
                                   max_num_batched_tokens), exact) for seed in NUDGE_SEEDS)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the copies' memory goes back before the modes build
    return noise
