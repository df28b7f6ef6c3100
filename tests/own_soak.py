"""A serving soak for an own model (tests/llama_swa.py, tests/gqa_rope.py, or any model
an :class:`~own_server.OwnServer` can serve): the compiled, captured, serving model
against the same model run eagerly (the oracle, same weights), step by step.

Random chained traffic (seeded) drives both servers as a server loop would: requests
arrive, are prefilled (in one step, or in chunks after their cached context), decode
one token at a time or 2-4 at once (speculative-style), finish and give their cache
block back to a later request. Some prefills are longer than W (they trim), some keep
every row (``keep_all``), some have a later floor (``kv_start``). Each step's token count
is drawn so that every way a step can run comes up: lone one-token steps, batches of
decodes, graphed steps below the trim threshold (the region in the main graphs),
graphed steps that trim (the region in a replay graph), and steps above the largest
capture size (no main graphs) with and without rows to trim.

Each step compares each request's last-row logits and every cache entry the step wrote
that a later step may read (``OwnServer.written``) with an fp32 tolerance, then gives the
compiled server's compared entries the oracle's values, so a mismatch is reported for
the step that made it. A step during which the backend recompiled, traced, captured or
fell back is a mismatch too.
"""
from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch

import replay_backend
from replay_backend import RequestChunk, StepResult, counters
from own_server import OwnServer, gqa_cache, llama_cache

# Counters that must not move while serving: a new trace, a recompile, a capture, a
# compiled piece or a fallback after start_serving().
WATCHED = ("graphs_seen", "recompiles", "captures", "compilations", "fallbacks")


def make_llama(seed: int = 0):
    from llama_swa import LlamaSWA

    return LlamaSWA(window=8, seed=seed)


def make_gqa(seed: int = 0):
    from gqa_rope import GQARope

    return GQARope(window=12, seed=seed)


# name: (the model at a seed, its cache factory)
MODELS: dict[str, tuple[Callable, Callable]] = {"llama": (make_llama, llama_cache), "gqa": (make_gqa, gqa_cache)}


# ---- traffic --------------------------------------------------------------------------
@dataclass
class _Live:
    req_id: str
    prompt: int
    keep_all: bool
    decodes: int  # decode steps to go once the prompt is in
    done: int = 0  # tokens in cache

    @property
    def decoding(self) -> bool:
        return self.done >= self.prompt


class Traffic:
    """Chained random steps within a server's limits. Each step is one of:

    * ``lone``: one request, one token (a decode, or a one-token chunk or prompt);
    * ``decodes``: every decoding request, each 1 token or a speculative 2-4;
    * a token band: ``small`` below the trim threshold (a graphed step that does not
      trim), ``trim`` from the threshold to the largest capture size (a graphed step
      that trims), ``big`` above it (no main graphs; trims where a chunk is longer than
      W) and ``flat`` above it with every chunk at most W or keep_all (nothing to trim).
      A band step takes decodes first, then unfinished prompts' next chunks, then new
      requests, until its token count is reached."""

    MODES = (("lone", 3), ("decodes", 2), ("small", 3), ("trim", 3), ("big", 2), ("flat", 2))

    def __init__(self, seed: int, *, window: int, trim_threshold: int, max_capture_size: int,
                 max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> None:
        self.rng = random.Random(seed)
        self.window, self.max_tokens = window, max_num_batched_tokens
        self.max_seqs, self.max_len = max_num_seqs, max_model_len
        top = max_num_batched_tokens
        bands = {"small": (1, trim_threshold - 1, None), "trim": (trim_threshold, max_capture_size, None),
                 "big": (max_capture_size + 1, top, None), "flat": (max_capture_size + 1, top, window)}
        self.bands = {k: (lo, min(hi, top), cap) for k, (lo, hi, cap) in bands.items() if lo <= min(hi, top)}
        self.modes = [(m, w) for m, w in self.MODES if m in ("lone", "decodes") or m in self.bands]
        self.live: dict[str, _Live] = {}
        self.next_id = 0
        self.features: Counter = Counter()  # what the traffic sent, by feature

    # ---- a step --------------------------------------------------------------------------
    def step(self) -> list[RequestChunk]:
        rng = self.rng
        mode = rng.choices([m for m, _ in self.modes], [w for _, w in self.modes])[0]
        if mode == "lone":
            chunks = self._lone()
        elif mode == "decodes":
            chunks = self._decodes()
        else:
            chunks = self._band(*self.bands[mode])
        if not chunks:  # nothing to decode: a band step instead
            chunks = self._band(*self.bands.get("small", next(iter(self.bands.values()))))
        if not chunks:  # every block taken and every draw skipped: one token of some request
            r = rng.choice(list(self.live.values()))
            chunks = [self._chunk(r, 1)]
        return chunks

    def _lone(self) -> list[RequestChunk]:
        rng = self.rng
        decoding = [r for r in self.live.values() if r.decoding]
        prompting = [r for r in self.live.values() if not r.decoding]
        if decoding and (rng.random() < 0.8 or not prompting):
            return [self._chunk(rng.choice(decoding), 1)]
        if prompting:
            return [self._chunk(rng.choice(prompting), 1)]  # a one-token chunk after its context
        if len(self.live) < self.max_seqs:
            return [self._chunk(self._arrive(prompt=rng.choice((1, 1, 2, 5))), 1)]
        return []

    def _decodes(self) -> list[RequestChunk]:
        rng = self.rng
        chunks, room = [], self.max_tokens
        for r in [r for r in self.live.values() if r.decoding]:
            q = min(room, self._room(r), 1 if rng.random() < 0.6 else rng.randint(2, 4))
            if q > 0:
                chunks.append(self._chunk(r, q))
                room -= q
        return chunks

    def _band(self, lo: int, hi: int, cap: int | None) -> list[RequestChunk]:
        rng = self.rng
        room = rng.randint(lo, hi)
        cap = cap or self.max_tokens
        chunks: list[RequestChunk] = []
        for r in list(self.live.values()):  # decodes first
            if room and r.decoding and rng.random() < 0.8:
                q = min(room, self._room(r), rng.choice((1, 1, 1, 2, 3, 4)))
                if q > 0:
                    chunks.append(self._chunk(r, q))
                    room -= q
        for r in list(self.live.values()):  # then the prompts' next chunks
            if room and not r.decoding:
                q = min(room, r.prompt - r.done, self.max_tokens if r.keep_all else cap)
                chunks.append(self._chunk(r, q))
                room -= q
        while room and len(self.live) < self.max_seqs:  # then new requests
            r = self._arrive(keep_all=0.5 if cap < self.max_tokens else 0.12)
            q = min(room, r.prompt, self.max_tokens if r.keep_all else cap)
            chunks.append(self._chunk(r, q))
            room -= q
        return chunks

    # ---- requests ------------------------------------------------------------------------
    def _room(self, r: _Live) -> int:
        return self.max_len - r.done

    def _arrive(self, keep_all: float = 0.0, prompt: int | None = None) -> _Live:
        rng = self.rng
        keep = rng.random() < keep_all
        longest = self.max_len // 2
        if prompt is None:  # log-uniform from 1 to half the cache block
            prompt = max(1, min(longest, int(round(2 ** rng.uniform(0, longest.bit_length() - 1)))))
        r = _Live(f"r{self.next_id}", prompt, keep, rng.choice((0, 1, 2, 4, 8, 16)))
        self.next_id += 1
        self.live[r.req_id] = r
        return r

    def _chunk(self, r: _Live, q: int) -> RequestChunk:
        """The next ``q`` tokens of ``r`` (a prefill chunk while its prompt is not in)."""
        rng, w = self.rng, self.window
        seq_len = r.done + q
        prefill = not r.decoding
        kv_start = None
        if prefill and not r.keep_all and q > w and rng.random() < 0.3:
            kv_start = seq_len - w + rng.randint(1, max(1, w // 2))  # a later floor
        elif prefill and rng.random() < 0.03:
            kv_start = rng.randrange(seq_len)  # a floor the chunk's length overrides (<= W: none; keep_all)
        f = self.features
        if prefill:
            f["prefill chunk after context" if r.done else "new prefill"] += 1
            f["prefill longer than W"] += q > w
            f["keep_all chunk"] += r.keep_all
            f["prompt chunked"] += r.done == 0 and q < r.prompt
        else:
            f["decode" if q == 1 else "speculative decode (2-4)"] += 1
        f["later floor (kv_start)"] += kv_start is not None and q > w and not r.keep_all
        return RequestChunk(r.req_id, q, seq_len, keep_all=r.keep_all and prefill, kv_start=kv_start)

    def advance(self, chunks: list[RequestChunk]) -> list[str]:
        """Account for a step that ran; returns the requests it finished."""
        finished = []
        for c in chunks:
            r = self.live[c.req_id]
            was_decoding = r.decoding
            r.done = c.seq_len
            r.decodes -= was_decoding
            if r.decoding and (r.decodes <= 0 or r.done >= self.max_len - 4):
                finished.append(r.req_id)
                del self.live[r.req_id]
        self.features["finished (block freed)"] += len(finished)
        return finished


def spec_of(chunks) -> str:
    """The step's requests, each ``id:query_len/seq_len`` with ``+keep`` and ``@kv_start``."""
    return ", ".join(f"{c.req_id}:{c.query_len}/{c.seq_len}" + ("+keep" if c.keep_all else "")
                     + (f"@{c.kv_start}" if c.kv_start is not None else "") for c in chunks)


def step_kind(result: StepResult) -> str:
    """How the step ran: main graphs or eager, trimmed or not, the replay layers in a
    graph or not (and the trim op's gathers and scatter in graphs)."""
    parts = [result.kind.value, "trimmed" if result.trimmed else "untrimmed",
             "replay-graph" if result.replay_graph else "replay-eager"]
    if result.io_graphs:
        parts.append("io-graphs")
    return "/".join(parts)


# ---- the soak -------------------------------------------------------------------------
@dataclass
class Mismatch:
    step: int
    spec: str
    kind: str
    what: str
    err: float

    def render(self) -> str:
        return f"MISMATCH step {self.step} [{self.kind}] {self.what} {self.err:.3g}: {self.spec}"


@dataclass
class SoakReport:
    model: str
    seed: int
    device: str
    compiler: str
    tolerance: float
    steps: int = 0
    kinds: Counter = field(default_factory=Counter)  # step_kind -> steps
    lone: Counter = field(default_factory=Counter)  # one-token steps, by step_kind
    features: Counter = field(default_factory=Counter)  # the traffic's
    worst: dict = field(default_factory=dict)  # part -> the largest error seen
    mismatches: list[Mismatch] = field(default_factory=list)
    counters_moved: dict = field(default_factory=dict)  # while serving, the watched ones
    seconds: float = 0.0
    capture: dict = field(default_factory=dict)  # capture()'s summary

    @property
    def ok(self) -> bool:
        return not self.mismatches and not self.counters_moved

    def render(self) -> str:
        lines = [f"own soak: model {self.model}, seed {self.seed}, {self.device}, compiler {self.compiler}, "
                 f"{self.steps} steps in {self.seconds:.1f} s, fp32 tolerance {self.tolerance:g}", "step kinds:"]
        lines += [f"  {n:5d}  {k}" + (f"  ({self.lone[k]} of one token)" if self.lone[k] else "")
                  for k, n in sorted(self.kinds.items())]
        lines.append("traffic: " + ", ".join(f"{k} {n}" for k, n in sorted(self.features.items())))
        lines.append("largest error: " + ", ".join(f"{k} {v:.3g}" for k, v in sorted(self.worst.items())))
        if self.capture:
            lines.append("captured: " + ", ".join(f"{k} {v['graphs']} graphs at {v['sizes']} sizes ({v['gib']:.3f} GiB)"
                                                  for k, v in self.capture.items() if isinstance(v, dict)))
        lines.append(f"counters moved while serving: {self.counters_moved or 'none'}")
        lines += [m.render() for m in self.mismatches]
        lines.append(f"{len(self.mismatches)} mismatches")
        return "\n".join(lines)

    def assert_clean(self) -> None:
        assert self.ok, self.render()


def _err(got: torch.Tensor, want: torch.Tensor, tol: float) -> tuple[float, bool]:
    """The largest |got - want| and whether it is beyond ``tol`` (absolute and relative:
    ``|d| > tol * (1 + |want|)`` somewhere), NaN and infinity beyond any."""
    if got.numel() == 0:
        return 0.0, False
    got, want = got.float(), want.float()
    d = (got - want).abs()
    if not torch.isfinite(got).all():
        return float("inf"), True
    return d.max().item(), bool((d > tol * (1 + want.abs())).any())


class OwnSoak:
    def __init__(self, server: OwnServer, oracle: OwnServer, traffic: Traffic, report: SoakReport,
                 sync: bool = True) -> None:
        self.server, self.oracle, self.traffic, self.report, self.sync = server, oracle, traffic, report, sync

    def one(self, i: int) -> None:
        rep, tol = self.report, self.report.tolerance
        chunks = self.traffic.step()
        spec = spec_of(chunks)
        tokens = [torch.tensor([self.traffic.rng.randrange(self.server.model.head.out_features)
                                for _ in range(c.query_len)]) for c in chunks]
        before = counters.state()
        got, result = self.server.step(chunks, tokens)
        moved = {k: v for k, v in counters.moved_since(before).items() if k in WATCHED}
        want, _ = self.oracle.step(chunks, tokens)
        kind = step_kind(result)
        rep.steps += 1
        rep.kinds[kind] += 1
        rep.lone[kind] += result.num_tokens == 1
        found = []
        if moved:
            found.append(Mismatch(i, spec, kind, f"counters moved {moved}", float("nan")))
            for k, v in moved.items():
                rep.counters_moved[k] = (Counter(rep.counters_moved.get(k, {})) + Counter(v)) if isinstance(v, dict) \
                    else rep.counters_moved.get(k, 0) + v
        err, bad = _err(got, want, tol)
        rep.worst["logits"] = max(rep.worst.get("logits", 0.0), err)
        if bad:
            found.append(Mismatch(i, spec, kind, "logits", err))
        first = None
        for (layer, which, a), (_, _, b) in zip(self.server.written(chunks), self.oracle.written(chunks)):
            part = "kv before region" if layer < self.server.model.replay_from else "kv replay layers"
            err, bad = _err(a, b, tol)
            rep.worst[part] = max(rep.worst.get(part, 0.0), err)
            if bad and first is None:
                first = Mismatch(i, spec, kind, f"{which} cache, first at layer {layer}", err)
        if first is not None:
            found.append(first)
        rep.mismatches += found
        if self.sync:
            self._sync(chunks)
        for req_id in self.traffic.advance(chunks):
            self.server.free(req_id)
            self.oracle.free(req_id)

    def _sync(self, chunks) -> None:
        """The compiled server's compared entries take the oracle's values."""
        s, o = self.server, self.oracle
        for layer in range(len(s.model.layers)):
            mine = torch.tensor(s.written_slots(chunks, layer), dtype=torch.int64, device=s.device)
            theirs = torch.tensor(o.written_slots(chunks, layer), dtype=torch.int64, device=o.device)
            for a, b in ((s.cache.k[layer], o.cache.k[layer]), (s.cache.v[layer], o.cache.v[layer])):
                a.index_copy_(0, mine, b.index_select(0, theirs))

    def run(self, steps: int, log: Callable[[str], None] | None = None, every: int = 50) -> SoakReport:
        t0 = time.perf_counter()
        for i in range(steps):
            seen = len(self.report.mismatches)
            self.one(i)
            if log is not None:
                for m in self.report.mismatches[seen:]:
                    log(m.render())
                if (i + 1) % every == 0:
                    log(f"step {i + 1}: {time.perf_counter() - t0:.1f} s, {len(self.report.mismatches)} mismatches")
        self.report.seconds += time.perf_counter() - t0
        self.report.features = self.traffic.features
        return self.report


def soak_options(compiler: str = "eager", capture_sizes=(1, 2, 4, 8, 16, 32, 64), trim_threshold: int = 32,
                 replay_sizes=None, max_num_seqs: int = 8, max_num_batched_tokens: int = 256) -> dict:
    """The backend options of a soak: ``replay_sizes`` None takes the backend's default
    replay sizes, which ``max_num_seqs`` bounds (with ``W``)."""
    opts = {"compiler": compiler, "cudagraph_capture_sizes": list(capture_sizes),
            "decoder_replay_trim_threshold": trim_threshold, "max_num_batched_tokens": max_num_batched_tokens}
    if replay_sizes:
        opts["decoder_replay_cudagraph_capture_sizes"] = list(replay_sizes)
    else:
        opts["max_num_seqs"] = max_num_seqs
    return opts


def make_soak(model_name: str, seed: int = 0, *, device="cpu", compiler: str = "eager",
              capture_sizes=(1, 2, 4, 8, 16, 32, 64), trim_threshold: int = 32, replay_sizes=None,
              max_num_seqs: int = 8, max_num_batched_tokens: int = 256, max_model_len: int = 512,
              tolerance: float | None = None, model_seed: int = 0, log=None) -> OwnSoak:
    """Build ``model_name`` (a key of :data:`MODELS`) in fp32 on ``device``, compile it
    with ``replay_backend.compile``, warm up, capture and start serving, and pair it with
    its eager run. ``tolerance``: 1e-5 by default."""
    make_model, make_cache = MODELS[model_name]
    device = torch.device(device)
    model = make_model(model_seed).to(device=device, dtype=torch.float32).eval()
    opts = soak_options(compiler, capture_sizes, trim_threshold, replay_sizes, max_num_seqs, max_num_batched_tokens)
    t0 = time.perf_counter()
    compiled = replay_backend.compile(model, ("input_ids", "positions"), options=opts)
    server = OwnServer(model, make_cache, compiled, max_model_len=max_model_len, max_num_seqs=max_num_seqs)
    summary = server.serve()
    if log is not None:
        log(f"{model_name}: compiled and captured in {time.perf_counter() - t0:.1f} s "
            f"(main graphs {summary['main']['graphs']}, replay graphs {summary['replay']['graphs']})")
    oracle = OwnServer(model, make_cache, max_model_len=max_model_len, max_num_seqs=max_num_seqs)
    traffic = Traffic(seed, window=model.window, trim_threshold=trim_threshold, max_capture_size=max(capture_sizes),
                      max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                      max_model_len=max_model_len)
    if tolerance is None:
        tolerance = 1e-5
    report = SoakReport(model_name, seed, str(device), compiler, tolerance, capture=summary)
    return OwnSoak(server, oracle, traffic, report)


def soak(model_name: str, steps: int, seed: int = 0, log=None, **kw) -> SoakReport:
    """:func:`make_soak` and ``steps`` steps of it."""
    return make_soak(model_name, seed, log=log, **kw).run(steps, log)
