"""The bench's model-FLOPs count (for its MFU): projections against the reference model's
own weight shapes, attention keys against a row-by-row count."""
from __future__ import annotations

import pytest
import torch

from replay_backend import RequestChunk as R
from replay_backend.bench.flops import keys_read, keys_read_sum, row_projection_flops, step_flops
from replay_backend.reference import DSv41Mini, preset


def _weights_per_row(model: DSv41Mini, layer: int) -> int:
    """Multiply-adds per row of one layer, read off the module's parameters: every
    matrix once, the routed experts top_k of num_experts, norms and biases left out."""
    cfg, total = model.cfg, 0
    for name, p in model.layers[layer].named_parameters():
        if p.dim() < 2:
            continue
        n = p.numel()
        if name.endswith(("w_gate_up", "w_down")):
            n = n * cfg.top_k // cfg.num_experts
        total += n
    return total


@pytest.mark.parametrize("layer", [0, 1, 2, 3, 20, 39])
def test_projection_flops_match_the_models_weights(layer):
    cfg = preset("tiny")
    model = DSv41Mini(cfg)
    assert row_projection_flops(cfg, layer) == 2 * _weights_per_row(model, layer)


@pytest.mark.parametrize("layer", [0, 3, 10, 20, 30])
@pytest.mark.parametrize("first, last, floor", [(0, 0, 0), (0, 300, 0), (5, 77, 0), (122, 249, 122),
                                                (200, 259, 0), (699, 699, 0), (0, 130, 100), (4000, 4200, 4073)])
def test_attention_keys_in_closed_form_match_a_row_by_row_count(layer, first, last, floor):
    cfg = preset("tiny")
    assert keys_read_sum(cfg, layer, first, last, floor) == sum(keys_read(cfg, layer, p, floor)
                                                                 for p in range(first, last + 1))


def test_keys_read_by_one_row():
    cfg = preset("tiny")  # W = 128, sources 2 (ratio 2) .. 20 (ratio 1), cut 20
    assert keys_read(cfg, 0, 500, 0) == 128  # SWA only below the first source
    assert keys_read(cfg, 5, 500, 400) == 128 + 250  # a main layer ignores the floor; ratio-2 entries
    assert keys_read(cfg, 30, 500, 450) == 51 + 501  # a replay layer reads from its floor; ratio 1
    assert keys_read(cfg, 30, 420, 450) == 0 + 421  # below its floor: global entries only


def test_a_trimmed_step_counts_only_the_kept_rows_in_the_replay_layers():
    cfg = preset("tiny")
    step = [R("a", 1, 700), R("b", 250, 250), R("c", 60, 260)]
    trimmed, full = step_flops(cfg, step), step_flops(cfg, step, trimmed=False)
    replay_layers = cfg.num_layers - cfg.cut - 1
    dropped = (250 - 128) * sum(row_projection_flops(cfg, layer) for layer in range(cfg.cut + 1, cfg.num_layers))
    assert full.projections - trimmed.projections == dropped and replay_layers == 19
    assert full.attention > trimmed.attention and trimmed.head == full.head == 2 * 256 * 512 * 3
    decode = step_flops(cfg, [R("d", 1, 700)])
    assert decode.total == step_flops(cfg, [R("d", 1, 700)], trimmed=False).total
