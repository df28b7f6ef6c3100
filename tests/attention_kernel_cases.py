"""The attention kernel (reference/attention_triton.py), whole and with its global keys
split into chunks, against the PyTorch reference of one request's attention: the
cases shared by the CPU test (under Triton's interpreter, in a child process) and the
GPU test."""
import contextlib

import torch

from replay_backend.reference import attention_triton
from replay_backend.reference.attention_reference import attend_request

WINDOW = 32
MAX_LEN = 1024  # cache rows per request


def _cases():
    """(query lens, seq lens, floors, ratio or None): a replay batch of one long prompt
    (two row blocks, 700 global keys), the same on a ratio-2 cache, decodes and a short
    chunk beside a long one (blocks whose global counts differ, so some chunks are empty
    for some blocks), a block wholly below its floor, and an SWA-only layer."""
    return [
        ([100], [700], [668], 1),
        ([100], [700], [668], 2),
        ([1, 70, 1, 3], [900, 200, 65, 513], [0, 0, 0, 0], 1),
        ([150], [1000], [990], 2),
        ([40, 60], [300, 800], [268, 0], None),
    ]


def _run_case(device, qlens, seq_lens, floors, ratio, dtype, gen):
    heads, d = 2, 64
    n = len(qlens)
    base = [i * MAX_LEN for i in range(n)]
    qsl = [0]
    for q in qlens:
        qsl.append(qsl[-1] + q)
    q = torch.randn(qsl[-1], heads, d, generator=gen).to(device, dtype)
    swa = torch.randn(n * MAX_LEN, d, generator=gen).to(device, dtype)
    glob = torch.randn(n * MAX_LEN // (ratio or 1), d, generator=gen).to(device, dtype) if ratio else None
    sink = torch.randn(heads, generator=gen).to(device, dtype)
    blocks = torch.tensor(attention_triton.row_blocks(qsl, seq_lens, floors, base, WINDOW),
                          dtype=torch.int64, device=device).view(-1, attention_triton.NUM_FIELDS)
    scale = d ** -0.5
    want = torch.empty(qsl[-1], heads, d, dtype=torch.float32, device=device)
    for i, seq_len in enumerate(seq_lens):
        g = glob[base[i] // ratio:base[i] // ratio + seq_len // ratio] if ratio else None
        want[qsl[i]:qsl[i + 1]] = attend_request(q[qsl[i]:qsl[i + 1]], swa[base[i]:base[i] + seq_len], g,
                                                  ratio or 1, seq_len, floors[i], WINDOW, sink, scale)
    outs = {}
    # (splits, the longest sequence the split is planned for): as planned, forced, and
    # as a FULL graph plans it, for far longer sequences than any block here holds.
    for splits, longest in [(s, max(seq_lens)) for s in (None, 1, 2, 3, 6)] + [(16, 16 * MAX_LEN)]:
        out = torch.full((qsl[-1], heads, d), float("nan"), dtype=dtype, device=device)
        with _nan_scratch():
            attention_triton.attend(q, out, swa, glob, ratio or 1, blocks, WINDOW, True, sink, scale, longest,
                                    splits=splits)
        outs[(splits, longest)] = out
    return want, outs


@contextlib.contextmanager
def _nan_scratch():
    """The chunks' scratch records start as NaN, not as whatever memory held: the merge
    reads only what the chunks wrote (each block's own rows)."""
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    torch.empty = nan_empty
    try:
        yield
    finally:
        torch.empty = empty


def check_against_reference(device: str) -> None:
    """Every case, whole, in 2, 3 and 6 chunks (after rounding to whole key tiles:
    a 700-key cache in 6 chunks is 6 of 128) and in the 16 of a plan for sequences 16
    times longer (each block cuts its own keys into 16), within fp32 rounding of the
    reference;
    on the GPU in bf16 too, within a bf16 rounding (Triton's interpreter computes the
    kernel's bf16 dots on the raw bits: garbage there, for the whole kernel as for the
    split)."""
    gen = torch.Generator().manual_seed(0)
    dtypes = [(torch.float32, 2e-5)] + ([(torch.bfloat16, 2e-2)] if device != "cpu" else [])
    for dtype, tol in dtypes:
        for case in _cases():
            want, outs = _run_case(device, *case, dtype, gen)
            for plan, out in outs.items():
                err = (out.float() - want).abs().max().item()
                assert err < tol, (case, dtype, plan, err)


def check_split_plan() -> None:
    """The plan splits only few programs over many keys (from MIN_SPLIT_KEYS), in
    whole tiles, at least MIN_CHUNK keys each."""
    plan = attention_triton.split_plan
    assert plan(2, 16, 4096, 132) == 16  # one long prompt's replay rows
    assert plan(2, 16, 8192, 132) == 16  # 17 wanted; in whole tiles, 16 of 512 keys
    assert plan(2, 16, 2048, 132) == 8  # the fewest keys that split
    assert plan(16, 16, 8192, 132) == 3  # a 1,024-row chunk after 7K tokens
    assert plan(64, 16, 4096, 132) == 1  # 1,024 programs: enough already
    assert plan(2, 16, 2047, 132) == 1  # too few keys to split
    assert plan(2, 16, 0, 132) == 1  # no global keys (SWA-only layers)
    assert attention_triton.chunks(700, 6) == 6  # of 128 keys
    assert attention_triton.chunks(100, 3) == 2  # of 64
    assert attention_triton.chunks(60, 3) == 1


def check_model_steps_split(device: str) -> None:
    """The model's attention ops with splits planned as for long prompts (the thresholds
    lowered to 64 keys, so that this small model's steps split): the Triton model's
    logits and KV against the reference model's, fp32, on five layers (sources 1 and 3,
    replay layer 4). In each compared step the two layers that read the ratio-1 cache
    (3, a main layer, and 4) split; the ratio-2 layers' 70 or fewer entries stay whole;
    with ``attention_split=False`` none split."""
    from conftest import small_config
    from replay_backend import RequestChunk, StepRunner, build_model
    from replay_backend.reference.compare import max_abs_err, max_abs_err_kv

    at = attention_triton
    saved = at.MIN_SPLIT_KEYS, at.MIN_CHUNK, at._MERGE
    at.MIN_SPLIT_KEYS = at.MIN_CHUNK = 64
    merges = []
    at._MERGE = lambda *args: (merges.append(args[1]), saved[2](*args))
    try:
        cfg = small_config().with_layers(5, (1, 3)).replace(moe_impl="dense")
        variants = [(dict(attention_impl="reference"), None), (dict(attention_impl="triton"), 2),
                    (dict(attention_impl="triton", attention_split=False), 0)]  # (options, merges per step)
        runs = [StepRunner(build_model(cfg.replace(**opts), device, torch.float32), max_model_len=256)
                for opts, _ in variants]
        for reqs in ([RequestChunk("a", 40, 140)], [RequestChunk("b", 1, 100), RequestChunk("c", 40, 130)]):
            outs = []
            for runner, (opts, want_merges) in zip(runs, variants):
                runner.prefill_context(reqs)
                merges.clear()
                outs.append(runner.step(reqs))
                assert want_merges is None or len(merges) == want_merges, (opts, reqs, merges)
            for run, out in zip(runs[1:], outs[1:]):
                assert max_abs_err(out.logits, outs[0].logits) < 1e-3, reqs
                assert max_abs_err_kv(run.kv, runs[0].kv, out.batch) < 1e-3, reqs
    finally:
        at.MIN_SPLIT_KEYS, at.MIN_CHUNK, at._MERGE = saved
