"""The row-locality analysis refuses every form that mixes rows, by the op's name, and
keeps the row-local ones.

A tiny model runs ``body`` between the replay markers. Where ``body`` mixes rows the
region must be refused (a counted fallback naming the op that mixes them, never the
attribute access before it), and then every step, run without trimming or padding,
must equal the uncompiled model. Where it is row-local the region must be kept, and
the replay rows of a trimmed step must equal the uncompiled model's. The same holds
for padding: a model without markers whose main graph mixes rows runs without graphs.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

import pytest

import replay_backend
from replay_backend.batch import RequestChunk as R
from replay_backend.batch import build_step_batch
from replay_backend.counters import counters
from replay_backend.forward_context import ForwardContext, set_forward_context
from replay_backend.kv_cache import CacheLayout
from replay_backend.passes.region import ReplayRegionError, extract_replay_region
from replay_backend.tracing.boundary import replay_begin, replay_end

pytestmark = pytest.mark.usefixtures("fresh_dynamo", "one_thread")

H, W = 8, 4
OPTIONS = dict(compiler="eager", max_cudagraph_capture_size=16, decoder_replay_trim_threshold=8, max_num_seqs=4)
# An eager step (20 tokens, above the largest graph) and a padded one (12 -> 16 tokens);
# both trim where the region is kept.
STEPS = [[R("a", 20, 20)], [R("a", 10, 10), R("b", 2, 6)]]

_g = torch.Generator().manual_seed(0)
WEIGHT = torch.randn(H, H, generator=_g)
CONV = torch.randn(H, H, 3, generator=_g)
CONV_1 = torch.randn(H, H, 1, generator=_g)
TABLE = torch.randn(64, H, generator=_g)
STATS = (torch.randn(H, generator=_g), torch.rand(H, generator=_g) + 0.5)


def _set_first_row(h):
    x = h.clone()
    x[0] = 0.0
    return x


def _set_first_column(h):
    x = h.clone()
    x[:, 0] = h[:, 1]
    return x


# Each form mixes rows; the op named in the refusal is the one that mixes them.
MIXING = {
    "layer_norm over h.shape": (lambda h, p: F.layer_norm(h, h.shape), "layer_norm"),
    "layer_norm over h.size()": (lambda h, p: F.layer_norm(h, h.size()), "layer_norm"),
    "layer_norm over (T, H)": (lambda h, p: F.layer_norm(h, (h.shape[0], H)), "layer_norm"),
    "layer_norm over transposed rows": (lambda h, p: F.layer_norm(h.T, (h.shape[0],)).T, "layer_norm"),
    "rms_norm over h.shape": (lambda h, p: F.rms_norm(h, h.shape), "rms_norm"),
    "rms_norm over h.size()": (lambda h, p: F.rms_norm(h, h.size()), "rms_norm"),
    "rms_norm over (T, H)": (lambda h, p: F.rms_norm(h, (h.shape[0], H)), "rms_norm"),
    "group_norm, tokens as channels": (lambda h, p: F.group_norm(h.T[None], 2)[0].T, "group_norm"),
    "instance_norm, tokens as length": (lambda h, p: F.instance_norm(h.T[None])[0].T, "instance_norm"),
    "batch_norm in training": (lambda h, p: F.batch_norm(h, None, None, training=True), "batch_norm"),
    "normalize along tokens": (lambda h, p: F.normalize(h, dim=0), "normalize"),
    "normalize, positional dim": (lambda h, p: F.normalize(h, 1, 0), "normalize"),
    "normalize, default dim of h.T": (lambda h, p: F.normalize(h.T).T, "normalize"),
    "local_response_norm, tokens as channels": (lambda h, p: F.local_response_norm(h[None], 3)[0],
                                                "local_response_norm"),
    "view(-1)": (lambda h, p: h.view(-1).softmax(0).view(-1, H), "view"),
    "reshape(H, -1)": (lambda h, p: h.reshape(H, -1).softmax(-1).reshape(-1, H), "reshape"),
    "flatten()": (lambda h, p: h.flatten().softmax(0).view(h.shape), "flatten"),
    "flatten(0, 1)": (lambda h, p: h.view(-1, 2, H // 2).flatten(0, 1).softmax(0).view(-1, H), "flatten"),
    "reshape of h.T": (lambda h, p: h.T.reshape(-1, H), "reshape"),
    "h @ h.T": (lambda h, p: (h @ h.T) @ h, "matmul"),
    "h.T @ h": (lambda h, p: h @ (h.T @ h), "matmul"),
    "h.mT @ h": (lambda h, p: h @ (h.mT @ h), "matmul"),
    "mm(h.t(), h)": (lambda h, p: torch.mm(h, torch.mm(h.t(), h)), "mm"),
    "einsum pairing rows": (lambda h, p: torch.einsum("th,sh->ts", h, h) @ h, "einsum"),
    "einsum over rows": (lambda h, p: h @ torch.einsum("th,tk->hk", h, h), "einsum"),
    "outer of two rows' vectors": (lambda h, p: h + torch.outer(h[:, 0], h[:, 1]).sum(0)[:, None], "outer"),
    "conv1d over h.T": (lambda h, p: F.conv1d(h.T[None], CONV, padding=1)[0].T, "conv1d"),
    "avg_pool1d over h.T": (lambda h, p: F.avg_pool1d(h.T[None], 3, 1, 1)[0].T, "avg_pool1d"),
    "adaptive_max_pool1d over h.T": (lambda h, p: h + F.adaptive_max_pool1d(h.T[None], 1)[0].T,
                                     "adaptive_max_pool1d"),
    "pad along tokens": (lambda h, p: F.pad(h, (0, 0, 1, 0))[:-1], "pad"),
    "pad shifting rows": (lambda h, p: F.pad(h, (0, 0, 1, -1)), "pad"),
    "roll along tokens": (lambda h, p: torch.roll(h, 1, 0), "roll"),
    "roll flattened": (lambda h, p: h.roll(1), "roll"),
    "diff along tokens": (lambda h, p: torch.diff(h, dim=0, prepend=torch.zeros(1, H)), "diff"),
    "cumsum along tokens": (lambda h, p: h.cumsum(0), "cumsum"),
    "cumprod along tokens": (lambda h, p: h.cumprod(dim=0), "cumprod"),
    "cummax along tokens": (lambda h, p: h.cummax(0).values, "cummax"),
    "logcumsumexp along tokens": (lambda h, p: h.logcumsumexp(0), "logcumsumexp"),
    "softmax(dim=0)": (lambda h, p: F.softmax(h, dim=0), "softmax"),
    "softmax of h.T": (lambda h, p: F.softmax(h.T, -1).T, "softmax"),
    "permuted cumsum": (lambda h, p: h.permute(1, 0).cumsum(1).permute(1, 0), "cumsum"),
    "mean()": (lambda h, p: h - h.mean(), "mean"),
    "sum()": (lambda h, p: h - h.sum(), "sum"),
    "norm()": (lambda h, p: h / h.norm(), "norm"),
    "std()": (lambda h, p: h / h.std(), "std"),
    "var over tokens": (lambda h, p: h - h.var(0), "var"),
    "median over tokens": (lambda h, p: h - h.median(0).values, "median"),
    "vector_norm over tokens": (lambda h, p: h / torch.linalg.vector_norm(h, dim=0), "linalg_vector_norm"),
    "sort along tokens": (lambda h, p: h.sort(0).values, "sort"),
    "topk along tokens": (lambda h, p: h + h.topk(2, 0).values.sum(0), "topk"),
    "index_select by computed rows": (lambda h, p: h.index_select(0, p % 2), "index_select"),
    "gather along tokens": (lambda h, p: h.gather(0, (p % 2)[:, None].expand(-1, H)), "gather"),
    "scatter_add into rows": (lambda h, p: torch.zeros_like(h).scatter_add(0, (p % 2)[:, None].expand(-1, H), h),
                              "scatter_add"),
    "index_add into rows": (lambda h, p: torch.zeros_like(h).index_add(0, p % 2, h), "index_add"),
    "embedding in a table of rows": (lambda h, p: F.embedding(p % 2, h), "embedding"),
    "flip along tokens": (lambda h, p: h.flip(0), "flip"),
    "h[1:]": (lambda h, p: torch.cat([h[1:], h[:1]]), "getitem"),
    "h[:-1]": (lambda h, p: torch.cat([h[-1:], h[:-1]]), "getitem"),
    "cat along tokens": (lambda h, p: torch.cat([h, h]).view(-1, 2, H).mean(1), "cat"),
    "unfold along tokens": (lambda h, p: h.unfold(0, 2, 1).sum(-1), "unfold"),
    "cosine_similarity along tokens": (lambda h, p: h * F.cosine_similarity(h, h.exp(), dim=0), "cosine_similarity"),
    "tril": (lambda h, p: torch.tril(h), "tril"),
    "masked_scatter": (lambda h, p: torch.zeros_like(h).masked_scatter(h > 0, h), "masked_scatter"),
    "attention over tokens": (lambda h, p: F.scaled_dot_product_attention(h[None], h[None], h[None])[0],
                              "scaled_dot_product_attention"),
    "a row written from a row index": (lambda h, p: _set_first_row(h), "setitem"),
    "the row count as a factor": (lambda h, p: h * h.shape[0], "mul"),
    "the row count as a divisor": (lambda h, p: h / h.size(0), "truediv"),
    "the row count as a fill value": (lambda h, p: h + torch.full_like(h, h.shape[0]), "full_like"),
}

# Row-local forms of the same ops: the region is kept and trims exactly.
ROW_LOCAL = {
    "dropout out of training": lambda h, p: F.dropout(h, 0.5, training=False),
    "layer_norm over the features": lambda h, p: F.layer_norm(h, (H,)),
    "layer_norm over h.shape[1:]": lambda h, p: F.layer_norm(h, h.shape[1:]),
    "rms_norm over [H]": lambda h, p: F.rms_norm(h, [h.shape[-1]]),
    "group_norm, tokens as the batch": lambda h, p: F.group_norm(h, 2),
    "instance_norm, tokens as channels": lambda h, p: F.instance_norm(h[None])[0],
    "batch_norm from running statistics": lambda h, p: F.batch_norm(h, *STATS, training=False),
    "normalize, default dim": lambda h, p: F.normalize(h),
    "local_response_norm over the features": lambda h, p: F.local_response_norm(h.T[None], 3)[0].T,
    "view keeping the rows": lambda h, p: h.view(h.shape[0], 2, -1).softmax(1).view(h.shape[0], -1),
    "unflatten(1, ...)": lambda h, p: h.unflatten(1, (2, -1)).softmax(-1).flatten(1),
    "reshape behind a leading group": lambda h, p: h.view(-1, 2, 4).transpose(0, 1).reshape(2, -1, 2, 2)
    .transpose(0, 1).reshape(-1, H),
    "weight @ h.T": lambda h, p: (WEIGHT @ h.T).T,
    "softmax of h.T along the features": lambda h, p: h.T.softmax(0).T,
    "avg_pool1d over the features": lambda h, p: F.avg_pool1d(h[:, None], 3, 1, 1)[:, 0],
    "pad of the features": lambda h, p: F.pad(h, (1, 0))[:, :H],
    "roll and diff along the features": lambda h, p: h.roll(1, -1) + torch.diff(h, dim=-1, prepend=h[:, :1]),
    "sort, default dim": lambda h, p: h.sort().values,
    "gather along the features": lambda h, p: h.gather(1, h.argsort(1)),
    "a column written from a column": lambda h, p: _set_first_column(h),
    "embedding and table rows by position": lambda h, p: h + F.embedding(p % 64, TABLE) + TABLE[p % 64],
    "batched products": lambda h, p: torch.bmm(h.view(-1, 2, 4), h.view(-1, 4, 2)).view(-1, 4).repeat(1, 2),
    "features concatenated and stacked": lambda h, p: torch.stack([torch.cat([h, h], -1)[:, :H], h], 0).sum(0),
}


class Tiny(nn.Module):
    """``body`` between the markers (or alone, without them), a linear layer each side."""

    def __init__(self, body, markers: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out = nn.Linear(H, H), nn.Linear(H, H)
        self.body, self.markers = body, markers

    def forward(self, x, pos):
        h = self.inp(x) + pos[:, None] * 0.01
        if not self.markers:
            return self.out(self.body(h, pos))
        h, p = replay_begin(h, pos, window=W)
        (h,) = replay_end(self.out(self.body(h, p)))
        return h


def run_step(compiled, model, reqs, seed=0):
    """(compiled out, uncompiled out, batch) of one step."""
    b = build_step_batch(reqs, [[0] * r.query_len for r in reqs], list(range(len(reqs))), CacheLayout(128, 8), W,
                         "cpu")
    x = torch.randn(b.num_tokens, H, generator=torch.Generator().manual_seed(seed))
    pos = b.positions.clone()
    with torch.inference_mode():
        with set_forward_context(ForwardContext(b, None)):
            y = compiled(x, pos)
        with set_forward_context(ForwardContext(b, None)):
            ref = model(x, pos)
    return y, ref, b


ROW_FALLBACKS = ("replay_region_unsupported", "main_graphs_padding_unsafe")


def compiled_steps(model):
    """The compiled model, every step's outputs, the counters the steps moved and the
    fallbacks among them that row-locality decides."""
    compiled = replay_backend.compile(model, ("x", "pos"), options=OPTIONS)
    before = counters.state()
    results = [run_step(compiled, model, reqs, seed=i) for i, reqs in enumerate(STEPS)]
    moved = counters.moved_since(before)
    fallbacks = {k: v for k, v in moved.get("fallbacks", {}).items() if k in ROW_FALLBACKS}
    return compiled, results, moved, fallbacks


@pytest.mark.parametrize("name", list(MIXING))
def test_a_region_that_mixes_rows_is_refused_by_the_op_and_runs_like_the_model(name):
    body, op = MIXING[name]
    model = Tiny(body).eval()
    compiled, results, moved, fallbacks = compiled_steps(model)
    reason = replay_backend.plan_of(compiled).replay_off_reason
    assert fallbacks == {"replay_region_unsupported": 1, "main_graphs_padding_unsafe": 1}, (fallbacks, reason)
    assert reason.startswith("replay region is not row-local: ") and f"({op})" in reason, reason
    assert "getattr" not in reason, reason
    assert "trims" not in moved and "untrimmed" not in moved  # no trim op: every row ran in the main graph
    for y, ref, b in results:
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(ROW_LOCAL))
def test_a_row_local_region_is_kept_and_trims_exactly(name):
    model = Tiny(ROW_LOCAL[name]).eval()
    compiled, results, moved, fallbacks = compiled_steps(model)
    reason = replay_backend.plan_of(compiled).replay_off_reason
    assert fallbacks == {} and reason is None, (fallbacks, reason)
    assert moved.get("trims") == len(STEPS)
    for y, ref, b in results:
        rows = b.replay.rows_t
        torch.testing.assert_close(y[rows], ref[rows], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["layer_norm over h.shape", "rms_norm over h.size()", "h.T @ h",
                                  "conv1d over h.T", "the row count as a factor"])
def test_a_main_graph_that_mixes_rows_is_not_padded(name, caplog):
    """Without markers, padding a step's rows with dummies would change its real ones:
    its steps run without graphs, on exactly their rows, and the warning names the op."""
    body, op = MIXING[name]
    model = Tiny(body, markers=False).eval()
    with caplog.at_level(logging.WARNING, logger="replay_backend"):
        compiled, results, moved, fallbacks = compiled_steps(model)
    assert fallbacks == {"main_graphs_padding_unsafe": 1}, fallbacks
    warned = [r.getMessage() for r in caplog.records if "main_graphs_padding_unsafe" in r.getMessage()]
    assert len(warned) == 1 and f"({op})" in warned[0] and "getattr" not in warned[0], warned
    for y, ref, b in results:
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


# Forms whose trace holds for some token counts only (folds that need an even count,
# kernels whose shape checks compare the count with a constant): the backend may refuse
# such a graph before its region is looked at, so the analysis is checked on its own,
# on a graph traced at one count.
TRACED_ONCE = {
    "reshape(-1, 2H)": (lambda h, p: h.reshape(-1, 2 * H).softmax(-1).reshape(-1, H), "reshape"),
    "unflatten(0, ...)": (lambda h, p: h.unflatten(0, (-1, 2)).sum(1).repeat_interleave(2, 0), "unflatten"),
    "view(-1, 2, H)": (lambda h, p: h.view(-1, 2, H).sum(1).repeat_interleave(2, 0), "view"),
    "cdist": (lambda h, p: torch.cdist(h, h) @ h, "cdist"),
    "conv1d, tokens as the batch": (lambda h, p: F.conv1d(h[:, :, None], CONV_1)[:, :, 0], None),
}


def traced_region(body):
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    x, pos = torch.randn(12, H), torch.arange(12)
    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.mark_dynamic(pos, 0)
    torch.compile(Tiny(body).eval(), backend=capture, fullgraph=True)(x, pos)
    return extract_replay_region(graphs[0], (), ())


@pytest.mark.parametrize("name", list(TRACED_ONCE))
def test_the_analysis_alone_on_forms_traced_for_one_count(name):
    body, op = TRACED_ONCE[name]
    if op is None:  # row-local
        assert traced_region(body) is not None
        return
    with pytest.raises(ReplayRegionError, match="not row-local") as e:
        traced_region(body)
    assert f"({op})" in str(e.value) and "getattr" not in str(e.value), e.value


@pytest.mark.parametrize("name, body, op", [
    ("dropout in training", lambda h, p: F.dropout(h, 0.1, training=True), "dropout"),
    ("rand_like noise", lambda h, p: h + torch.rand_like(h), "rand_like"),
])
def test_random_numbers_drawn_per_row_place_are_refused(name, body, op):
    """A row's random numbers follow its place in the step's draw, which trimming and
    padding move: the region is refused, naming the op (results differ by design)."""
    compiled, results, moved, fallbacks = compiled_steps(Tiny(body).eval())
    reason = replay_backend.plan_of(compiled).replay_off_reason
    assert f"({op}) draws random numbers" in reason, reason
    assert fallbacks == {"replay_region_unsupported": 1, "main_graphs_padding_unsafe": 1}
