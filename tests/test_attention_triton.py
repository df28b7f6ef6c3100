"""The attention kernel (reference/attention_triton.py) on the CPU: under Triton's
interpreter in a child process, whole and with its global keys split, against the
PyTorch reference (attention_kernel_cases.py, which test_gpu.py runs compiled), and
the split plan's host arithmetic."""
from attention_kernel_cases import check_split_plan
from conftest import check_interpreted, needs_triton


@needs_triton
def test_kernel_whole_and_split_matches_the_reference():
    check_interpreted("attention_kernel_cases", "check_against_reference")


def test_split_plan_splits_only_few_programs_over_many_keys():
    check_split_plan()


@needs_triton
def test_model_steps_with_split_attention_match_the_reference_model():
    check_interpreted("attention_kernel_cases", "check_model_steps_split")


@needs_triton
def test_capture_builds_every_split_variant_that_served_steps_launch(monkeypatch, fresh_dynamo, one_thread):
    """A Triton build made by a served step is a stall of about 1 s inside it, so capture
    must already have launched every kernel variant (a KeptKernel key) that served
    steps with long contexts launch, split ones included. The kernels are not run here
    (only their keys are recorded; CPU tensors), so the model's outputs and KV are not
    looked at; the split thresholds are lowered so that this small model's contexts
    split."""
    import torch

    from conftest import small_config
    from replay_backend import ReplayBackend, RequestChunk, StepRunner, build_model
    from replay_backend.reference import attention_ops
    from replay_backend.reference import attention_triton as at
    from replay_backend.reference import cache_triton

    monkeypatch.setattr(cache_triton, "write", lambda *args: None)  # a Triton kernel too; the KV is not looked at
    monkeypatch.setattr(at, "MIN_SPLIT_KEYS", 128)
    monkeypatch.setattr(at, "MIN_CHUNK", 64)
    launched: dict[str, set] = {"attention": set(), "merge": set()}
    split_cases: set = set()  # (floored, ratio) of the attention launches that split

    def recorder(seen: set):
        def record(key, grid, device, args, consts):
            seen.add(key)
            if consts.get("SPLIT"):
                split_cases.add((consts["FLOORED"], consts["RATIO"]))
        return record
    for name, attr in (("attention", "_KERNEL"), ("merge", "_MERGE")):
        monkeypatch.setattr(at, attr, recorder(launched[name]))
    # Five layers: 1 and 2 read the ratio-2 cache, 3 (a main layer) and 4 (replay) the ratio-1 one.
    cfg = small_config().with_layers(5, (1, 3)).replace(attention_impl="triton", moe_impl="dense")
    runner = StepRunner(build_model(cfg, "cpu", torch.float32), max_model_len=320, max_num_seqs=2,
                        backend=ReplayBackend(compiler="eager", max_num_seqs=2, max_cudagraph_capture_size=64))
    assert attention_ops.split_warmup_seq_len(cfg, 320, "cpu") == 256  # 128 entries of the ratio-2 cache
    assert runner.split_warmup_s is None
    runner.capture()
    assert runner.split_warmup_s > 0  # the step that built them, in seconds
    assert not any(runner.backend.model.dispatch.values())  # that step is not a served one
    built = {k: set(v) for k, v in launched.items()}
    for v in (*launched.values(), split_cases):
        v.clear()
    runner.prefill({"long": 300})  # a trimming prefill over a long context
    runner.step([RequestChunk("long", 1, 301)])  # a decode after it
    runner.step([RequestChunk("long", 40, 300)])  # a chunk late in its prompt (recomputed over its context)
    # (floored, ratio): main layers over both caches and the replay layer split
    assert split_cases == {(False, 2), (False, 1), (True, 1)}, split_cases
    assert launched["merge"]
    for name in launched:
        missing = launched[name] - built[name]
        assert not missing, f"{name}: served steps launched variants capture never did: {missing}"
    # No warm-up step where no step can split: the split off, or contexts too short for it.
    assert attention_ops.split_warmup_seq_len(cfg.replace(attention_split=False), 256, "cpu") == 0
    assert attention_ops.split_warmup_seq_len(cfg, 200, "cpu") == 200  # the ratio-1 cache alone can split
    assert attention_ops.split_warmup_seq_len(cfg, 120, "cpu") == 0  # neither cache reaches 128 entries
    # nor where FlashInfer attends (the Triton kernels only write the caches)
    assert attention_ops.split_warmup_seq_len(cfg.replace(attention_impl="flashinfer"), 320, "cuda") == 0
