"""Backend options and capture-size schedules."""
from __future__ import annotations

import importlib.metadata
import logging

import pytest
import torch
from torch import nn

from replay_backend.backend import ReplayBackend
from replay_backend.config import (MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS, ReplayConfig, check_size,
                                   default_capture_sizes, default_replay_capture_sizes, padded_size)
from replay_backend.kv_cache import MAX_MODEL_LEN, MAX_NUM_SLOTS, CacheLayout
from replay_backend.reference.attention_ops import ATTENTION_OPS


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield


# --------------------------------------------------------------------------------------
# Defaults
# --------------------------------------------------------------------------------------
def test_defaults_match_the_documented_values():
    cfg = ReplayConfig.from_options({})
    assert cfg == ReplayConfig.from_options(None) == ReplayConfig()
    assert cfg.decoder_replay_trim_threshold == 768
    assert cfg.max_capture_size == 1024
    assert cfg.max_num_seqs == 256
    assert cfg.max_num_batched_tokens == 16384
    assert cfg.cudagraph_mode == "piecewise" and cfg.graphs_enabled
    assert cfg.compiler == "inductor"
    assert cfg.cudagraph_decoder_replay is True and cfg.decoder_replay is True
    assert cfg.strict is False
    assert cfg.splitting_ops is None  # the model's declared attention ops (passes/roles.py)
    sizes = cfg.capture_sizes()
    assert sizes == default_capture_sizes(1024)
    assert sizes[-1] == 1024
    # default PIECEWISE steps of 768..1024 tokens trim: those sizes exist
    assert [s for s in sizes if s >= 768][0] == 768
    # W=128: bound = min(1024, 256 * 128) = 1024
    assert cfg.replay_capture_sizes(128) == [128, 256, 384, 512, 640, 768, 896, 1024]
    d = cfg.as_dict()
    assert d["decoder_replay_trim_threshold"] == 768 and d["compiler"] == "inductor"
    assert d["splitting_ops"] is None
    assert ReplayConfig.from_options({"splitting_ops": ["a::b"]}).as_dict()["splitting_ops"] == ["a::b"]


def test_max_capture_size_follows_explicit_sizes_and_token_budget():
    assert ReplayConfig.from_options({"cudagraph_capture_sizes": [4, 64, 8]}).max_capture_size == 64
    assert ReplayConfig.from_options({"max_num_batched_tokens": 512}).max_capture_size == 512
    assert ReplayConfig.from_options({"max_cudagraph_capture_size": 96}).capture_sizes()[-1] == 96


def test_mode_is_accepted_and_max_autotune_reaches_inductor():
    for mode in (None, "default", "reduce-overhead", "max-autotune-no-cudagraphs"):
        ReplayConfig.from_options({}, mode)
    assert ReplayConfig.from_options({}, "max-autotune").inductor_mode == "max-autotune"
    assert ReplayConfig.from_options({}, "default").inductor_mode is None


# --------------------------------------------------------------------------------------
# Invalid options: ValueError naming the key
# --------------------------------------------------------------------------------------
BAD_OPTIONS = [
    ({"bogus": 1}, "bogus"),
    ({"inductor_mode": "max-autotune"}, "inductor_mode"),  # internal field, not an option
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"max_num_seqs": -3}, "max_num_seqs"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
    ({"decoder_replay_trim_threshold": 0}, "decoder_replay_trim_threshold"),
    ({"decoder_replay_trim_threshold": 2.5}, "decoder_replay_trim_threshold"),
    ({"decoder_replay_trim_threshold": True}, "decoder_replay_trim_threshold"),
    ({"max_cudagraph_capture_size": 0}, "max_cudagraph_capture_size"),
    ({"max_cudagraph_capture_size": "64"}, "max_cudagraph_capture_size"),
    ({"max_cudagraph_capture_size": 4096, "max_num_batched_tokens": 2048}, "max_cudagraph_capture_size"),
    ({"cudagraph_capture_sizes": [0, 8]}, "cudagraph_capture_sizes"),
    ({"cudagraph_capture_sizes": [8, -1]}, "cudagraph_capture_sizes"),
    ({"cudagraph_capture_sizes": []}, "cudagraph_capture_sizes"),
    ({"cudagraph_capture_sizes": 8}, "cudagraph_capture_sizes"),
    ({"cudagraph_capture_sizes": [8, 4096], "max_num_batched_tokens": 2048}, "cudagraph_capture_sizes"),
    ({"cudagraph_capture_sizes": [8, 128], "max_cudagraph_capture_size": 64}, "cudagraph_capture_sizes"),
    ({"decoder_replay_cudagraph_capture_sizes": [0]}, "decoder_replay_cudagraph_capture_sizes"),
    ({"decoder_replay_cudagraph_capture_sizes": [128, 4096], "max_num_batched_tokens": 2048},
     "decoder_replay_cudagraph_capture_sizes"),
    ({"cudagraph_mode": "fully"}, "cudagraph_mode"),
    ({"cudagraph_mode": None}, "cudagraph_mode"),
    ({"compiler": "aot_eager"}, "compiler"),
    ({"cudagraph_decoder_replay": "yes"}, "cudagraph_decoder_replay"),
    ({"cudagraph_decoder_replay": 1}, "cudagraph_decoder_replay"),
    ({"decoder_replay": 0}, "decoder_replay"),
    ({"strict": "false"}, "strict"),
    ({"debug_check_addresses": None}, "debug_check_addresses"),
    ({"splitting_ops": []}, "splitting_ops"),
    ({"splitting_ops": ["not_an_op"]}, "splitting_ops"),
]


@pytest.mark.parametrize("options,key", BAD_OPTIONS, ids=[f"{k}-{i}" for i, (_, k) in enumerate(BAD_OPTIONS)])
def test_invalid_options_raise_value_error_naming_the_key(options, key):
    with pytest.raises(ValueError) as e:
        ReplayConfig.from_options(options)
    assert key in str(e.value)


@pytest.mark.parametrize("value", [5, ["out"]])
def test_debug_dump_path_must_be_a_path(value):
    with pytest.raises(ValueError, match="debug_dump_path"):
        ReplayConfig.from_options({"debug_dump_path": value})


def test_bad_mode_raises_naming_mode():
    with pytest.raises(ValueError, match="mode"):
        ReplayConfig.from_options({}, mode="bogus")


def test_threshold_must_exceed_the_window():
    cfg = ReplayConfig.from_options({"decoder_replay_trim_threshold": 128})
    for w in (128, 129, 1024):
        with pytest.raises(ValueError, match="smaller graphs have nothing to trim") as e:
            cfg.check_window(w)
        assert "decoder_replay_trim_threshold" in str(e.value)
    cfg.check_window(127)  # no error
    ReplayConfig().check_window(128)


def test_explicit_lists_are_sorted_and_deduped():
    cfg = ReplayConfig.from_options({
        "cudagraph_capture_sizes": [64, 8, 16, 8, 1, 64],
        "decoder_replay_cudagraph_capture_sizes": (48, 16, 48, 32),
        "decoder_replay_trim_threshold": 24,
    })
    assert cfg.capture_sizes() == [1, 8, 16, 64]
    assert cfg.replay_capture_sizes(16) == [16, 32, 48]
    assert cfg.max_capture_size == 64
    # a comma-separated string is accepted for splitting_ops (CLI style)
    ops = ReplayConfig.from_options({"splitting_ops": "a::b,c::d"}).splitting_ops
    assert tuple(ops) == ("a::b", "c::d")


def test_switches_turn_schedules_off():
    assert ReplayConfig.from_options({"cudagraph_mode": "none"}).capture_sizes() == []
    assert ReplayConfig.from_options({"cudagraph_mode": "none"}).replay_capture_sizes(16) == []
    assert ReplayConfig.from_options({"cudagraph_decoder_replay": False}).replay_capture_sizes(16) == []
    assert ReplayConfig.from_options({"decoder_replay": False}).replay_capture_sizes(16) == []
    # explicit replay sizes do not bring replay graphs back when the switch is off
    cfg = ReplayConfig.from_options({"cudagraph_decoder_replay": False,
                                     "decoder_replay_cudagraph_capture_sizes": [16, 32]})
    assert cfg.replay_capture_sizes(16) == []


# --------------------------------------------------------------------------------------
# Sizes against their limits, where they are given
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("options, match", [
    ({"max_num_batched_tokens": 2 ** 40}, r"option max_num_batched_tokens: 1099511627776 is above the limit of 1048576"),
    ({"max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS + 1}, r"max_num_batched_tokens: 1048577 is above the limit"),
    ({"max_num_seqs": 2 ** 40}, r"option max_num_seqs: 1099511627776 is above the limit of 1048576"),
    ({"decoder_replay_trim_threshold": 2 ** 40}, r"option decoder_replay_trim_threshold: 1099511627776 is above"),
    ({"cudagraph_capture_sizes": [8, 2 ** 40]}, r"option cudagraph_capture_sizes: size 1099511627776 is above"),
    ({"max_cudagraph_capture_size": 2 ** 40}, r"option max_cudagraph_capture_size: 1099511627776 is above"),
    ({"decoder_replay_cudagraph_capture_sizes": [2 ** 40]}, r"decoder_replay_cudagraph_capture_sizes: size 1099511627776"),
])
def test_sizes_past_their_limits_are_refused_naming_the_option(options, match):
    with pytest.raises(ValueError, match=match):
        ReplayConfig.from_options(options)


def test_sizes_at_their_limits_are_taken():
    cfg = ReplayConfig.from_options({"max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS, "max_num_seqs": MAX_NUM_SEQS})
    assert (cfg.max_num_batched_tokens, cfg.max_num_seqs) == (2 ** 20, 2 ** 20)
    np = pytest.importorskip("numpy")  # numpy's integers are integers
    cfg = ReplayConfig.from_options({"max_num_seqs": np.int64(8), "cudagraph_capture_sizes": [np.int32(16), 8]})
    assert cfg.max_num_seqs == 8 and type(cfg.max_num_seqs) is int and cfg.cudagraph_capture_sizes == (8, 16)


@pytest.mark.parametrize("kw, match", [
    (dict(max_model_len=2 ** 40, num_blocks=4), r"CacheLayout.max_model_len=1099511627776 is above the limit of 16777216"),
    (dict(max_model_len=MAX_MODEL_LEN + 2, num_blocks=1), r"max_model_len=16777218 is above the limit"),
    (dict(max_model_len=131072, num_blocks=20000),
     r"max_model_len=131072 x num_blocks=20000 .* = 2621440000 slots and the pad slot, above the limit of 2147483647"),
    (dict(max_model_len=MAX_MODEL_LEN, num_blocks=128), r"2147483648 slots and the pad slot, above the limit"),
    (dict(max_model_len=64.0, num_blocks=2), r"CacheLayout.max_model_len must be an integer, got float 64.0"),
    (dict(max_model_len="64", num_blocks=2), r"CacheLayout.max_model_len must be an integer, got str '64'"),
    (dict(max_model_len=64, num_blocks=True), r"CacheLayout.num_blocks must be an integer, got bool True"),
    (dict(max_model_len=64, num_blocks=-1), r"CacheLayout.num_blocks must be positive"),
])
def test_cache_layout_refuses_sizes_past_its_limits(kw, match):
    with pytest.raises(ValueError, match=match):
        CacheLayout(**kw)


def test_cache_layout_at_its_limits():
    assert CacheLayout(MAX_MODEL_LEN, 127).num_slots + 1 <= MAX_NUM_SLOTS
    with pytest.raises(ValueError, match=r"block 3 is outside \[0, num_blocks=3\)"):
        CacheLayout(64, 3).base(3)


def test_a_runner_refuses_a_huge_cache_before_allocating_it(model):
    """The runner builds its layout first: 2**40 positions fail there, naming the
    field, not in the allocator asking for terabytes."""
    from replay_backend.reference.runner import StepRunner

    with pytest.raises(ValueError, match=r"max_model_len=1099511627776 is above the limit"):
        StepRunner(model, max_model_len=2 ** 40)
    with pytest.raises(ValueError, match=r"num_blocks=100000 .* above the limit of 2147483647"):
        StepRunner(model, max_model_len=2 ** 16, max_num_seqs=100_000)


def test_check_size_names_the_value_and_the_limit():
    assert check_size("n", 5, hi=8) == 5
    with pytest.raises(ValueError, match=r"^n=9 is above the limit of 8 \(why\)$"):
        check_size("n", 9, hi=8, why="why")
    with pytest.raises(ValueError, match=r"n must be an integer, got float 2.0"):
        check_size("n", 2.0)
    with pytest.raises(ValueError, match=r"n must be >= 1, got 0"):
        check_size("n", 0)


# --------------------------------------------------------------------------------------
# Option and argument types
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("options", ["compiler=eager", [("compiler", "eager")], 5, b"x"])
def test_options_must_be_a_mapping(options):
    with pytest.raises(ValueError, match=r"options must be a dict of option names to values, got .*"
                                         r"e\.g\. options=\{'compiler': 'eager'"):
        ReplayConfig.from_options(options)


def test_option_names_must_be_strings():
    with pytest.raises(ValueError, match="option names must be strings, got 1"):
        ReplayConfig.from_options({1: 2, "compiler": "eager"})


@pytest.mark.parametrize("key", ["cudagraph_capture_sizes", "decoder_replay_cudagraph_capture_sizes"])
@pytest.mark.parametrize("value, match", [
    ({8: 1, 16: 2}, r"must be a list \(e\.g\. \[1, 2, 4, 8\]\), got dict"),
    ([8.0, 16], r"size must be an integer, got float 8.0"),
    (["8"], r"size must be an integer, got str '8'"),
    ([True, 16], r"size must be an integer, got bool True"),
    ([16, None], r"size must be an integer, got NoneType"),
    (16, r"must be a list .*got int 16"),
    ("8,16", r"must be a list .*got str '8,16'"),
])
def test_size_lists_refuse_what_is_not_a_list_of_integers(key, value, match):
    with pytest.raises(ValueError, match=f"option {key}.*{match}"):
        ReplayConfig.from_options({key: value})
    with pytest.raises(ValueError, match=f"option {key}"):  # built directly, too
        ReplayConfig(**{key: value})


def test_size_lists_take_sets_and_ranges_sorted():
    cfg = ReplayConfig.from_options({"cudagraph_capture_sizes": {64, 8, 16},
                                     "decoder_replay_cudagraph_capture_sizes": range(16, 49, 16),
                                     "decoder_replay_trim_threshold": 24})
    assert cfg.cudagraph_capture_sizes == (8, 16, 64) and cfg.decoder_replay_cudagraph_capture_sizes == (16, 32, 48)
    assert ReplayConfig.from_options({"splitting_ops": {"a::b"}}).splitting_ops == ("a::b",)
    with pytest.raises(ValueError, match="option splitting_ops must be a list"):
        ReplayConfig.from_options({"splitting_ops": {"a::b": 1}})


@pytest.mark.parametrize("mode, options, match", [
    ("reduce-overhead", {"cudagraph_mode": "none"}, r"mode='reduce-overhead' .* cudagraph_mode='none'"),
    ("max-autotune", {"compiler": "eager"}, r"mode='max-autotune' .* compiler='eager'"),
    ("max-autotune-no-cudagraphs", {"compiler": "eager"}, r"mode='max-autotune-no-cudagraphs' .* compiler='eager'"),
])
def test_a_mode_that_contradicts_an_option_raises_naming_both(mode, options, match):
    with pytest.raises(ValueError, match=match):
        ReplayConfig.from_options(options, mode)


# --------------------------------------------------------------------------------------
# Options a switch turns off: a note, logged once per config
# --------------------------------------------------------------------------------------
NOTED = [
    ({"cudagraph_mode": "none", "cudagraph_capture_sizes": [8, 16]}, "cudagraph_capture_sizes", "cudagraph_mode"),
    ({"cudagraph_mode": "none", "max_cudagraph_capture_size": 64}, "max_cudagraph_capture_size", "cudagraph_mode"),
    ({"cudagraph_mode": "none", "debug_check_addresses": True}, "debug_check_addresses", "cudagraph_mode"),
    ({"cudagraph_mode": "none", "cudagraph_decoder_replay": True}, "cudagraph_decoder_replay", "cudagraph_mode"),
    ({"decoder_replay": False, "cudagraph_decoder_replay": True}, "cudagraph_decoder_replay", "decoder_replay"),
    ({"cudagraph_mode": "none", "decoder_replay_cudagraph_capture_sizes": [16]},
     "decoder_replay_cudagraph_capture_sizes", "cudagraph_mode"),
    ({"decoder_replay": False, "decoder_replay_cudagraph_capture_sizes": [16]},
     "decoder_replay_cudagraph_capture_sizes", "decoder_replay"),
    ({"cudagraph_decoder_replay": False, "decoder_replay_cudagraph_capture_sizes": [16]},
     "decoder_replay_cudagraph_capture_sizes", "cudagraph_decoder_replay"),
    ({"decoder_replay": False, "decoder_replay_trim_threshold": 500}, "decoder_replay_trim_threshold",
     "decoder_replay"),
    ({"decoder_replay": False, "decoder_replay_trim_threshold": 768}, "decoder_replay_trim_threshold",
     "decoder_replay"),  # given, even at its default
    ({"cudagraph_decoder_replay": False, "decoder_replay_trim_threshold": 500}, "decoder_replay_trim_threshold",
     "cudagraph_decoder_replay"),
    ({"cudagraph_mode": "none", "decoder_replay_trim_threshold": 500}, "decoder_replay_trim_threshold",
     "cudagraph_mode"),
    ({"decoder_replay": False, "trim_io_graphs": True}, "trim_io_graphs", "decoder_replay"),
    ({"cudagraph_mode": "none", "trim_io_graphs": True}, "trim_io_graphs", "cudagraph_mode"),
    ({"decoder_replay": False, "metadata_in_place": True}, "metadata_in_place", "decoder_replay"),
    ({"trim_io_graphs": False, "metadata_in_place": True}, "metadata_in_place", "trim_io_graphs"),
    ({"decoder_replay": False, "max_num_seqs": 64}, "max_num_seqs", "decoder_replay"),
    ({"decoder_replay_cudagraph_capture_sizes": [16, 32], "max_num_seqs": 64}, "max_num_seqs",
     "decoder_replay_cudagraph_capture_sizes"),
    ({"cudagraph_mode": "full", "metadata_in_place": False}, "metadata_in_place", "cudagraph_mode='full'"),
    ({"cudagraph_mode": "full", "cudagraph_decoder_replay": True}, "cudagraph_decoder_replay",
     "cudagraph_mode='full'"),
    ({"cudagraph_mode": "full_decode_only", "decoder_replay_cudagraph_capture_sizes": [16]},
     "decoder_replay_cudagraph_capture_sizes", "cudagraph_mode='full_decode_only'"),
]


@pytest.mark.parametrize("options, key, switch", NOTED, ids=[f"{k}-{s}-{i}" for i, (_, k, s) in enumerate(NOTED)])
def test_an_option_a_switch_turns_off_is_noted_once_naming_both(options, key, switch, caplog, monkeypatch):
    with caplog.at_level(logging.WARNING, logger="replay_backend"):
        ReplayConfig.from_options(options)  # a config alone says nothing: its backend does
        ReplayBackend(ReplayConfig.from_options(dict(options)))  # once per backend state
    notes = [r.getMessage() for r in caplog.records if r.name == "replay_backend"]
    assert len(notes) == 1, notes
    assert f"option {key}" in notes[0] and switch in notes[0], notes[0]
    assert ReplayConfig.from_options(options).notes() == [notes[0]]


def test_debug_check_ranks_without_tensor_parallel_ranks_is_noted(caplog):
    with caplog.at_level(logging.WARNING, logger="replay_backend"):
        ReplayBackend(debug_check_ranks=True)
    (note,) = [r.getMessage() for r in caplog.records if r.name == "replay_backend"]
    assert "debug_check_ranks=True has no effect" in note and "tp_group" in note


def test_a_config_built_directly_notes_what_differs_from_the_defaults(caplog, monkeypatch):
    with caplog.at_level(logging.WARNING, logger="replay_backend"):
        ReplayBackend(ReplayConfig(decoder_replay=False, decoder_replay_trim_threshold=500))
        ReplayBackend(ReplayConfig(decoder_replay=False, decoder_replay_trim_threshold=600))  # another: noted too
    notes = [r.getMessage() for r in caplog.records if r.name == "replay_backend"]
    assert len(notes) == 2 and all("decoder_replay_trim_threshold" in n and "decoder_replay=False" in n
                                   for n in notes), notes


@pytest.mark.parametrize("options, mode", [
    ({}, None),
    ({"cudagraph_mode": "none", "decoder_replay": False}, None),  # the bench's "off" mode
    ({"cudagraph_mode": "none", "cudagraph_decoder_replay": False}, None),  # "parent"
    ({"cudagraph_decoder_replay": False}, None),  # "piecewise"
    ({"decoder_replay": False, "trim_io_graphs": False, "metadata_in_place": False}, None),  # agrees with it
    ({"cudagraph_capture_sizes": [8, 16], "max_cudagraph_capture_size": 64}, None),
    ({"cudagraph_mode": "none"}, "max-autotune"),
])
def test_options_that_agree_with_the_switches_are_not_noted(options, mode, caplog, monkeypatch):
    with caplog.at_level(logging.WARNING, logger="replay_backend"):
        assert ReplayBackend(ReplayConfig.from_options(options, mode)).config.notes() == []
    assert not caplog.records


def test_mode_without_cudagraphs_notes_that_this_backends_graphs_stay_on(caplog, monkeypatch):
    with caplog.at_level(logging.WARNING, logger="replay_backend"):
        ReplayBackend(ReplayConfig.from_options({}, "max-autotune-no-cudagraphs"))
    (note,) = [r.getMessage() for r in caplog.records]
    assert "max-autotune-no-cudagraphs" in note and "cudagraph_mode" in note
    assert ReplayConfig.from_options({"cudagraph_mode": "none"}, "max-autotune-no-cudagraphs").notes() == []


def test_config_fields_for_the_notes_stay_internal():
    cfg = ReplayConfig.from_options({"decoder_replay": False})
    assert "_given" not in cfg.as_dict() and cfg == ReplayConfig(decoder_replay=False)
    with pytest.raises(ValueError, match="unknown dsv41_replay option"):
        ReplayConfig.from_options({"_given": frozenset()})


def test_process_groups_given_as_options_are_refused_saying_where_they_go():
    with pytest.raises(ValueError, match=r"unknown dsv41_replay option\(s\) \['tp_group'\].*tp_group are process "
                                         r"groups, not options: pass them to ReplayBackend\(tp_group=...\)"):
        ReplayConfig.from_options({"tp_group": object(), "compiler": "eager"})


# --------------------------------------------------------------------------------------
# The replay boundary's window
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("window", [0, -16, 2.0, True, "16", None, 2 ** 40])
def test_replay_begin_refuses_a_bad_window_naming_it(window):
    from replay_backend.tracing.boundary import replay_begin

    with pytest.raises(ValueError, match=r"replay_begin: window must be the model's sliding window, an int in "
                                         r"\[1, 16777216\]"):
        replay_begin(torch.zeros(4, 2), window=window)


@pytest.mark.parametrize("call, match", [
    (lambda: default_replay_capture_sizes(0, 64, 4), r"^window must be >= 1, got 0$"),
    (lambda: default_replay_capture_sizes(16.0, 64, 4), r"^window must be an integer, got float 16.0$"),
    (lambda: default_replay_capture_sizes(16, 0, 4), r"^max_cudagraph_capture_size must be >= 1"),
    (lambda: default_replay_capture_sizes(16, 64, -1), r"^max_num_seqs must be >= 1"),
    (lambda: default_capture_sizes(0), r"^max_size must be >= 1"),
    (lambda: ReplayConfig().check_window(0), r"replay region's window .* must be >= 1, got 0"),
    (lambda: ReplayConfig().replay_capture_sizes(-16), r"^window must be >= 1, got -16"),
])
def test_schedules_refuse_a_bad_window_or_bound(call, match):
    """A window of 0 stepped the replay schedule by 2**-4 (a float) towards its bound."""
    with pytest.raises(ValueError, match=match):
        call()


def test_replay_begin_needs_tensors():
    from replay_backend.tracing.boundary import replay_begin

    with pytest.raises(ValueError, match="replay_begin: needs the region's row-indexed tensors"):
        replay_begin(window=16)
    with pytest.raises(ValueError, match=r"got \['Tensor', 'list'\]"):
        replay_begin(torch.zeros(4, 2), [1], window=16)
    (out,) = replay_begin(torch.ones(4, 2), window=16)  # outside a step: the identity
    assert torch.equal(out, torch.ones(4, 2))


# --------------------------------------------------------------------------------------
# Schedules and dispatch
# --------------------------------------------------------------------------------------
def test_default_replay_capture_sizes_w128_bound_1024():
    assert default_replay_capture_sizes(128, 1024, 256) == [128, 256, 384, 512, 640, 768, 896, 1024]
    # the bound is min(max capture size, max_num_seqs * W)
    assert default_replay_capture_sizes(128, 4096, 8) == [128, 256, 384, 512, 640, 768, 896, 1024]


def test_default_replay_capture_sizes_w128_bound_4096():
    sizes = default_replay_capture_sizes(128, 4096, 256)
    assert len(sizes) == 24
    assert sizes == sorted(set(sizes))
    assert sizes[0] == 128 and sizes[-1] == 4096
    assert {2048, 2304, 4096} <= set(sizes)
    below = [s for s in sizes if s <= 2048]
    above = [s for s in sizes if s >= 2048]
    assert below == list(range(128, 2049, 128))  # step W up to 16 * W
    assert above == list(range(2048, 4097, 256))  # then 1/8 of [2048, 4096)


def test_default_replay_capture_sizes_non_power_bound():
    # max_num_seqs * W (3 * 16 = 48) below the max capture size (1024)
    assert default_replay_capture_sizes(16, 1024, 3) == [16, 32, 48]
    # a bound that is not a multiple of the step is still the last size
    assert default_replay_capture_sizes(16, 40, 8) == [16, 32, 40]
    # non-power max capture size
    assert default_replay_capture_sizes(128, 1000, 256) == [128, 256, 384, 512, 640, 768, 896, 1000]
    # the small test config: W=16, max capture 64, 4 sequences
    assert default_replay_capture_sizes(16, 64, 4) == [16, 32, 48, 64]
    # W=16 beyond 16*W: steps of 32 (1/8 of [256, 512)) then 64
    sizes = default_replay_capture_sizes(16, 1024, 256)
    assert sizes == list(range(16, 257, 16)) + list(range(288, 513, 32)) + list(range(576, 1025, 64))


@pytest.mark.parametrize("sizes", [[16, 32, 48, 64], default_replay_capture_sizes(128, 4096, 256),
                                   default_capture_sizes(1024)])
def test_padded_size_dispatch(sizes):
    top = max(sizes)
    assert padded_size(sizes, 1) == min(sizes)
    assert padded_size(sizes, top - 1) == top
    assert padded_size(sizes, top) == top
    assert padded_size(sizes, top + 1) is None
    for s in sizes:
        assert padded_size(sizes, s) == s
    for a, b in zip(sizes, sizes[1:]):
        assert padded_size(sizes, a + 1) == b


def test_default_capture_sizes():
    sizes = default_capture_sizes(1024)
    assert sizes[:5] == [1, 2, 4, 8, 16]
    assert sizes[-1] == 1024
    assert sizes == sorted(set(sizes))
    assert [s for s in sizes if 8 <= s <= 256] == list(range(8, 257, 8))
    assert [s for s in sizes if s >= 256] == list(range(256, 1025, 16))
    assert default_capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert default_capture_sizes(100)[-2:] == [96, 100]  # the bound is always included
    assert default_capture_sizes(3) == [1, 2, 3]


# --------------------------------------------------------------------------------------
# Through torch.compile
# --------------------------------------------------------------------------------------
def test_entry_point_is_registered():
    names = {e.name for e in importlib.metadata.entry_points(group="torch_dynamo_backends")}
    assert "dsv41_replay" in names
    assert "dsv41_replay" in torch._dynamo.list_backends(exclude_tags=())


def _tiny_module():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval()


def test_compile_with_unknown_option_raises_naming_it():
    m = _tiny_module()
    compiled = torch.compile(m, backend="dsv41_replay", options={"bogus": 1})
    with pytest.raises(Exception) as e, torch.no_grad():
        compiled(torch.randn(3, 4))
    assert "bogus" in str(e.value)
    assert isinstance(e.value, ValueError) or "ValueError" in str(e.value)


def test_compile_with_bad_value_raises_naming_it():
    m = _tiny_module()
    compiled = torch.compile(m, backend="dsv41_replay", options={"cudagraph_mode": "fully"})
    with pytest.raises(Exception, match="cudagraph_mode"), torch.no_grad():
        compiled(torch.randn(3, 4))


def test_compile_by_name_runs_a_plain_model():
    """A graph without markers or attention still runs (one piece, no replay region)."""
    m = _tiny_module()
    compiled = torch.compile(m, backend="dsv41_replay", options={"compiler": "eager"})
    x = torch.randn(5, 4)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), m(x))


def test_torch_compile_refuses_a_threshold_within_the_window_on_its_first_call(model, fresh_dynamo):
    """The first call traces static shapes, where nothing could trim: the threshold is
    still checked against the model's window there, not at a later recompile."""
    from replay_backend import RequestChunk, StepRunner
    from replay_backend.compat import dynamo as compat_dynamo

    compiled = torch.compile(model, backend="dsv41_replay",
                             options={"decoder_replay_trim_threshold": 16, "compiler": "eager"})
    runner = StepRunner(model, forward=compiled, max_model_len=256)
    with pytest.raises(Exception) as info:
        runner.step([RequestChunk("a", 20, 20)])
    err = compat_dynamo.user_error(info.value)
    assert err is not None and "option decoder_replay_trim_threshold: 16 must exceed the sliding window W=16" \
        in str(err), info.value


def test_default_splitting_ops_are_the_attention_ops_the_model_declared(model, fresh_dynamo):
    """No splitting_ops option: the backend splits at the ops the model declared
    attention ops (``declare_attention``), and the plan names them."""
    from replay_backend import RequestChunk, ReplayBackend, StepRunner
    from replay_backend.passes.roles import OpRole, roles_of

    assert roles_of(torch.ops.dsv41.source_attention) == {OpRole.ATTENTION, OpRole.KV_SOURCE}
    assert roles_of(torch.ops.dsv41.swa_attention.default) == {OpRole.ATTENTION}
    be = ReplayBackend(compiler="eager", cudagraph_mode="none")
    StepRunner(model, max_model_len=128, backend=be).step([RequestChunk("a", 20, 20)])
    plan = be.model.plan
    assert sorted(plan.config["splitting_ops"]) == sorted(ATTENTION_OPS)
    assert plan.pieces_by_kind("main")["attention"] == 4 and plan.replay_layers == [4, 7]
