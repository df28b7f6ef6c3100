"""Model FLOPs of one step of DSv4.1-mini, counted from its config (for the bench's MFU).

What a step must compute, not what a mode happens to launch: every projection of every
row the model needs (in the replay layers, a trimmed step's kept rows only), the
attention over the keys each row actually reads (its SWA span from the floor, the
global entries complete at its position), and the MoE's routed top-k experts plus the
shared one. A multiply-add is two FLOPs; norms, mixes and other elementwise work are
left out (a few percent at most). Dividing by a step's time and by the machine's
measured dense bf16 peak gives its model-FLOPs utilisation.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..requests import kept_len, replay_floor
from ..reference.config import ModelConfig


@dataclass(frozen=True)
class StepFlops:
    projections: float  # attention, compressor, mHC and MoE matmuls of the rows that run
    attention: float  # scores and values over the keys read
    head: float  # the logits of each request's last row

    @property
    def total(self) -> float:
        return self.projections + self.attention + self.head


def row_projection_flops(cfg: ModelConfig, layer: int) -> float:
    """One row's matmul FLOPs in one layer (both sublayers)."""
    h, nh, hd, hc = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.hc_mult
    attn = (h * cfg.q_lora_rank + cfg.q_lora_rank * nh * hd + h * hd  # q-LoRA, the shared latent
            + nh * hd * cfg.o_lora_rank + cfg.o_groups * cfg.o_lora_rank * h)  # grouped output
    if layer in cfg.kv_source_layer_ids:  # the compressor: kv, and the gate at ratio 2
        attn += h * hd * (2 if cfg.compress_ratio(layer) == 2 else 1)
    mix = 2 * hc * h * (2 * hc + hc * hc)  # the mHC projection of each sublayer
    moe = h * cfg.num_experts + cfg.top_k * 3 * h * cfg.moe_intermediate_size + 3 * h * cfg.shared_intermediate_size
    return 2.0 * (attn + mix + moe)


def keys_read(cfg: ModelConfig, layer: int, position: int, floor: int) -> int:
    """The keys the row at ``position`` reads in ``layer``: its own SWA span (from the
    floor in replay layers) and the global entries of its source complete at it."""
    lo = max(position - cfg.window + 1, floor if layer > cfg.cut else 0, 0)
    swa = max(0, position - lo + 1)
    src = cfg.global_source(layer)
    if src is None:
        return swa
    return swa + (position + 1) // cfg.compress_ratio(src)


def _ramp(x: int, cap: int) -> int:
    """sum of min(cap, y) for y = 1 .. x (0 for x <= 0)."""
    if x <= 0:
        return 0
    if x <= cap:
        return x * (x + 1) // 2
    return cap * (cap + 1) // 2 + (x - cap) * cap


def _floor_sum(n: int, r: int) -> int:
    """sum of q // r for q = 1 .. n: r - 1 zeros, then r of each value from 1 on."""
    if n <= 0:
        return 0
    m = n // r
    return r * m * (m - 1) // 2 + m * (n - r * m + 1)


def keys_read_sum(cfg: ModelConfig, layer: int, first: int, last: int, floor: int) -> int:
    """:func:`keys_read` summed over positions ``first .. last``, in closed form (a 32K
    prompt has 40 x 32K rows)."""
    f = max(floor if layer > cfg.cut else 0, 0)
    # A row's SWA span is min(W, p - f + 1), none below the floor: a ramp in p - f + 1.
    swa = _ramp(last - f + 1, cfg.window) - _ramp(first - f, cfg.window)
    src = cfg.global_source(layer)
    if src is None:
        return swa
    # entries of a ratio-r cache complete at p: (p + 1) // r
    ratio = cfg.compress_ratio(src)
    return swa + _floor_sum(last + 1, ratio) - _floor_sum(first, ratio)


def step_flops(cfg: ModelConfig, requests, trimmed: bool = True) -> StepFlops:
    """The FLOPs of one step of ``requests`` (RequestChunks). ``trimmed``: the replay
    layers run on each request's kept rows only (what the step needs); false counts every
    row there, as a mode that does not trim computes."""
    proj = attn = 0.0
    per_head = 4.0 * cfg.num_heads * cfg.head_dim  # q.k and p.v, a multiply-add each
    for layer in range(cfg.num_layers):
        replay = layer > cfg.cut
        row = row_projection_flops(cfg, layer)
        for r in requests:
            rows = kept_len(r, cfg.window) if replay and trimmed else r.query_len
            proj += rows * row
            floor = replay_floor(r, cfg.window)
            attn += per_head * keys_read_sum(cfg, layer, r.seq_len - rows, r.seq_len - 1, floor)
    head = 2.0 * cfg.hidden_size * cfg.vocab_size * len(requests)
    return StepFlops(proj, attn, head)


def point_flops(cfg: ModelConfig, isl: int, conc: int, max_num_batched_tokens: int) -> float:
    """The FLOPs of a bench point: ``conc`` prompts of ``isl`` tokens prefilled in chunked
    steps of at most ``max_num_batched_tokens`` tokens, as the bench runs them."""
    from ..requests import RequestChunk
    from ..reference.prompts import schedule_prefill

    total = 0.0
    for step in schedule_prefill([isl] * conc, max_num_batched_tokens):
        total += step_flops(cfg, [RequestChunk(i, q, s) for i, q, s in step]).total
    return total


def measured_peak(device: str, dtype) -> float:
    """The machine's dense matmul rate in FLOP/s, measured: the median of ten products of
    two square matrices in ``dtype`` (8192 wide on CUDA, 1024 on the CPU), after warm-up,
    on random data (zeros run faster than real data)."""
    import statistics
    import time

    import torch

    n = 8192 if device == "cuda" else 1024
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    times = []
    for i in range(13):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.mm(a, b)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            torch.mm(a, b)
            seconds = time.perf_counter() - t0
        if i >= 3:
            times.append(seconds)
    return 2.0 * n ** 3 / statistics.median(times)
