"""Replay-batch construction against hand-worked examples, and input validation."""
from __future__ import annotations

import pytest
import torch

from replay_backend.batch import (
    RequestChunk,
    ViewField,
    build_step_batch,
    kept_len,
    replay_floor,
    replay_rows,
)
from replay_backend.reference.batch_spec import parse_batch_spec
from replay_backend.kv_cache import CacheLayout
from replay_backend.reference.attention_ops import COMP_FIELD, COMP_SLOTS, VIEW_FIELDS
from replay_backend.reference.config import ModelConfig, preset
from replay_backend.reference.prompts import PromptTokens, schedule_prefill

R = RequestChunk


def _tokens(reqs, fill=7):
    return [[fill] * r.query_len for r in reqs]


def _build(reqs, layout, window, blocks=None, **kw):
    blocks = list(range(len(reqs))) if blocks is None else blocks
    return build_step_batch(reqs, _tokens(reqs), blocks, layout, window, "cpu", **kw)


def _list(t: torch.Tensor) -> list[int]:
    return [int(x) for x in t.tolist()]


# --------------------------------------------------------------------------------------
# The worked example of docs/design.md (Replay rows)
# --------------------------------------------------------------------------------------
EXAMPLE_W = 128
EXAMPLE_REQS = [R("dec", 1, 700), R("pre", 250, 250), R("chunk", 60, 260)]


def test_documented_example_rows_and_query_start_loc():
    rows, qsl = replay_rows(EXAMPLE_REQS, EXAMPLE_W)
    expected = [0] + list(range(123, 251)) + list(range(251, 311))
    assert rows == expected
    assert len(rows) == 189
    assert qsl == [0, 1, 129, 189]
    assert [kept_len(r, EXAMPLE_W) for r in EXAMPLE_REQS] == [1, 128, 60]


def test_documented_example_floors():
    assert [replay_floor(r, EXAMPLE_W) for r in EXAMPLE_REQS] == [0, 122, 0]


def test_documented_example_step_batch():
    layout = CacheLayout(max_model_len=1024, num_blocks=4)
    blocks = [2, 0, 3]
    base = [2048, 0, 3072]
    ids = [[5], list(range(250)), list(range(100, 160))]
    b = build_step_batch(EXAMPLE_REQS, ids, blocks, layout, EXAMPLE_W, "cpu", view_fields=COMP_FIELD)

    assert b.num_tokens == 311
    assert b.has_trimmable_rows
    assert _list(b.input_ids) == [5] + list(range(250)) + list(range(100, 160))

    pos = [699] + list(range(0, 250)) + list(range(200, 260))
    assert _list(b.positions) == pos
    assert b.view.query_start_loc == (0, 1, 251, 311)
    assert b.view.seq_lens == (700, 250, 260)
    assert b.view.kv_start == (0, 122, 0)
    assert b.view.cache_base == tuple(base)

    owner = [0] + [1] * 250 + [2] * 60
    slots = [base[o] + p for o, p in zip(owner, pos)]
    assert _list(b.view.slot_mapping) == slots
    assert slots[0] == 2048 + 699 and slots[1] == 0 and slots[251] == 3072 + 200

    # the reference model's own per-row field: its ratio-2 compressed-cache slots
    pad = layout.num_slots // 2  # ratio-2 pad slot = last row of a [num_slots/2 + 1] cache
    assert pad == 2048
    comp = [base[o] // 2 + p // 2 if p % 2 else pad for o, p in zip(owner, pos)]
    assert _list(b.view.derived[COMP_SLOTS].view(-1)) == comp
    # spot checks: decode at odd position 699 completes entry 349 of its block
    assert comp[0] == 1024 + 349
    assert comp[1] == pad and comp[2] == 0  # positions 0 (even) and 1 (odd) of block 0

    assert _list(b.logits_indices) == [0, 250, 310]

    rows = [0] + list(range(123, 251)) + list(range(251, 311))
    rep = b.replay
    assert rep.rows == tuple(rows)
    assert rep.num_rows == 189
    assert _list(rep.rows_t) == rows
    assert _list(rep.positions) == [pos[i] for i in rows]
    assert _list(rep.positions)[:3] == [699, 122, 123]
    assert rep.view.num_tokens == 189
    assert rep.view.query_start_loc == (0, 1, 129, 189)
    assert rep.view.seq_lens == (700, 250, 260)
    assert rep.view.kv_start == (0, 122, 0)
    assert rep.view.cache_base == tuple(base)
    assert _list(rep.view.slot_mapping) == [slots[i] for i in rows]
    assert _list(rep.view.derived[COMP_SLOTS].view(-1)) == [comp[i] for i in rows]  # the kept rows'
    # who reads which view: the layers before the region the whole batch, the replay
    # layers the replay batch, or the whole batch marked as theirs (the floor applies)
    assert not b.view.replay and rep.view.replay and b.region_view.replay
    assert b.region_view.derived is b.view.derived and b.region_view.slot_mapping is b.view.slot_mapping
    assert b.region_view.kv_start == b.view.kv_start and b.region_view.num_tokens == 311


@pytest.mark.parametrize("qlens", [[311], [1, 250, 60], [3, 5, 7], [128, 129], [2, 2]])
def test_metadata_fields_start_16_byte_aligned_whatever_the_sizes(qlens):
    """Triton specialises pointers on 16-byte alignment: a metadata field whose alignment
    moved with the step's sizes would build new kernel variants inside a served step."""
    from replay_backend.reference.attention_ops import ATTN_BLOCKS, VIEW_FIELDS

    layout = CacheLayout(max_model_len=1024, num_blocks=4)
    reqs = [R(f"r{i}", q, q + 7 * i) for i, q in enumerate(qlens)]
    b = _build(reqs, layout, EXAMPLE_W, view_fields=VIEW_FIELDS)
    fields = {"slot_mapping": b.view.slot_mapping, "comp slots": b.view.derived[COMP_SLOTS],
              "logits_indices": b.logits_indices, "count_rows": b.replay.count_rows,
              "replay slot_mapping": b.replay.view.slot_mapping, "replay positions": b.replay.positions,
              "attention blocks": b.view.derived[ATTN_BLOCKS],
              "replay attention blocks": b.replay.view.derived[ATTN_BLOCKS]}
    for name, t in fields.items():
        assert t.data_ptr() % 16 == 0, (name, qlens)
    # and still the values they had before any padding
    assert _list(b.logits_indices) == [sum(qlens[:i + 1]) - 1 for i in range(len(qlens))]
    assert _list(b.replay.count_rows) == [b.replay.num_rows, *b.replay.rows]
    assert len(b.view.slot_mapping) == sum(qlens) and len(b.replay.positions) == b.replay.num_rows


@pytest.mark.parametrize("qlens", [[1], [9], [1] * 64, [4] * 5, [1, 250, 60, 1, 1, 3], [300, 1]])
@pytest.mark.parametrize("pad_writes", [False, True])
def test_each_rows_position_slot_and_token_are_its_own_requests(qlens, pad_writes):
    """Positions, slots and token ids row by row, from each request alone: a request's
    rows hold its last positions, written into its own block (or the pad slot), and
    its own tokens, whether they come as lists or tensors."""
    layout = CacheLayout(max_model_len=1024, num_blocks=64)
    reqs = [R(f"r{i}", q, q + 5 * i) for i, q in enumerate(qlens)]
    blocks = [(7 * i + 3) % 64 for i in range(len(reqs))]
    if pad_writes:
        blocks = [0] * len(reqs)
    ids = [list(range(100 * i, 100 * i + r.query_len)) for i, r in enumerate(reqs)]
    want_pos, want_slots, want_ids = [], [], []
    for r, b, toks in zip(reqs, blocks, ids):
        for p in range(r.seq_len - r.query_len, r.seq_len):
            want_pos.append(p)
            want_slots.append(layout.pad_slot if pad_writes else b * layout.max_model_len + p)
        want_ids += toks
    mixed = [torch.tensor(t) if i % 2 else t for i, t in enumerate(ids)]
    for given in (ids, [torch.tensor(t, dtype=torch.int32) for t in ids], [ids[0], *map(torch.tensor, ids[1:])], mixed):
        b = build_step_batch(reqs, given, blocks, layout, 16, "cpu", pad_writes=pad_writes)
        assert _list(b.positions) == want_pos and _list(b.view.slot_mapping) == want_slots
        assert _list(b.input_ids) == want_ids


@pytest.mark.parametrize("ids,match", [([[1.5], [2]], "token ids must be int64 integers"),
                                       ([torch.tensor([1.0]), [2]], "token_ids\\[0\\] is a 1-D torch.float32 tensor"),
                                       ([torch.tensor([[1]]), [2]], "token_ids\\[0\\] is a 2-D torch.int64 tensor"),
                                       ([[2**63], [2]], "token ids must be int64 integers"),
                                       ([[1.5], torch.tensor([2])], "token ids must be int64 integers"),
                                       ([torch.tensor([2]), [[1]]], "token ids must be int64 integers")])
def test_token_ids_that_are_not_integers_are_refused(ids, match):
    with pytest.raises(ValueError, match=match):
        build_step_batch([R("a", 1, 3), R("b", 1, 3)], ids, [0, 1], LAYOUT, 16, "cpu")


@pytest.mark.parametrize("ids, match", [
    ([torch.tensor([[1, 2, 3]])], r"token_ids\[0\] is a 2-D torch.int64 tensor"),  # one row of three: not 1 id
    ([torch.tensor([[1], [2], [3]])], r"token_ids\[0\] is a 2-D torch.int64 tensor"),
    ([torch.tensor(3)], r"token_ids\[0\] is a 0-D torch.int64 tensor"),
    ([7], r"token_ids\[0\] is of type int: give a request's token ids as a list"),
])
def test_token_ids_of_the_wrong_shape_are_refused_by_their_kind_not_their_length(ids, match):
    with pytest.raises(ValueError, match=match):
        build_step_batch([R("a", 3, 3)], ids, [0], LAYOUT, 16, "cpu")


# --------------------------------------------------------------------------------------
# Other compositions
# --------------------------------------------------------------------------------------
def test_keep_all_keeps_every_row_and_has_no_floor():
    W = 16
    reqs = [R("k", 40, 40, keep_all=True), R("p", 40, 40), R("k2", 30, 50, keep_all=True)]
    rows, qsl = replay_rows(reqs, W)
    assert rows == list(range(0, 40)) + list(range(64, 80)) + list(range(80, 110))
    assert qsl == [0, 40, 56, 86]
    assert [replay_floor(r, W) for r in reqs] == [0, 24, 0]
    # keep_all ignores a prefix-cache start too: it keeps its normal windows
    assert replay_floor(R("k", 40, 100, keep_all=True, kv_start=90), W) == 0


def test_kv_start_sets_a_later_floor_only():
    W = 16
    assert replay_floor(R("a", 40, 100), W) == 84
    assert replay_floor(R("a", 40, 100, kv_start=90), W) == 90  # later start wins
    assert replay_floor(R("a", 40, 100, kv_start=50), W) == 84  # earlier start cannot widen
    layout = CacheLayout(512, 2)
    b = _build([R("a", 40, 100, kv_start=90), R("b", 20, 20)], layout, W)
    assert b.view.kv_start == (90, 4)
    assert b.replay.view.kv_start == (90, 4)
    # the kept rows are still the last W rows
    assert b.replay.rows == tuple(range(24, 40)) + tuple(range(44, 60))


def test_decodes_and_speculative_decodes_keep_all_rows():
    W = 16
    layout = CacheLayout(512, 4)
    reqs = [R("a", 1, 50), R("b", 3, 60), R("c", 16, 100), R("d", 2, 17)]
    b = _build(reqs, layout, W)
    assert b.replay.rows == tuple(range(22))
    assert b.replay.view.query_start_loc == (0, 1, 4, 20, 22)
    assert b.view.kv_start == (0, 0, 0, 0)
    assert not b.has_trimmable_rows
    assert _list(b.positions) == [49, 57, 58, 59] + list(range(84, 100)) + [15, 16]
    assert _list(b.logits_indices) == [0, 3, 19, 21]


def test_one_row_over_the_window_trims_one_row():
    W = 16
    layout = CacheLayout(512, 1)
    b = _build([R("a", 17, 30)], layout, W)
    assert b.has_trimmable_rows
    assert b.replay.rows == tuple(range(1, 17))
    assert b.view.kv_start == (14,)
    assert _list(b.replay.positions) == list(range(14, 30))
    assert _list(b.replay.view.slot_mapping) == list(range(14, 30))


# --------------------------------------------------------------------------------------
# Bad inputs
# --------------------------------------------------------------------------------------
LAYOUT = CacheLayout(512, 4)


@pytest.mark.parametrize(
    "reqs, match",
    [
        ([], "empty batch"),
        ([R("a", 0, 5)], r"request 0 \(req_id='a'\): query_len must be >= 1, got 0"),
        ([R("a", 4, 8), R("b", 6, 5)], r"request 1 \(req_id='b'\): seq_len=5 is shorter than query_len=6"),
        ([R("a", 10, 513)], r"seq_len=513 exceeds the cache's max_model_len=512"),
        ([R("a", 1, 5), R("a", 1, 7)], r"request 1 \(req_id='a'\): req_id appears twice"),
        ([R("a", 30, 40, kv_start=40)], r"kv_start=40 must lie in \[0, seq_len=40\)"),
        ([R("a", 30, 40, kv_start=-1)], r"kv_start=-1"),
    ],
)
def test_bad_requests_raise(reqs, match):
    with pytest.raises(ValueError, match=match):
        _build(reqs, LAYOUT, 16)


def test_too_many_tokens_for_budget():
    with pytest.raises(ValueError, match=r"step has 49 tokens, more than max_num_batched_tokens=48"):
        _build([R("a", 30, 30), R("b", 19, 19)], LAYOUT, 16, max_num_batched_tokens=48)
    # exactly at the budget is fine
    b = _build([R("a", 30, 30), R("b", 18, 18)], LAYOUT, 16, max_num_batched_tokens=48)
    assert b.num_tokens == 48


def test_token_id_count_mismatch():
    reqs = [R("a", 3, 3), R("b", 4, 10)]
    with pytest.raises(ValueError, match=r"request 1: 3 token ids for query_len=4"):
        build_step_batch(reqs, [[1, 2, 3], [1, 2, 3]], [0, 1], LAYOUT, 16, "cpu")


@pytest.mark.parametrize("ids", [[[1, 2, 3]], [[1, 2, 3], [1, 2, 3, 4], [5]]])
def test_a_token_id_list_per_request_or_an_error_naming_the_counts(ids):
    """One token id list too few or too many: a batch whose token ids and positions
    differ in length would reach the model."""
    with pytest.raises(ValueError, match=rf"{len(ids)} token id lists for 2 requests"):
        build_step_batch([R("a", 3, 3), R("b", 4, 10)], ids, [0, 1], LAYOUT, 16, "cpu")


@pytest.mark.parametrize("reqs, ids, blocks, match", [
    ([("a", 1, 3)], [[1]], [0], r"request 0: a step's requests are replay_backend.RequestChunk, got tuple"),
    ([R("a", 1, 3)], None, [0], "token_ids must be a list with one entry per request, got NoneType"),
    ([R("a", 1, 3)], [[1]], (b for b in [0]), "blocks must be a list with one entry per request, got generator"),
])
def test_a_batch_of_the_wrong_kinds_of_arguments_is_refused_naming_the_argument(reqs, ids, blocks, match):
    with pytest.raises(ValueError, match=match):
        build_step_batch(reqs, ids, blocks, LAYOUT, 16, "cpu")


def _pos(p, s, layout):
    return p.clone()


@pytest.mark.parametrize("field, match", [
    (ViewField(lambda p, s, layout: p[1:].clone(), per_row=True), r"ViewField 'f': build returned 2 values for 3 rows"),
    (ViewField(_pos, 2, per_row=True), r"ViewField 'f': build returned 3 values for 3 rows of width 2"),
    (ViewField(lambda p, s, layout: p.float(), per_row=True), r"ViewField 'f': build must return a 1-D int64 tensor, "
                                                               r"got a 1-D torch.float32 tensor"),
    (ViewField(lambda q, s, k, b, w: list(q)), r"ViewField 'f': build must return a 1-D int64 tensor, got list"),
    (ViewField(lambda q, s, k, b, w: torch.zeros(4 * q[-1] + 1, dtype=torch.int64), 3),
     r"ViewField 'f': build returned 13 values, not whole rows of width 3"),
])
def test_a_view_field_that_builds_the_wrong_value_is_refused_naming_it(field, match):
    with pytest.raises(ValueError, match=match):
        build_step_batch([R("a", 3, 3)], [[1, 2, 3]], [0], LAYOUT, 16, "cpu", view_fields={"f": field})


def test_a_view_fields_max_rows_must_be_callable():
    with pytest.raises(ValueError, match="ViewField.max_rows must be callable"):
        ViewField(_pos, max_rows=16)


def test_block_count_mismatch():
    with pytest.raises(ValueError, match=r"1 cache blocks for 2 requests"):
        build_step_batch([R("a", 1, 3), R("b", 1, 3)], [[1], [2]], [0], LAYOUT, 16, "cpu")


def test_runner_rejects_bad_steps(make_runner):
    runner = make_runner(max_num_batched_tokens=48)
    with pytest.raises(ValueError, match=r"seq_len=600 exceeds the cache's max_model_len=512"):
        runner.step([R("a", 10, 600)])
    with pytest.raises(ValueError, match=r"more than max_num_batched_tokens=48"):
        runner.step([R("a", 49, 49)])
    with pytest.raises(ValueError, match="empty batch"):
        runner.step([])
    # the rejected steps must not have claimed a cache block for "a"
    assert runner.block_of("z") == 0
    with pytest.raises(ValueError, match="eager_replay must be 'off' or 'parent', got 'trim'"):
        runner.step([R("z", 4, 4)], eager_replay="trim")


def test_runner_runs_out_of_blocks(make_runner):
    runner = make_runner(max_num_seqs=2)
    runner.build_batch([R("a", 1, 1), R("b", 1, 1)])
    with pytest.raises(RuntimeError, match="no free cache block"):
        runner.build_batch([R("c", 1, 1)])
    runner.free("a")
    assert runner.build_batch([R("c", 1, 1)]).view.cache_base == (0,)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(max_model_len=511, num_blocks=2), "positive even number, got 511"),
        (dict(max_model_len=0, num_blocks=2), "positive even number, got 0"),
        (dict(max_model_len=64, num_blocks=0), "num_blocks must be positive"),
    ],
)
def test_cache_layout_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        CacheLayout(**kw)


def test_cache_layout_slots():
    lay = CacheLayout(64, 3)
    assert lay.num_slots == 192 and lay.pad_slot == 192
    assert [lay.base(b) for b in range(3)] == [0, 64, 128]


# --------------------------------------------------------------------------------------
# ModelConfig validation
# --------------------------------------------------------------------------------------
TINY = preset("tiny")


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(num_layers=8, kv_source_layer_ids=(3, 1)), r"strictly increasing, got \[3, 1\]"),
        (dict(num_layers=8, kv_source_layer_ids=(1, 1, 3)), "strictly increasing"),
        (dict(num_layers=8, kv_source_layer_ids=(1, 8)), r"out of range for num_layers=8"),
        (dict(num_layers=8, kv_source_layer_ids=(-1, 3)), "out of range"),
        (dict(num_layers=8, kv_source_layer_ids=()), "at least one layer"),
        (dict(num_heads=5, o_groups=2), "num_heads=5 is not a multiple of o_groups=2"),
        (dict(rope_dim=31), "rope_dim=31 must be even"),
        (dict(rope_dim=128, head_dim=64), "rope_dim=128"),
        (dict(top_k=5, num_experts=4), r"top_k=5 must be in \[1, num_experts=4\]"),
        (dict(window=0), "window must be positive"),
        (dict(attention_impl="flash"), "attention_impl must be auto, reference, triton or flashinfer, got 'flash'"),
        (dict(moe_impl="sparse"), "moe_impl must be auto, dense or grouped, got 'sparse'"),
        (dict(moe_permute_impl="sort"), "moe_permute_impl must be auto, reference or triton, got 'sort'"),
        (dict(attention_split="no"), "attention_split must be true or false, got 'no'"),
        (dict(sinkhorn_impl="triton"), "sinkhorn_impl must be reference or fused, got 'triton'"),
        # a value of the wrong type is named as such, before any comparison trips on it
        (dict(window="x"), "window must be an integer, got 'x'"),
        (dict(window=1.5), "window must be an integer, got 1.5"),
        (dict(num_layers=True), "num_layers must be an integer, got True"),
        (dict(rms_eps="small"), "rms_eps must be a number, got 'small'"),
        (dict(attention_impl=3), "attention_impl must be a string, got 3"),
        (dict(kv_source_layer_ids=[2, 8]), r"kv_source_layer_ids must be a tuple of layer ids, got \[2, 8\]"),
    ],
)
def test_model_config_validation(changes, match):
    with pytest.raises(ValueError, match="invalid ModelConfig: .*" + match):
        TINY.replace(**changes)


def test_with_layers_validates_too():
    with pytest.raises(ValueError, match="strictly increasing"):
        TINY.with_layers(8, [3, 1])
    assert TINY.with_layers(8, [1, 3]).kv_source_layer_ids == (1, 3)


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        preset("huge")


def test_default_config_is_valid():
    assert ModelConfig().cut == 20


# --------------------------------------------------------------------------------------
# --batch mini-language
# --------------------------------------------------------------------------------------
def test_parse_batch_spec_good():
    reqs = parse_batch_spec("d:1/700,p:250,p:60/260,k:140")
    assert reqs == [
        R("r0", 1, 700),
        R("r1", 250, 250),
        R("r2", 60, 260),
        R("r3", 140, 140, keep_all=True),
    ]
    assert parse_batch_spec(" d:3/50 , k:20/40 ,") == [R("r0", 3, 50), R("r1", 20, 40, keep_all=True)]
    assert parse_batch_spec("p:5/5") == [R("r0", 5, 5)]


def test_a_soak_step_parses_back_to_its_requests():
    """The soak prints a step as ``spec_of`` writes it, floors included; ``--batch``
    takes it back."""
    from replay_backend.reference.soak import spec_of

    reqs = [R("r0", 1, 58), R("r1", 869, 1091, kv_start=971), R("r2", 40, 40, keep_all=True)]
    assert spec_of(reqs) == "d:1/58,p:869/1091@971,k:40/40"
    assert parse_batch_spec(spec_of(reqs)) == reqs


@pytest.mark.parametrize(
    "spec, match",
    [
        ("", "no requests"),
        (" , ,", "no requests"),
        ("p:10,x:5", r"item 1 'x:5': expected KIND:Q\[/S\]\[@F\]"),
        ("p:10/20@", r"item 0 'p:10/20@'"),
        ("d:1/5,p:10/20@20", r"^--batch item 1 'p:10/20@20': the floor F must lie below S$"),
        ("p:10,d:1", r"item 1 'd:1': a decode needs its sequence length"),
        ("p:0", r"item 0 'p:0': need 1 <= Q <= S"),
        ("p:5/3", r"item 0 'p:5/3': need 1 <= Q <= S"),
        ("p:-1", r"item 0 'p:-1'"),
        ("p:1/2/3", r"item 0 'p:1/2/3'"),
        ("p 5", r"item 0 'p 5'"),
        ("d:1/700,P:2", r"item 1 'P:2'"),
    ],
)
def test_parse_batch_spec_bad(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_batch_spec(spec)


# --------------------------------------------------------------------------------------
# Chunked prefill schedule
# --------------------------------------------------------------------------------------
def test_a_runners_step_tokens_are_its_prompt_tokens_as_a_list_or_a_tensor():
    tokens = PromptTokens(vocab=1000, max_len=4096)
    for start, end in [(0, 1), (4000, 4016), (7, 300), (0, 4096)]:
        got = tokens.for_step("req-7", start, end)
        assert isinstance(got, list) == (end - start <= PromptTokens.SHORT)
        assert torch.equal(torch.as_tensor(got), tokens("req-7", start, end))
    assert tokens.for_step("req-7", 5, 6) != tokens.for_step("req-8", 5, 6)


def test_schedule_prefill_hand_worked():
    # 100 + 30 + 50 tokens with a budget of 48:
    #   step 1: 48 of request 0; step 2: 48 more; step 3: its last 4, all 30 of
    #   request 1, the first 14 of request 2; step 4: the other 36 of request 2.
    assert schedule_prefill([100, 30, 50], 48) == [
        [(0, 48, 48)],
        [(0, 48, 96)],
        [(0, 4, 100), (1, 30, 30), (2, 14, 14)],
        [(2, 36, 50)],
    ]


def test_schedule_prefill_fits_and_exact_budget():
    assert schedule_prefill([10, 20], 48) == [[(0, 10, 10), (1, 20, 20)]]
    assert schedule_prefill([48, 48], 48) == [[(0, 48, 48)], [(1, 48, 48)]]
    assert schedule_prefill([5], 2) == [[(0, 2, 2)], [(0, 2, 4)], [(0, 1, 5)]]
    assert schedule_prefill([], 8) == []


def test_schedule_prefill_bad_budget():
    with pytest.raises(ValueError, match="max_num_batched_tokens must be positive, got 0"):
        schedule_prefill([4], 0)


@pytest.mark.parametrize("values", [[], [0], [5, -3, 2 ** 62, 7], list(range(1000))])
def test_int64_tensor_equals_torch_tensor(values):
    from replay_backend.batch import int64_tensor

    got = int64_tensor(list(values))
    assert got.dtype == torch.int64 and torch.equal(got, torch.tensor(values, dtype=torch.int64))
    got.add_(1)  # writable, and alive after the list is gone
    assert _list(got) == [v + 1 for v in values]


@pytest.mark.parametrize("qlens, seq_lens, floors", [
    ([1, 250, 60], [700, 250, 260], [0, 122, 0]), ([64, 65, 128], [64, 300, 128], [0, 200, 0])])
def test_attention_row_blocks_tile_each_request_by_position(qlens, seq_lens, floors):
    """Each block covers up to 64 consecutive rows of one request; its fields follow from
    the positions of those rows (the last ``q`` positions of the sequence)."""
    from replay_backend.reference.attention_ops import attn_row_blocks
    from replay_backend.reference.attention_triton import NUM_FIELDS as ATTN_BLOCK_FIELDS

    W, base = 16, [1000 * i for i in range(len(qlens))]
    qsl = [sum(qlens[:i]) for i in range(len(qlens) + 1)]
    got = attn_row_blocks(qsl, seq_lens, floors, base, W).view(-1, ATTN_BLOCK_FIELDS).tolist()
    covered = []
    for row0, n, pos0, cbase, floor, swa0, swa0_floor, glob1, glob2 in got:
        i = max(k for k in range(len(qlens)) if qsl[k] <= row0)
        rows = range(row0, row0 + n)
        assert 1 <= n <= 64 and rows[-1] < qsl[i + 1] and (cbase, floor) == (base[i], floors[i])
        positions = [seq_lens[i] - (qsl[i + 1] - r) for r in rows]
        last = positions[-1]
        assert pos0 == positions[0] and glob1 == last + 1 and glob2 == (last + 1) // 2
        lo = max(positions[0] - W + 1, 0)  # the first key any row of the block may read
        assert swa0 == min(lo, last + 1) and swa0_floor == min(max(lo, floor), last + 1)
        covered.extend(rows)
    assert covered == list(range(qsl[-1]))


# --------------------------------------------------------------------------------------
# A serving runner's metadata buffer (step_metadata.py)
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("qlens, window", [
    ([65] * 4, 512),  # every request one row past a 64-row block: the most blocks per token
    ([1] * 4, 4),  # decodes only
    ([3, 511, 1, 1], 8),  # odd lengths: a pad after every field
    ([509], 4096),  # one request of every token, each row a replay row
])
def test_metadata_capacity_bounds_every_step_of_its_sizes(qlens, window):
    """A step at the buffer's limits (``sum(qlens)`` tokens, ``len(qlens)`` requests),
    ids and positions included, fits in ``metadata_capacity`` exactly placed, with the
    count and rows at the head and every field equal to the same step in fresh memory."""
    from replay_backend.step_metadata import MetadataBuffer, metadata_capacity

    layout = CacheLayout(max_model_len=4096, num_blocks=len(qlens))
    reqs = [R(f"r{i}", q, q + 3 * i) for i, q in enumerate(qlens)]
    buf = MetadataBuffer(metadata_capacity(sum(qlens), len(qlens), VIEW_FIELDS), "cpu")
    got = _build(reqs, layout, window, inputs_in_metadata=True, metadata=buf, view_fields=VIEW_FIELDS)
    want = _build(reqs, layout, window, view_fields=VIEW_FIELDS)
    assert got.replay.count_rows.data_ptr() == buf.data.data_ptr()
    assert got.input_ids.untyped_storage().data_ptr() == buf.data.untyped_storage().data_ptr()
    for a, b in [(got.input_ids, want.input_ids), (got.positions, want.positions),
                 (got.logits_indices, want.logits_indices), (got.view.slot_mapping, want.view.slot_mapping),
                 *[(got.view.derived[k], want.view.derived[k]) for k in VIEW_FIELDS],
                 *[(got.replay.view.derived[k], want.replay.view.derived[k]) for k in VIEW_FIELDS],
                 (got.replay.count_rows, want.replay.count_rows), (got.replay.positions, want.replay.positions),
                 (got.replay.view.slot_mapping, want.replay.view.slot_mapping)]:
        assert torch.equal(a, b)
    assert buf.generation == got.generation == 1 and want.metadata is None


def test_metadata_buffer_refuses_what_it_cannot_hold_and_stale_batches():
    from replay_backend.step_metadata import MetadataBuffer

    layout = CacheLayout(max_model_len=1024, num_blocks=2)
    small = MetadataBuffer(16, "cpu")
    with pytest.raises(ValueError, match=r"step metadata of \d+ elements exceeds the backend's metadata buffer \(16\)"):
        _build([R("a", 20, 20)], layout, 8, metadata=small)
    assert small.generation == 0 and not small.data.any()  # nothing written
    buf = MetadataBuffer(1024, "cpu")
    a = _build([R("a", 20, 20)], layout, 8, metadata=buf)
    a.check_current()
    b = _build([R("b", 5, 5)], layout, 8, metadata=buf)
    b.check_current()
    with pytest.raises(RuntimeError, match="stale StepBatch"):
        a.check_current()
    buf.overwritten()
    with pytest.raises(RuntimeError, match="stale StepBatch"):
        b.check_current()


# --------------------------------------------------------------------------------------
# Misuse: each is refused whole, naming what is wrong, before any state changes
# --------------------------------------------------------------------------------------
def test_a_step_over_the_free_blocks_claims_none_and_the_next_good_step_runs(make_runner):
    runner = make_runner(max_num_seqs=3)
    runner.step([R("a", 4, 4)])
    with pytest.raises(RuntimeError, match=r"needs 3 new blocks and 2 of 3 \(max_num_seqs\) are free"):
        runner.build_batch([R("b", 1, 1), R("c", 1, 1), R("d", 1, 1)])
    assert runner.block_of("e") == 1  # nothing of the refused step was kept
    runner.free("e")
    out = runner.step([R("b", 2, 2), R("c", 3, 3)])
    assert out.batch.view.cache_base == (runner.layout.base(1), runner.layout.base(2))


def test_a_runner_schedules_within_its_backends_token_limit_and_a_refused_step_claims_no_block(
        make_runner, fresh_dynamo, monkeypatch):
    """A runner built with a backend whose max_num_batched_tokens is below its own:
    its prompts are chunked to the backend's limit, a step over it is refused before
    any block is claimed, and a step the backend refuses for any reason keeps none."""
    from replay_backend import ReplayBackend

    runner = make_runner(backend=ReplayBackend(compiler="eager", max_num_batched_tokens=64,
                                               cudagraph_capture_sizes=[8, 16]))
    assert runner.max_num_batched_tokens == 64
    with pytest.raises(ValueError, match="step has 100 tokens, more than max_num_batched_tokens=64"):
        runner.build_batch([R("a", 100, 100)])
    assert runner.blocks_given == {}
    got, want = runner.prefill({"a": 100}), make_runner().prefill({"a": 100})
    assert (got["a"] - want["a"]).abs().max() < 1e-4

    def refuse(*args, **kwargs):
        raise ValueError("refused by the backend")

    monkeypatch.setattr(runner.compiled, "build_batch", refuse)
    with pytest.raises(ValueError, match="refused by the backend"):
        runner.build_batch([R("a", 1, 101), R("b", 2, 2)])
    assert runner.blocks_given == {"a": 0}  # "b"'s block given back; "a" holds its own


def test_a_chunk_whose_context_is_not_in_the_cache_is_refused(make_runner):
    runner = make_runner()
    with pytest.raises(ValueError, match=r"request 1 \(req_id='b'\): its chunk starts at position 40, but "
                                         r"the cache holds 0 of its positions"):
        runner.step([R("a", 3, 3), R("b", 1, 41)])
    assert runner.block_of("z") == 0  # refused before any block was claimed
    runner.free("z")
    runner.step([R("b", 30, 30)])
    assert runner.cached_len("b") == 30
    with pytest.raises(ValueError, match=r"starts at position 35, but the cache holds 30"):
        runner.step([R("b", 1, 36)])
    runner.step([R("b", 5, 35)])  # the next chunk, then a decode after it
    runner.step([R("b", 1, 36)])
    assert runner.cached_len("b") == 36
    runner.free("b")  # a freed request's block holds nothing of it
    with pytest.raises(ValueError, match=r"req_id='b'.*the cache holds 0"):
        runner.step([R("b", 1, 37)])


def test_a_batch_from_a_runner_with_another_layout_is_refused_at_run(make_runner):
    mine, other = make_runner(max_model_len=256), make_runner(max_model_len=512)
    batch = other.build_batch([R("a", 5, 5)])
    with pytest.raises(ValueError, match=r"built for cache layout CacheLayout\(max_model_len=512.*this runner has "
                                         r"CacheLayout\(max_model_len=256"):
        mine.run(batch)


@pytest.mark.parametrize("kw, match", [
    (dict(req_id="a", query_len=10.0, seq_len=10), r"RequestChunk.query_len must be an int, got float 10.0"),
    (dict(req_id="a", query_len="10", seq_len=10), r"RequestChunk.query_len must be an int, got str '10'"),
    (dict(req_id="a", query_len=True, seq_len=10), r"query_len must be an int, got bool"),
    (dict(req_id=["a"], query_len=1, seq_len=1), r"req_id must be hashable.*got list \['a'\]"),
    (dict(req_id="a", query_len=1, seq_len=10 ** 20), r"seq_len=100000000000000000000 is beyond the limit of "
                                                       r"2147483647 positions"),
    (dict(req_id="a", query_len=5, seq_len=9, kv_start=4.5), r"kv_start must be an int, got float"),
    (dict(req_id="a", query_len=5, seq_len=9, keep_all=1), r"keep_all must be true or false, got 1"),
])
def test_request_fields_of_the_wrong_type_or_size_raise_naming_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        R(**kw)


@pytest.mark.parametrize("spec, match", [
    ("p:99999999999999999999", r"item 0 'p:99999999999999999999': RequestChunk.query_len=99999999999999999999 "
                               r"is beyond the limit of 2147483647"),
    ("d:1/700,d:1/99999999999", r"item 1 'd:1/99999999999': RequestChunk.seq_len=99999999999 is beyond"),
])
def test_batch_specs_past_the_limits_raise_naming_the_item(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_batch_spec(spec)


def test_request_fields_take_integers_of_any_kind():
    np = pytest.importorskip("numpy")
    assert R("a", np.int64(5), np.int32(9)).context_len == 4
