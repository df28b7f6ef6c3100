"""A step's batch writes the cache blocks of the runner that built it, and only those.

A batch carries who built it (``StepBatch.owner``); ``StepRunner.run`` refuses a batch
another runner built, and one that names a block this runner did not give the request
(a stale batch: the request was freed, its block given to another one). The batch
itself refuses a block the layout does not have, or one that two requests share.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from replay_backend.backend import ReplayBackend
from replay_backend.batch import RequestChunk as R, build_step_batch, dummy_step_batch
from replay_backend.kv_cache import CacheLayout
from replay_backend.reference.compare import max_abs_err

from conftest import MAX_MODEL_LEN

LAYOUT = CacheLayout(64, 4)
W = 16


@pytest.fixture(autouse=True)
def _threads(one_thread):
    yield


def _tokens(reqs):
    return [[1] * r.query_len for r in reqs]


def _decode_err(runner, oracle, req_id, seq_len) -> float:
    """How far ``runner``'s decode of ``req_id`` at ``seq_len`` is from ``oracle``'s."""
    step = [R(req_id, 1, seq_len)]
    return max_abs_err(runner.step(step).logits, oracle.step(step).logits)


def _own_batch(runner, reqs, blocks, **kw):
    """A batch built with ``build_step_batch`` for ``runner``'s cache, owned by it."""
    tokens = [runner.tokens(r.req_id, r.context_len, r.seq_len) for r in reqs]
    return build_step_batch(reqs, tokens, blocks, runner.layout, runner.cfg.window, runner.device,
                            view_fields=runner.view_fields, owner=runner, **kw)


# --------------------------------------------------------------------------------------
# The owner a batch carries
# --------------------------------------------------------------------------------------
def test_a_batch_carries_who_built_it(make_runner):
    reqs = [R("a", 3, 3)]
    assert build_step_batch(reqs, _tokens(reqs), [0], LAYOUT, W, "cpu").owner is None
    marker = object()
    batch = build_step_batch(reqs, _tokens(reqs), [0], LAYOUT, W, "cpu", owner=marker)
    assert batch.owner is marker
    assert dataclasses.replace(batch, window=W).owner is marker  # kept by a copy
    assert "owner" not in repr(batch)
    runner = make_runner()
    assert runner.build_batch(reqs).owner is runner
    assert runner.dummy_batch(8).owner is None


def test_a_served_batch_carries_its_runner(model, make_runner, fresh_dynamo):
    """Built through the compiled model (ReplayCompiled.build_batch, the backend's) in its
    metadata buffer, the batch still names the runner."""
    rc = make_runner(max_num_seqs=4, backend=ReplayBackend(compiler="eager", cudagraph_mode="none"))
    rc.capture()
    batch = rc.build_batch([R("a", 5, 5)])
    assert batch.metadata is not None and batch.owner is rc
    with torch.inference_mode():
        assert rc.compiled.build_batch([R("b", 2, 2)], [[1, 2]], [1], owner="x").owner == "x"
        assert rc.backend.build_batch([R("b", 2, 2)], [[1, 2]], [1]).owner is None


# --------------------------------------------------------------------------------------
# Blocks the batch itself refuses
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("block, match", [
    (4, r"request 1 \(req_id='b'\): cache block 4 is outside \[0, 4\)"),
    (-1, r"request 1 \(req_id='b'\): cache block -1 is outside \[0, 4\)"),
    (10 ** 30, r"request 1 \(req_id='b'\): cache block 10+ is outside"),
    (1.0, r"request 1 \(req_id='b'\): cache block must be an int, got float 1.0"),
    ("1", r"request 1 \(req_id='b'\): cache block must be an int, got str '1'"),
    (None, r"request 1 \(req_id='b'\): cache block must be an int, got NoneType None"),
    (True, r"request 1 \(req_id='b'\): cache block must be an int, got bool True"),
    (0, r"request 1 \(req_id='b'\): cache block 0 is request 0's \(req_id='a'\) too"),
])
def test_a_block_the_layout_has_not_or_two_requests_share_is_refused(block, match):
    reqs = [R("a", 3, 3), R("b", 2, 2)]
    with pytest.raises(ValueError, match=match):
        build_step_batch(reqs, _tokens(reqs), [0, block], LAYOUT, W, "cpu")


def test_integer_blocks_of_any_kind_are_taken():
    reqs = [R("a", 3, 3), R("b", 2, 2)]
    batch = build_step_batch(reqs, _tokens(reqs), [np.int64(3), torch.tensor(1)], LAYOUT, W, "cpu")
    assert batch.view.cache_base == (3 * 64, 64)
    assert batch.view.slot_mapping.tolist() == [192, 193, 194, 64, 65]


def test_a_dummy_batch_may_put_every_request_in_one_block():
    """Its writes all go to the pad slot: no block is written, so sharing one is fine."""
    batch = dummy_step_batch(40, LAYOUT, W, "cpu")
    assert len(batch.requests) == 3 and batch.view.cache_base == (0, 0, 0)
    assert set(batch.view.slot_mapping.tolist()) == {LAYOUT.pad_slot}
    reqs = [R("a", 3, 3), R("b", 2, 2)]
    build_step_batch(reqs, _tokens(reqs), [1, 1], LAYOUT, W, "cpu", pad_writes=True)
    with pytest.raises(ValueError, match="outside"):  # reads still need a block of the layout
        build_step_batch(reqs, _tokens(reqs), [1, 4], LAYOUT, W, "cpu", pad_writes=True)


# --------------------------------------------------------------------------------------
# Batches a runner refuses to run
# --------------------------------------------------------------------------------------
def test_a_batch_built_by_another_runner_with_the_same_layout_is_refused(make_runner):
    """Another runner's batch would write its own request's KV into this runner's block
    0, which this runner gave the victim: the victim's next decode would be 0.52 off."""
    victim, other, oracle = make_runner(), make_runner(), make_runner()
    for r in (victim, oracle):
        r.step([R("v", 20, 20)])
    foreign = other.build_batch([R("x", 20, 20)])
    assert foreign.layout == victim.layout and foreign.view.cache_base == (0,)
    assert victim.block_of("v") == 0
    with pytest.raises(ValueError, match=r"built by another runner \(StepRunner at 0x[0-9a-f]+\), not by this "
                                         r"one.*request 0 \(req_id='x'\) in block 0.*this runner's build_batch"):
        victim.run(foreign)
    assert victim.cached_len("x") == 0
    assert _decode_err(victim, oracle, "v", 21) < 1e-5
    other.run(foreign)  # its own runner runs it


def test_a_foreign_batch_is_refused_on_a_compiled_runner(model, make_runner, fresh_dynamo):
    rc = make_runner(max_num_seqs=4, backend=ReplayBackend(compiler="eager", cudagraph_mode="none"))
    oracle, other = make_runner(max_num_seqs=4), make_runner(max_num_seqs=4)
    rc.capture()
    for r in (rc, oracle):
        r.step([R("v", 20, 20)])
    with pytest.raises(ValueError, match="built by another runner"):
        rc.run(other.build_batch([R("x", 20, 20)]))
    assert _decode_err(rc, oracle, "v", 21) < 1e-4
    served = rc.build_batch([R("y", 6, 6)])
    with pytest.raises(ValueError, match="built by another runner"):
        oracle.run(served)
    rc.run(served)


def test_a_batch_from_a_runner_with_another_cache_is_refused(make_runner):
    mine, other = make_runner(max_num_seqs=4), make_runner(max_num_seqs=8)
    with pytest.raises(ValueError, match=r"built for cache layout.*this runner's build_batch"):
        mine.run(other.build_batch([R("a", 5, 5)]))
    assert mine.cached_len("a") == 0


def test_a_stale_batch_whose_block_was_given_to_another_request_is_refused(make_runner):
    runner, oracle = make_runner(), make_runner()
    stale = runner.build_batch([R("a", 20, 20)])  # block 0
    runner.free("a")
    for r in (runner, oracle):
        r.step([R("b", 20, 20)])  # block 0 again
    assert runner.block_of("b") == 0
    with pytest.raises(ValueError, match=r"request 0 \(req_id='a'\): the batch writes cache block 0, but this "
                                         r"runner holds no block for it.*block 0 is request 'b'.*build it with "
                                         r"this runner's build_batch"):
        runner.run(stale)
    assert runner.cached_len("a") == 0
    assert _decode_err(runner, oracle, "b", 21) < 1e-5


def test_a_stale_batch_of_a_request_given_another_block_is_refused(make_runner):
    runner, oracle = make_runner(), make_runner()
    for r in (runner, oracle):
        r.step([R("a", 20, 20)])
    stale = runner.build_batch([R("a", 1, 21)])  # a decode, block 0
    runner.free("a")
    for r in (runner, oracle):
        r.step([R("b", 20, 20)])  # block 0
        r.free("a")
        r.step([R("a", 20, 20)])  # block 1
    assert runner.block_of("a") == 1
    with pytest.raises(ValueError, match=r"request 0 \(req_id='a'\): the batch writes cache block 0, but this "
                                         r"runner gave the request block 1"):
        runner.run(stale)
    assert _decode_err(runner, oracle, "b", 21) < 1e-5
    assert _decode_err(runner, oracle, "a", 21) < 1e-5


def test_a_stale_batch_of_a_request_freed_and_given_its_block_again_is_refused(make_runner):
    """The same block, but the cache no longer holds the context the batch reads."""
    runner = make_runner()
    runner.step([R("a", 20, 20)])
    stale = runner.build_batch([R("a", 1, 21)])
    runner.free("a")
    assert runner.block_of("a") == 0
    with pytest.raises(ValueError, match=r"request 0 \(req_id='a'\): its chunk starts at position 20, but the "
                                         r"cache holds 0"):
        runner.run(stale)
    assert runner.cached_len("a") == 0


def test_a_batch_naming_blocks_this_runner_never_gave_is_refused(make_runner):
    runner, oracle = make_runner(), make_runner()
    for r in (runner, oracle):
        r.step([R("v", 20, 20)])
    # Its own id, but blocks this runner never gave: block 0 is the victim's.
    with pytest.raises(ValueError, match=r"request 1 \(req_id='x'\): the batch writes cache block 0, but this "
                                         r"runner holds no block for it.*block 0 is request 'v'"):
        runner.run(_own_batch(runner, [R("y", 4, 4), R("x", 20, 20)], [runner.block_of("y"), 0]))
    other = runner.block_of("w")
    with pytest.raises(ValueError, match=rf"request 0 \(req_id='v'\): the batch writes cache block {other}, but "
                                         r"this runner gave the request block 0"):
        runner.run(_own_batch(runner, [R("v", 1, 21)], [other]))
    assert _decode_err(runner, oracle, "v", 21) < 1e-5
    # No owner at all: refused too, whichever blocks it names.
    reqs = [R("v", 1, 22)]
    ownerless = build_step_batch(reqs, [runner.tokens("v", 21, 22)], [0], runner.layout, W, "cpu",
                                 view_fields=runner.view_fields)
    with pytest.raises(ValueError, match=r"built without an owner.*this runner's build_batch"):
        runner.run(ownerless)
    assert runner.cached_len("v") == 21


def test_a_batch_of_the_runner_built_directly_runs(make_runner):
    """build_step_batch with ``owner=`` the runner and the blocks it gave: accepted."""
    runner, oracle = make_runner(), make_runner()
    reqs = [R("a", 20, 20), R("b", 7, 7)]
    blocks = [runner.block_of(r.req_id) for r in reqs]
    got = runner.run(_own_batch(runner, reqs, blocks))
    assert runner.cached_len("a") == 20 and runner.cached_len("b") == 7
    assert max_abs_err(got.logits, oracle.step(reqs).logits) < 1e-5


def test_a_dummy_batch_runs_and_leaves_the_requests_as_they_were(make_runner):
    runner, oracle = make_runner(), make_runner()
    for r in (runner, oracle):
        r.step([R("v", 20, 20)])
    runner.run(runner.dummy_batch(40, context=20))
    runner.run(dummy_step_batch(8, runner.layout, W, "cpu", view_fields=runner.view_fields))
    assert runner.cached_len("__dummy0") == 0
    assert _decode_err(runner, oracle, "v", 21) < 1e-5
    # A batch that names blocks but writes none (every row to the pad slot) touches no block.
    reqs = [R("v", 1, 22), R("q", 3, 3)]
    pad = build_step_batch(reqs, _tokens(reqs), [0, 0], runner.layout, W, "cpu", view_fields=runner.view_fields,
                           pad_writes=True)
    runner.run(pad)
    assert runner.cached_len("v") == 21 and runner.cached_len("q") == 0
    other = make_runner()
    with pytest.raises(ValueError, match="built by another runner"):
        runner.run(_own_batch(other, reqs, [0, 0], pad_writes=True))


def test_an_unchanged_own_batch_runs_twice(make_runner):
    """Running a batch again rewrites the same slots of the same blocks: allowed."""
    runner, oracle = make_runner(), make_runner()
    batch = runner.build_batch([R("a", 20, 20)])
    runner.run(batch)
    runner.run(batch)
    oracle.step([R("a", 20, 20)])
    assert _decode_err(runner, oracle, "a", 21) < 1e-5
