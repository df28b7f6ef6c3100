"""Several ranks on the CPU (gloo, one process per rank): tensor parallelism, data-parallel
attention with expert-parallel MoE (DEP), and both, against the single-process model of
the same weights, on piecewise and eager steps, trimmed and not, uneven batches, idle
ranks; the ranks' agreement; a rank that raises."""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

import replay_backend
from replay_backend import RequestChunk as R
from replay_backend import build_model, preset
from replay_backend.backend import ReplayBackend
from replay_backend.reference.compare import max_abs_err, max_abs_err_kv
from replay_backend.reference.parallel import Parallel, shard
from replay_backend.reference.runner import StepRunner
from ranks import run_ranks

CFG = preset("tiny").with_layers(6, (1, 2)).replace(window=16)
OPTS = dict(compiler="eager", max_num_seqs=4, max_cudagraph_capture_size=64, decoder_replay_trim_threshold=48)
TOL = 1e-4

# One step per entry, for data-parallel rank 0 and rank 1 (None: that rank is idle).
# Step 1: rank 0 prefills 70 tokens (above every graph: eager, trims); rank 1 has nothing
# to trim, yet trims with it (every row a replay row), padded to rank 0's sizes.
# Step 2: a lone decode beside an idle rank. Step 3: both graphed at the size of the
# larger (40 tokens pad to 40; the other rank's 20 too); a chunk after context.
# Step 4: the other rank idle. Step 5: both trim in graphs.
DP_STEPS = [
    ([R("a", 70, 70)], [R("b", 5, 5), R("c", 1, 1)]),
    ([R("a", 1, 71)], None),
    ([R("d", 20, 20)], [R("b", 40, 45)]),
    (None, [R("b", 1, 46), R("c", 1, 2)]),
    ([R("e", 50, 50)], [R("f", 2, 2), R("b", 1, 47)]),
]
# Tensor parallelism: every rank holds the same batch.
TP_STEPS = [[R("a", 50, 50)], [R("a", 1, 51)], [R("b", 100, 100)],
            [R("a", 1, 52), R("b", 2, 102), R("c", 30, 30, keep_all=True)]]


def _groups(rank: int, tp: int, dp: int):
    """This rank's TP group (consecutive ranks) and DP group (one rank per TP group):
    every rank creates every group, as torch.distributed asks."""
    tp_groups = [dist.new_group([d * tp + t for t in range(tp)]) for d in range(dp)]
    dp_groups = [dist.new_group([d * tp + t for d in range(dp)]) for t in range(tp)]
    return tp_groups[rank // tp], dp_groups[rank % tp]


def _serve(rank: int, world: int, tp: int, dp: int, ep: bool, steps) -> list[dict]:
    tp_group, dp_group = _groups(rank, tp, dp)
    par = Parallel(tp, rank % tp, tp_group, dp, rank // tp, dp_group, ep)
    oracle_model, model = build_model(CFG), shard(build_model(CFG), par)
    be = ReplayBackend(**OPTS, dp_group=dp_group if dp > 1 else None, tp_group=tp_group if tp > 1 else None,
                       debug_check_ranks=tp > 1)
    rc = StepRunner(model, max_model_len=256, backend=be)
    ro = StepRunner(oracle_model, max_model_len=256)
    rc.capture()
    out = []
    for step in steps:
        reqs = step[rank // tp] if dp > 1 else step
        if reqs is None:
            rc.idle_step()
            out.append({"idle": True, "result": be.last_step})
            continue
        got, want = rc.step(reqs), ro.step(reqs)
        out.append({"idle": False, "result": got.result, "err": max_abs_err(got.logits, want.logits),
                    "kv": max_abs_err_kv(rc.kv, ro.kv, got.batch),
                    "logprobs": max((max_abs_err(got.prompt_logprobs[k], want.prompt_logprobs[k])
                                     for k in want.prompt_logprobs), default=0.0)})
    return out


def _check_agreed(per_rank: list[list[dict]]) -> None:
    """Every rank ran every step at the same sizes, and matched the single-process model."""
    for i, steps in enumerate(zip(*per_rank)):
        for s in steps:
            if not s["idle"]:
                assert s["err"] <= TOL and s["kv"] <= TOL and s["logprobs"] <= TOL, (i, s)
        sizes = {(s["result"].kind, s["result"].padded_tokens, s["result"].trimmed, s["result"].replay_padded)
                 for s in steps}
        assert len(sizes) == 1, (i, sizes)


def test_tensor_parallel_ranks_match_the_single_process_model():
    per_rank = run_ranks(_serve, 2, 2, 1, False, TP_STEPS)
    _check_agreed(per_rank)
    kinds = {(s["result"].kind.value, s["result"].trimmed) for s in per_rank[0]}
    assert {("piecewise", True), ("piecewise", False), ("eager", True)} <= kinds, kinds


def test_data_parallel_attention_with_expert_parallel_moe_matches_the_single_process_model():
    per_rank = run_ranks(_serve, 2, 1, 2, True, DP_STEPS)
    _check_agreed(per_rank)
    first = [s["result"] for s in (per_rank[0][0], per_rank[1][0])]
    # rank 0 trims its 70-token prefill; rank 1 has nothing to trim and runs its rows
    # as replay rows, at rank 0's sizes: eager, padded to 70 tokens
    assert all(r.kind.value == "eager" and r.padded_tokens == 70 and r.trimmed for r in first)
    assert (first[0].replay_rows, first[1].replay_rows) == (16, 6)
    assert per_rank[1][1]["idle"] and per_rank[1][1]["result"].padded_tokens == per_rank[0][1]["result"].padded_tokens
    kinds = {(s["result"].kind.value, s["result"].trimmed) for steps in per_rank for s in steps}
    assert {("eager", True), ("piecewise", False), ("piecewise", True)} <= kinds, kinds


def test_tensor_and_data_parallel_together():
    per_rank = run_ranks(_serve, 4, 2, 2, True, DP_STEPS, timeout=400)
    _check_agreed(per_rank)


def _tp_ranks_given_other_batches(rank: int, world: int) -> None:
    tp_group, _ = _groups(rank, 2, 1)
    model = shard(build_model(CFG), Parallel(2, rank, tp_group))
    rc = StepRunner(model, max_model_len=256, backend=ReplayBackend(**OPTS, tp_group=tp_group, debug_check_ranks=True))
    rc.capture()
    rc.step([R("a", 50, 50)] if rank == 0 else [R("a", 20, 20)])


def test_tensor_parallel_ranks_that_decide_a_step_differently_fail_under_the_rank_check():
    """Tensor-parallel ranks hold one batch; given two, their plans differ, and with
    ``debug_check_ranks`` every rank fails before the step's collectives, naming the
    first difference."""
    with pytest.raises(AssertionError, match=r"tensor-parallel ranks decided a step differently: rank 1 has "
                                             r"step plan .*num_tokens=20.*, rank 0 has .*num_tokens=50"):
        run_ranks(_tp_ranks_given_other_batches, 2, timeout=150)


def _rank_1_dies(rank: int, world: int) -> None:
    _, dp_group = _groups(rank, 1, 2)
    model = shard(build_model(CFG), Parallel(dp_size=2, dp_rank=rank, dp_group=dp_group, enable_expert_parallel=True))
    rc = StepRunner(model, max_model_len=256, backend=ReplayBackend(**OPTS, dp_group=dp_group))
    rc.capture()
    rc.step([R("a", 20, 20)])
    if rank == 1:
        os._exit(3)  # gone without a word: no error, no agreement
    rc.step([R("a", 1, 21)])


def test_a_rank_that_dies_leaves_the_others_an_error_not_a_hang():
    """A data-parallel rank that dies between steps tells nobody; its peer's next step
    fails in the step's agreement (the gloo connection closes) long before the group's
    timeout, and the run names the rank that died."""
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"rank 1 died without a result \(exit code 3\)\n\(rank 0 raised: "):
        run_ranks(_rank_1_dies, 2, timeout=300, collective_timeout=600)
    assert time.monotonic() - start < 120


def _raises(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 gives up")
    t = torch.zeros(1)
    dist.all_reduce(t)  # waits for rank 1, which never comes


def test_a_rank_that_raises_is_named_and_the_others_do_not_hang():
    with pytest.raises(AssertionError, match=r"rank 1 raised first:(.|\n)*rank 1 gives up"):
        run_ranks(_raises, 2, timeout=60, collective_timeout=10)


def _one_rank_fails_its_step(rank: int, world: int, how: str) -> list:
    """DEP2 serving. At the second step rank 1 fails before the agreement (a stale
    batch, under strict a batch laid out for FULL graphs outside the metadata buffer,
    in the runner's own check, a batch of a request freed since, a call through
    Dynamo's entry that needs a new trace, refused once serving, a call outside the
    forward context, direct or through Dynamo's entry, or one missing an argument)
    while rank 0 runs
    a decode; at the third both serve a step again.
    Per step: each rank's error (type, message, seconds taken) or its logits' error
    against the single-process model."""
    import time

    from replay_backend import build_step_batch

    dp = dist.group.WORLD
    mode = "full_and_piecewise" if how == "strict" else "piecewise"
    model = shard(build_model(CFG), Parallel(1, 0, None, 2, rank, dp, True))
    rc = StepRunner(model, max_model_len=256, backend=ReplayBackend(**OPTS, strict=how == "strict",
                                                                    cudagraph_mode=mode, dp_group=dp,
                                                                    direct_dispatch=how not in (
                                                                        "recompile", "no_context_dynamo",
                                                                        "missing_argument")))
    ro = StepRunner(build_model(CFG), max_model_len=256)
    rc.capture()
    rc.start_serving()
    if rank == 0:
        steps = [[R("a", 20, 20)], [R("a", 1, 21)], [R("a", 1, 21)]]
    else:  # a freed request's cache is gone: its rank serves another one next
        steps = [[R("b", 5, 5)], [R("b", 1, 6)], [R("c", 6, 6)] if how == "freed" else [R("b", 1, 6)]]
    out = []
    for k, reqs in enumerate(steps):
        t0 = time.monotonic()
        try:
            if (rank, k) != (1, 1):
                got = rc.step(reqs)
                out.append(max_abs_err(got.logits, ro.step(reqs).logits))
                continue
            if how == "refused":  # the runner's build_batch: more new requests than free blocks
                try:
                    rc.step([R(f"x{i}", 2, 2) for i in range(9)])
                except RuntimeError as e:  # a server that reports it again: the ranks are told once
                    rc.compiled.fail_step(e)
            elif how == "stale":
                batch = rc.build_batch(reqs)
                rc.build_batch(reqs)  # overwrites the first's metadata
            elif how == "recompile":  # grad mode on: Dynamo traces anew, which serving refuses
                batch = rc.build_batch(reqs)
                with torch.inference_mode(False), torch.enable_grad(), \
                        replay_backend.set_forward_context(rc.setup.context(batch)):
                    rc.compiled(batch.input_ids, batch.positions)
            elif how == "missing_argument":  # through Dynamo's entry, refused as Python would
                batch = rc.build_batch(reqs)
                with torch.inference_mode(), replay_backend.set_forward_context(rc.setup.context(batch)):
                    rc.compiled(batch.input_ids)
            elif how.startswith("no_context"):
                batch = rc.build_batch(reqs)
                with torch.inference_mode():
                    rc.compiled(batch.input_ids, batch.positions)
            elif how == "freed":  # the runner's own check, before it calls the compiled model
                batch = rc.build_batch(reqs)
                rc.free("b")
            else:
                batch = build_step_batch(reqs, [rc.tokens("b", 5, 6)], [rc.block_of("b")], rc.layout, CFG.window,
                                         "cpu", graph_rows=rc.backend.model.full_policy.rows,
                                         view_fields=rc.view_fields, owner=rc)
            rc.run(batch)
            out.append(("no error", "", time.monotonic() - t0))
        except Exception as e:  # noqa: BLE001 - what each rank saw is the result
            out.append((type(e).__name__, str(e), time.monotonic() - t0))
            if isinstance(e, replay_backend.RankFailed):  # a server that reports every error of a step:
                try:  # the ranks know of this one already, so the next step is every rank's next step
                    rc.compiled.fail_step(e)
                except replay_backend.RankFailed:
                    pass
    return out


@pytest.mark.parametrize("how,error", [("stale", "stale StepBatch"), ("strict", "metadata_in_place"),
                                       ("freed", "holds no block for it"), ("refused", "no free cache block"),
                                       ("recompile", "recompile after warm-up"),
                                       ("no_context", "no forward context is set"),
                                       ("no_context_dynamo", "no forward context is set"),
                                       ("missing_argument", "missing a required argument: 'positions'")])
def test_a_rank_that_fails_before_the_agreement_makes_every_rank_raise_at_once(how, error):
    """A data-parallel rank whose step fails before the agreement still joins it, as
    failed: the other rank raises at once naming it, instead of waiting in the step's
    collectives until the group's timeout; the next step runs on both, right."""
    rank0, rank1 = run_ranks(_one_rank_fails_its_step, 2, how, timeout=300, collective_timeout=60)
    assert rank1[1][0] in ("RuntimeError", "StrictFallbackError", "ValueError", "TypeError") \
        and error in rank1[1][1], rank1[1]
    name, message, seconds = rank0[1]
    assert name == "RankFailed" and "data-parallel rank 1 failed this step" in message, rank0[1]
    assert seconds < 30, rank0[1]
    assert max(rank0[0], rank0[2], rank1[0], rank1[2]) <= TOL, (rank0, rank1)


def _tp_rank_fails_its_step(rank: int, world: int) -> list:
    """TP2 with debug_check_ranks. At the second step rank 1's own check refuses the
    step (``fail_step``), while rank 0 runs it; then both serve two more. A server that
    reports every error reports the ``RankFailed`` too. Per step: the error (type,
    message, seconds) or the logits' error against the single-process model."""
    import time

    tp = dist.group.WORLD
    rc = StepRunner(shard(build_model(CFG), Parallel(2, rank, tp)), max_model_len=256,
                    backend=ReplayBackend(**OPTS, tp_group=tp, debug_check_ranks=True))
    ro = StepRunner(build_model(CFG), max_model_len=256)
    rc.capture()
    out = []
    for k, reqs in enumerate(([R("a", 20, 20)], [R("a", 1, 21)], [R("a", 1, 21)], [R("b", 60, 60)])):
        t0 = time.monotonic()
        try:
            if (rank, k) == (1, 1):
                rc.compiled.fail_step(ValueError("rank 1's server refuses this step"))
            got = rc.step(reqs)
            out.append(max_abs_err(got.logits, ro.step(reqs).logits))
        except Exception as e:  # noqa: BLE001 - what each rank saw is the result
            out.append((type(e).__name__, str(e), time.monotonic() - t0))
            try:
                rc.compiled.fail_step(e)  # told already: only raises
            except Exception:  # noqa: BLE001
                pass
    return out


def test_a_tensor_parallel_rank_that_fails_its_step_is_named_under_debug_check_ranks():
    """Tensor-parallel ranks share one batch and agree on nothing per step, but with
    debug_check_ranks their plans meet in every step's check: a rank that gave up the
    step joins it as failed, and its peer raises at once naming it instead of running
    the step's all-reduces without it; the next steps run on both, right."""
    rank0, rank1 = run_ranks(_tp_rank_fails_its_step, 2, timeout=200, collective_timeout=60)
    assert rank1[1][:2] == ("ValueError", "rank 1's server refuses this step"), rank1[1]
    name, message, seconds = rank0[1]
    assert name == "RankFailed" and "tensor-parallel rank 1 failed this step" in message, rank0[1]
    assert seconds < 30, rank0[1]
    assert all(isinstance(e, float) and e <= TOL for e in (*rank0[::2], *rank1[::2], rank0[3], rank1[3])), \
        (rank0, rank1)


def _one_of_four_fails_its_step(rank: int, world: int) -> list:
    """TP2 x DP2 with debug_check_ranks: at the second step rank 0 alone gives up (its
    server's own check), while its tensor-parallel peer (1), its data-parallel peer (2)
    and the fourth rank (3) run it. Per step: the error (type, message) or the
    logits' error against the single-process model."""
    tp_group, dp_group = _groups(rank, 2, 2)
    rc = StepRunner(shard(build_model(CFG), Parallel(2, rank % 2, tp_group, 2, rank // 2, dp_group, True)),
                    max_model_len=256, backend=ReplayBackend(**OPTS, tp_group=tp_group, dp_group=dp_group,
                                                             debug_check_ranks=True))
    ro = StepRunner(build_model(CFG), max_model_len=256)
    rc.capture()
    name = "a" if rank < 2 else "b"  # each tensor-parallel pair holds one batch
    out = []
    for k, reqs in enumerate(([R(name, 20, 20)], [R(name, 1, 21)], [R(name, 1, 21)])):
        try:
            if (rank, k) == (0, 1):
                rc.compiled.fail_step(ValueError("rank 0's server refuses this step"))
            out.append(max_abs_err(rc.step(reqs).logits, ro.step(reqs).logits))
        except Exception as e:  # noqa: BLE001 - what each rank saw is the result
            out.append((type(e).__name__, str(e)))
    return out


def test_one_rank_of_tensor_and_data_parallel_ranks_that_fails_its_step_stops_it_on_every_rank():
    """The failing rank's tensor-parallel peer learns of it ahead of its own data-parallel
    agreement, which it then joins as failed: no rank runs the step (before, the fourth
    rank ran it with a peer that did not), and the next step runs on every rank, right."""
    ranks = run_ranks(_one_of_four_fails_its_step, 4, timeout=300, collective_timeout=60)
    assert ranks[0][1] == ("ValueError", "rank 0's server refuses this step"), ranks[0]
    assert ranks[1][1][0] == "RankFailed" and "tensor-parallel rank 0 failed" in ranks[1][1][1], ranks[1]
    assert ranks[2][1][0] == "RankFailed" and "data-parallel rank 0 failed" in ranks[2][1][1], ranks[2]
    assert ranks[3][1][0] == "RankFailed" and "data-parallel rank 0 failed" in ranks[3][1][1], ranks[3]
    assert all(isinstance(r[k], float) and r[k] <= TOL for r in ranks for k in (0, 2)), ranks


def _tp_rank_captures_late(rank: int, world: int) -> None:
    """TP2 with debug_check_ranks: both serve a first step, then rank 0 captures while
    rank 1 serves another."""
    tp = dist.group.WORLD
    rc = StepRunner(shard(build_model(CFG), Parallel(2, rank, tp)), max_model_len=256,
                    backend=ReplayBackend(**OPTS, tp_group=tp, debug_check_ranks=True))
    rc.step([R("a", 20, 20)])
    if rank == 0:
        rc.capture()
    rc.step([R("a", 1, 21)])


def test_tensor_parallel_ranks_at_different_points_raise_naming_it():
    with pytest.raises(AssertionError, match=r"raised first(.|\n)*RanksApart: dsv41_replay: the ranks of a group are "
                                             r"not at the same point"):
        run_ranks(_tp_rank_captures_late, 2, timeout=100, collective_timeout=60)


def _dp_rank_checks_differ(rank: int, world: int) -> str:
    ReplayBackend(**OPTS, dp_group=dist.group.WORLD, debug_check_ranks=rank == 0)
    return "made"


def test_data_parallel_ranks_may_differ_in_tensor_parallel_checks():
    """debug_check_ranks adds a collective on the tensor-parallel group only."""
    assert run_ranks(_dp_rank_checks_differ, 2, timeout=60) == ["made", "made"]


def test_a_lazy_module_s_uninitialized_weights_are_compared_as_such():
    from replay_backend.parallel import model_digest

    digest = model_digest(torch.nn.Sequential(torch.nn.LazyLinear(4), torch.nn.Linear(4, 2)))
    assert digest["parameter 0.weight"] == "uninitialized" and digest["parameter 1.weight"] == "(2, 4) torch.float32"


def _recompile_under_plain_compile(rank: int, world: int) -> list:
    """A user's own model under plain ``torch.compile`` with data-parallel ranks: at the
    second served step rank 1 calls it with grad mode on, a new trace the serving
    backend refuses inside Dynamo's compile. Per step: each rank's error (type,
    message, seconds) or its logits' error against the eager model."""
    import time

    from llama_swa import LlamaServer, LlamaSWA

    model, oracle = LlamaSWA(window=8).eval(), LlamaSWA(window=8).eval()
    be = ReplayBackend(compiler="eager", cudagraph_capture_sizes=[8, 16, 32], decoder_replay_trim_threshold=16,
                       max_num_seqs=4, dp_group=dist.group.WORLD)
    compiled = torch.compile(model, backend=be, dynamic=True)
    server = LlamaServer(model)

    def run(fn, requests, grad=False):
        blocks = [server.block(r.req_id) for r in requests]
        tokens = [server.tokens(r) for r in requests]
        batch = be.build_batch(requests, tokens, blocks) if fn is compiled and be.setup is not None else \
            replay_backend.build_step_batch(requests, tokens, blocks, server.layout, 8, "cpu")
        with torch.set_grad_enabled(grad), replay_backend.set_forward_context(server.setup.context(batch)):
            return fn(batch.input_ids, batch.positions)[0][batch.logits_indices]

    with torch.no_grad():
        run(compiled, [R("w", 9, 9)])  # the trace, on both ranks
    be.capture(server.setup)
    be.start_serving()
    name = "a" if rank == 0 else "b"
    out = []
    for k, step in enumerate(([R(name, 20, 20)], [R(name, 1, 21)], [R(name, 1, 21)], [R(name, 1, 22)])):
        t0 = time.monotonic()
        try:
            got = run(compiled, step, grad=(rank, k) == (1, 1))
            with torch.no_grad():
                out.append(max_abs_err(got, run(oracle, step)))
        except Exception as e:  # noqa: BLE001 - what each rank saw is the result
            out.append((type(e).__name__, str(e), time.monotonic() - t0))
            try:  # a server that reports every error, here as Dynamo wrapped it: the ranks know of it
                be.fail_step(e)
            except Exception:  # noqa: BLE001
                pass
    return out


def test_a_recompile_refused_while_serving_fails_the_step_on_every_rank():
    """Under plain ``torch.compile`` the refusal is raised in Dynamo's compile, before
    the step's agreement: rank 1 still joins it as failed, so rank 0 raises at once
    naming it instead of waiting for rank 1 in the step's collectives; the next step
    runs on both, right."""
    rank0, rank1 = run_ranks(_recompile_under_plain_compile, 2, timeout=200, collective_timeout=60)
    assert rank1[1][0] == "BackendCompilerFailed" and "recompile after warm-up" in rank1[1][1] \
        and "grad mode" in rank1[1][1], rank1[1]
    name, message, seconds = rank0[1]
    assert name == "RankFailed" and "data-parallel rank 1 failed this step" in message, rank0[1]
    assert seconds < 30, rank0[1]
    assert all(isinstance(e, float) and e <= 1e-5 for e in (*rank0[::2], *rank1[::2], rank0[3], rank1[3])), \
        (rank0, rank1)


def _fails_its_first_step(rank: int, world: int, how: str) -> list:
    """DEP2 without capture: rank 1's first step is refused before anything is traced
    there, by the runner's own check (a chunk whose context is not cached) or as an idle
    step (the backend runs dummy steps only after a traced one), while rank 0 traces
    and runs its first; then both serve two steps. Per step: the error (type, message,
    seconds) or the logits' error against the single-process model."""
    import time

    dp = dist.group.WORLD
    rc = StepRunner(shard(build_model(CFG), Parallel(1, 0, None, 2, rank, dp, True)), max_model_len=256,
                    backend=ReplayBackend(**OPTS, dp_group=dp))
    ro = StepRunner(build_model(CFG), max_model_len=256)
    steps = ([[R("a", 20, 20)], [R("a", 20, 20)], [R("a", 1, 21)]] if rank == 0 else
             [[R("b", 1, 6)], [R("b", 5, 5)], [R("b", 1, 6)]])
    out = []
    for reqs in steps:
        t0 = time.monotonic()
        try:
            if (rank, len(out), how) == (1, 0, "idle"):
                rc.idle_step()
            out.append(max_abs_err(rc.step(reqs).logits, ro.step(reqs).logits))
        except Exception as e:  # noqa: BLE001 - what each rank saw is the result
            out.append((type(e).__name__, str(e), time.monotonic() - t0))
    return out


@pytest.mark.parametrize("how, error", [("check", "the cache holds 0 of its positions"),
                                        ("idle", "idle_step() needs one step through the compiled model first")])
def test_a_rank_that_fails_its_first_step_before_any_trace_makes_every_rank_raise_at_once(how, error):
    rank0, rank1 = run_ranks(_fails_its_first_step, 2, how, timeout=300, collective_timeout=60)
    assert error in rank1[0][1], rank1[0]
    assert rank0[0][0] == "RankFailed" and rank0[0][2] < 30, rank0[0]
    assert max(rank0[1], rank0[2], rank1[1], rank1[2]) <= TOL, (rank0, rank1)


def _first_step_of_one_token(rank: int, world: int) -> list:
    """DEP2 without capture: each rank's first step is a one-token prompt, so the one
    trace is made on one token; then lone decodes and steps of other counts run on it.
    Per step: the logits' and the written cache's error against the single-process
    model; and the number of graphs traced."""
    dp = dist.group.WORLD
    rc = StepRunner(shard(build_model(CFG), Parallel(1, 0, None, 2, rank, dp, True)), max_model_len=256,
                    backend=ReplayBackend(**OPTS, dp_group=dp))
    ro = StepRunner(build_model(CFG), max_model_len=256)
    steps = ([[R("a", 1, 1)], [R("a", 1, 2)], [R("a", 30, 32)], [R("b", 3, 3), R("a", 1, 33)]] if rank == 0 else
             [[R("c", 1, 1)], [R("c", 1, 2)], [R("c", 7, 9)], [R("d", 60, 60)]])
    out = []
    for reqs in steps:
        got, want = rc.step(reqs), ro.step(reqs)
        out.append((got.batch.num_tokens, max_abs_err(got.logits, want.logits),
                    max_abs_err_kv(rc.kv, ro.kv, got.batch)))
    return out, len(rc.backend.compiled)


def test_a_first_step_of_one_token_traces_one_graph_for_every_count():
    """Traced on one token (eager pieces), the reference model's step holds for every
    count: a data-parallel rank runs no warm-up trace of its own (its every step is
    agreed), so its first step is the trace."""
    for rank_steps, graphs in run_ranks(_first_step_of_one_token, 2, timeout=300):
        assert rank_steps[0][0] == 1 and graphs == 1, (rank_steps, graphs)
        assert all(err <= TOL and kv <= TOL for _, err, kv in rank_steps), rank_steps


def _other_layers(rank: int, world: int) -> None:
    """The same options, models of other depths (and sources: rank 1's layer 2 compresses
    nothing): refused when compiled, before the first step's collectives would meet at
    other counts."""
    cfg = CFG if rank == 0 else preset("tiny").with_layers(8, (1, 3)).replace(window=16)
    be = ReplayBackend(**OPTS, dp_group=dist.group.WORLD)
    StepRunner(build_model(cfg), max_model_len=256, backend=be).capture()


def test_ranks_with_models_of_other_depths_are_refused_when_compiled_naming_the_first_difference():
    with pytest.raises(AssertionError, match=r"raised first(.|\n)*the ranks were given different models: rank 1 "
                                             r"has module layers.2.attn.comp_norm none, rank 0 has RMSNorm"):
        run_ranks(_other_layers, 2, timeout=100)


def _different_options(rank: int, world: int) -> None:
    ReplayBackend(**{**OPTS, "decoder_replay_trim_threshold": 48 if rank == 0 else 64}, dp_group=dist.group.WORLD)


def _different_rank_checks(rank: int, world: int) -> None:
    """The plan check is a collective of every step: one rank alone would wait in it."""
    ReplayBackend(**OPTS, tp_group=dist.group.WORLD, debug_check_ranks=rank == 0)


def _different_windows(rank: int, world: int) -> None:
    """A user's own model compiled with its setup: the windows differ, so would the
    ranks' first (warm-up) steps and the collectives in them."""
    from llama_swa import LlamaServer, LlamaSWA

    model = LlamaSWA(window=8 if rank == 0 else 16)
    replay_backend.compile(model, ("input_ids", "positions"), backend=ReplayBackend(**OPTS, dp_group=dist.group.WORLD),
                           setup=LlamaServer(model).setup)


def _one_rank_captures(rank: int, world: int) -> None:
    """DEP2: rank 0 captures while rank 1 serves steps uncaptured (its first step meets
    rank 0's trace before capture, its second rank 0's capture)."""
    dp = dist.group.WORLD
    rc = StepRunner(shard(build_model(CFG), Parallel(1, 0, None, 2, rank, dp, True)), max_model_len=256,
                    backend=ReplayBackend(**OPTS, dp_group=dp))
    if rank == 0:
        rc.capture()
    rc.step([R("a", 20, 20)])
    rc.step([R("a", 1, 21)])


def test_ranks_at_different_points_raise_on_each_instead_of_waiting():
    """Capture meets the ranks in the shape of a step's agreement, saying where it is: a
    rank serving meanwhile meets it, and both raise at once, instead of each waiting in
    a collective the other never joins."""
    with pytest.raises(AssertionError, match=r"raised first(.|\n)*RanksApart: dsv41_replay: the data-parallel ranks "
                                             r"are not at the same point: this rank (captures graphs|runs a step)"):
        run_ranks(_one_rank_captures, 2, timeout=100, collective_timeout=60)


def _outside_the_group(rank: int, world: int) -> None:
    """Each rank passes the group the other rank alone belongs to."""
    groups = [dist.new_group([0]), dist.new_group([1])]
    ReplayBackend(**OPTS, tp_group=groups[1 - rank])


def _different_models(rank: int, world: int) -> None:
    cfg = CFG.replace(seed=rank)
    shard(build_model(cfg), Parallel(tp_size=2, tp_rank=rank, tp_group=dist.group.WORLD))


def _swapped_ranks(rank: int, world: int) -> None:
    """Each rank names the other's place: each would take the other's heads and experts
    while the all-reduce adds them in the group's order."""
    shard(build_model(CFG), Parallel(tp_size=2, tp_rank=1 - rank, tp_group=dist.group.WORLD))


@pytest.mark.parametrize("case, message", [
    (_swapped_ranks, r"raised first(.|\n)*tp_rank=(1, but this process is rank 0|0, but this process is rank 1) "
                     "of tp_group"),
    (_different_options, "the ranks were given different options: rank 1 has decoder_replay_trim_threshold 64, "
                         "rank 0 has 48"),
    (_different_rank_checks, "the ranks were given different options: rank 1 has debug_check_ranks False, "
                             "rank 0 has True"),
    (_different_windows, "the ranks were given different models: rank 1 has StepSetup.window 16, rank 0 has 8"),
    (_outside_the_group, r"ReplayBackend\(tp_group=...\): this process \(rank \d\) is not in that group"),
    (_different_models, "the ranks were given different model configs: rank 1 has seed 1, rank 0 has 0"),
])
def test_ranks_with_other_options_or_models_are_refused_before_any_trace(case, message):
    with pytest.raises(AssertionError, match=message):
        run_ranks(case, 2, timeout=100)


@pytest.mark.parametrize("par, cfg, message", [
    (Parallel(tp_size=3), CFG, "tp_size=3 does not divide num_heads=4"),
    (Parallel(tp_size=2, tp_group=None), CFG, "tp_size=2 needs a tp_group"),
    (Parallel(tp_size=2, tp_rank=2), CFG, r"tp_rank=2 is outside \[0, tp_size=2\)"),
    (Parallel(tp_size=0), CFG, "tp_size must be an integer >= 1"),
    (Parallel(tp_size=4), CFG, "tp_size=4 does not divide o_groups=2"),
    (Parallel(tp_size=2), CFG.replace(shared_intermediate_size=129),
     "tp_size=2 does not divide shared_intermediate_size=129"),
])
def test_a_split_the_model_cannot_take_is_refused_before_anything_is_built(par, cfg, message):
    with pytest.raises(ValueError, match=message):
        par.check(cfg)


def _checks_with_groups(rank: int, world: int) -> list[str]:
    """What ``Parallel.check`` says of groups of the wrong size, and of experts that the
    expert-parallel group does not divide."""
    group = dist.group.WORLD
    out = []
    for par, cfg in ((Parallel(tp_size=1, tp_group=group), CFG),
                     (Parallel(dp_size=3, dp_rank=rank, dp_group=group), CFG),
                     (Parallel(tp_size=2, tp_rank=rank, tp_group=group), CFG.replace(num_experts=3))):
        try:
            par.check(cfg)
            out.append("")
        except ValueError as e:
            out.append(str(e))
    return out


def test_groups_of_the_wrong_size_and_undivided_experts_are_refused_naming_the_sizes():
    got = run_ranks(_checks_with_groups, 2, timeout=100)[0]
    assert "tp_group has 2 ranks, tp_size is 1" in got[0]
    assert "dp_group has 2 ranks, dp_size is 3" in got[1]
    assert "the expert-parallel group of 2 ranks does not divide num_experts=3" in got[2]


def serve_one_rank(rank: int, world: int, how: str, device: str, compiler: str) -> list:
    """One rank whose groups hold only itself: the collectives run all the same (a TP
    all-reduce, or the DEP exchange), inside the captured graphs."""
    group = dist.group.WORLD
    par = Parallel(tp_size=1, tp_group=group) if how == "tp" else \
        Parallel(dp_size=1, dp_group=group, enable_expert_parallel=True)
    oracle_model = build_model(CFG, device, torch.float32)
    model = shard(build_model(CFG, device, torch.float32), par)
    be = ReplayBackend(**{**OPTS, "compiler": compiler}, strict=True,
                       dp_group=dist.new_group([0], backend="gloo") if how == "dep" else None)
    rc, ro = StepRunner(model, max_model_len=256, backend=be), StepRunner(oracle_model, max_model_len=256)
    summary = rc.capture()
    out = []
    for reqs in TP_STEPS:
        got, want = rc.step(reqs), ro.step(reqs)
        out.append((got.result.kind.value, got.result.trimmed, max_abs_err(got.logits, want.logits),
                    max_abs_err_kv(rc.kv, ro.kv, got.batch)))
    return [summary["main"]["graphs"], out]


def check_one_rank(graphs: int, steps: list) -> None:
    assert graphs > 0
    assert {("piecewise", True), ("eager", True)} <= {(k, t) for k, t, _, _ in steps}
    for kind, trimmed, err, kv in steps:
        assert err < 1e-4 and kv < 1e-4, (kind, trimmed, err, kv)


@pytest.mark.parametrize("how", ["tp", "dep"])
def test_groups_of_one_rank_run_their_collectives_too(how):
    graphs, steps = run_ranks(serve_one_rank, 1, how, "cpu", "eager", timeout=200)[0]
    check_one_rank(graphs, steps)


def _eager_collectives(rank: int, world: int) -> list:
    """Each collective called eagerly, and the DEP exchange op's eager result fed to a
    kernel of Inductor's (compiled on this CPU), which reads its input's pointer
    directly: a result with no storage of its own crashes it."""
    from replay_backend.compat import collectives
    from replay_backend.reference.parallel import dep_moe

    group = dist.group.WORLD.group_name
    x = torch.arange(12.0).reshape(4, 3)
    outs = [collectives.all_reduce_sum(x, group), collectives.all_gather_rows(x, group),
            collectives.reduce_scatter_rows(x, group)]
    gen = torch.Generator().manual_seed(0)
    h, e, inter = 8, 4, 4
    w = [torch.randn(s, generator=gen) for s in ((e, h), (e, 2 * inter, h), (e, h, inter))]

    def after_exchange(rows):
        return (dep_moe(rows, *w, 0, 2, group) * 2 + 1).sum(-1)

    rows = torch.randn(6, h, generator=gen)
    compiled = torch.compile(after_exchange, backend="inductor", fullgraph=True)(rows)
    return [(type(o) is torch.Tensor, o.data_ptr() != 0, torch.equal(o, x)) for o in outs] + \
        [max_abs_err(compiled, after_exchange(rows))]


def test_collectives_called_eagerly_return_tensors_that_kernels_can_read():
    """An eager functional collective returns a wrapper that waits when a torch op reads
    it, with no storage of its own (pointer 0). Returned as is from the DEP exchange op,
    which Inductor's pieces call eagerly, it reached a generated kernel that read address
    0: an illegal memory access on the GPU, a crash on the CPU. Every collective's result
    is now an ordinary tensor."""
    *outs, err = run_ranks(_eager_collectives, 1, timeout=200)[0]
    assert outs == [(True, True, True)] * 3
    assert err < 1e-5


def test_the_agreement_takes_the_largest_offer_of_each_number(monkeypatch):
    """One all-reduce (max) of eight numbers: no graphs if any rank has none, the largest
    token count and replay rows, trimming if any rank has rows to trim, no FULL graph
    if any rank's batch cannot take one, the highest rank that failed the step, and where
    the ranks meet (a step), as itself and its negative."""
    from replay_backend.dispatch import agree as agree_mod

    sent = []
    other = [torch.tensor([0, 90, 1, 40, 0, 0, 1, -1])]  # graphs, 90 tokens, trimmable, 40 rows, FULL possible,
    # no failure, at a step

    def fake_all_reduce(t, op, group):
        sent.append(t.tolist())
        t.copy_(torch.maximum(t, other[0]))

    monkeypatch.setattr(dist, "all_reduce", fake_all_reduce)
    monkeypatch.setattr(dist, "get_rank", lambda group: 2)
    got = agree_mod.agree(object(), True, 20, False, 20, True)
    assert got == agree_mod.Agreement(True, 90, True, 40, True) and sent == [[0, 20, 0, 20, 0, 0, 1, -1]]
    assert agree_mod.agree(object(), False, 100, False, 60) == agree_mod.Agreement(False, 100, True, 60, False)
    other[0] = torch.tensor([0, 4, 0, 4, 1, 0, 1, -1])  # the other rank's batch cannot run FULL
    assert agree_mod.agree(object(), True, 2, False, 2, True) == agree_mod.Agreement(True, 4, False, 4, False)
    other[0] = torch.tensor([0, 4, 0, 4, 0, 2, 1, -1])  # rank 1 failed; this one (2) too
    got = agree_mod.agree(object(), True, 0, False, 0, True, failed=True)
    assert sent[-1] == [0, 0, 0, 0, 0, 3, 1, -1] and got.failed_rank == 2
    other[0] = torch.tensor([0, 4, 0, 4, 0, 2, 1, -1])
    got = agree_mod.agree(object(), True, 4, False, 4, True)
    assert got.failed_rank == 1
    with pytest.raises(agree_mod.RankFailed, match="data-parallel rank 1 failed this step"):
        agree_mod.check_no_rank_failed(got)
    agree_mod.check_no_rank_failed(agree_mod.Agreement(True, 4, False, 4))
    other[0] = torch.tensor([2, 4, 0, 4, 0, 0, 1, -1])  # the other rank fell back: no graphs, and said so
    got = agree_mod.agree(object(), True, 4, False, 4, True)
    assert not got.graphs and got.fell_back
    agree_mod.agree(object(), False, 4, False, 4, True, fell_back=True)
    assert sent[-1][0] == 2
    other[0] = torch.tensor([1, 4, 0, 4, 0, 0, 1, -1])  # a step without graphs, no fallback
    assert not agree_mod.agree(object(), True, 4, False, 4, True).fell_back
    other[0] = torch.tensor([1, 0, 0, 0, 0, 0, 2, -2])  # the other rank captures
    with pytest.raises(agree_mod.RanksApart, match="this rank runs a step while another captures graphs"):
        agree_mod.agree(object(), True, 4, False, 4, True)
