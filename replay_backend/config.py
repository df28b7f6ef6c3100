"""Backend options: parsing, validation and the capture sizes they give (sizes.py holds
the size limits, checks and default schedules).

Every option is checked here, when the config is made, before anything is traced,
compiled or allocated: a bad value raises ``ValueError`` naming the option. Options
that a switch turns off are logged once as a note (:func:`ReplayConfig.notes`);
docs/configuration.md lists each such pair and why it is a note, not an error.
"""
from __future__ import annotations

import dataclasses
import operator
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from .sizes import (MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS, SEQS_WHY, TOKENS_WHY,  # noqa: F401 (re-exported)
                    check_size, default_capture_sizes, default_replay_capture_sizes, is_int, padded_size)


CUDAGRAPH_MODES = ("piecewise", "none", "full", "full_decode_only", "full_and_piecewise")
# The modes with FULL graphs (a whole step in one graph, attention included), and those
# with piecewise ones (graph pieces between eager attention ops).
FULL_MODES = ("full", "full_decode_only", "full_and_piecewise")
PIECEWISE_MODES = ("piecewise", "full_and_piecewise")
COMPILERS = ("inductor", "eager")
MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# Dump directory when the option is not given: turns dumps on without touching code.
DUMP_ENV_VAR = "DSV41_REPLAY_DUMP"

# The keys whose values are lists (a set is taken too: the list is sorted and deduped).
LIST_OPTIONS = ("cudagraph_capture_sizes", "decoder_replay_cudagraph_capture_sizes", "splitting_ops")


def _as_list(key: str, val) -> tuple:
    """A list option's value as a tuple: a list, tuple, set or range (a set is fine:
    the sizes are sorted and deduped anyway); a comma-separated string for
    splitting_ops. A dict is refused, not taken as its keys, and so is a single value."""
    if key == "splitting_ops" and isinstance(val, str):
        return tuple(v for v in val.split(",") if v)
    if isinstance(val, (list, tuple, set, frozenset, range)):
        return tuple(val)
    example = "['a::b', 'c::d']" if key == "splitting_ops" else "[1, 2, 4, 8]"
    raise ValueError(f"option {key} must be a list (e.g. {example}), got {type(val).__name__} {val!r}")


@dataclass(frozen=True)
class ReplayConfig:
    cudagraph_mode: str = "piecewise"
    cudagraph_capture_sizes: tuple[int, ...] | None = None
    max_cudagraph_capture_size: int | None = None  # default 1024, or max of the explicit sizes
    cudagraph_decoder_replay: bool = True
    decoder_replay: bool = True  # kill switch: False leaves the replay layers in the main graph
    decoder_replay_trim_threshold: int = 768
    decoder_replay_cudagraph_capture_sizes: tuple[int, ...] | None = None
    trim_io_graphs: bool = True  # the trim op's gathers and scatter as graphs in graphed steps
    direct_dispatch: bool = True  # served steps call the compiled model without Dynamo's entry
    metadata_in_place: bool = True  # served steps' metadata at one address, read there by trim graphs
    # None: the ops of the traced graph that the model declared attention ops
    # (passes/roles.py); an explicit list overrides the declarations.
    splitting_ops: tuple[str, ...] | None = None
    compiler: str = "inductor"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 16384
    # A uniform decode batch: every request has exactly this many tokens (1 +
    # speculative tokens). Steps of FULL graphs under full_decode_only, or with
    # attention that supports only those.
    uniform_decode_query_len: int = 1
    strict: bool = False  # fallbacks raise instead of being logged and counted
    debug_check_addresses: bool = False  # check input addresses on every replay, not only the first
    debug_check_ranks: bool = False  # tensor-parallel ranks check every step's plan is the same on each
    debug_dump_path: str | None = None
    inductor_mode: str | None = field(default=None, repr=False)
    # The options the caller gave (from_options), for notes on options a switch makes moot.
    _given: frozenset[str] | None = field(default=None, repr=False, compare=False)

    # ---- construction ---------------------------------------------------------------
    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None = None, mode: str | None = None) -> "ReplayConfig":
        if options is not None and not isinstance(options, Mapping):
            raise ValueError(
                f"dsv41_replay options must be a dict of option names to values, got {type(options).__name__} "
                f"{options!r}; e.g. options={{'compiler': 'eager', 'max_num_batched_tokens': 8192}}")
        if mode is not None and mode not in MODES:
            raise ValueError(f"mode={mode!r} is not supported; choose one of {[m for m in MODES if m]}")
        options = dict(options or {})
        bad_keys = [k for k in options if not isinstance(k, str)]
        if bad_keys:
            raise ValueError(f"dsv41_replay option names must be strings, got {bad_keys[0]!r}")
        names = {f.name for f in dataclasses.fields(cls) if f.init and f.name not in ("inductor_mode", "_given")}
        unknown = sorted(set(options) - names)
        if unknown:
            groups = [k for k in unknown if k in ("dp_group", "tp_group")]
            hint = (f"; {' and '.join(groups)} are process groups, not options: pass them to "
                    f"ReplayBackend({', '.join(f'{g}=...' for g in groups)}) and give that backend to torch.compile "
                    "or replay_backend.compile") if groups else ""
            raise ValueError(f"unknown dsv41_replay option(s) {unknown}; known options: {sorted(names)}{hint}")
        for key in LIST_OPTIONS:
            if options.get(key) is not None:
                options[key] = _as_list(key, options[key])
        given = frozenset(options)
        if options.get("debug_dump_path") is None and os.environ.get(DUMP_ENV_VAR):
            options["debug_dump_path"] = os.environ[DUMP_ENV_VAR]
        if mode == "reduce-overhead" and options.get("cudagraph_mode") == "none":
            raise ValueError("mode='reduce-overhead' asks for CUDA graphs and option cudagraph_mode='none' turns "
                             "them off: drop one of the two")
        if mode in ("max-autotune", "max-autotune-no-cudagraphs") and options.get("compiler") == "eager":
            raise ValueError(f"mode={mode!r} autotunes Inductor's pieces and option compiler='eager' compiles "
                             "none with Inductor: drop one of the two")
        inductor_mode = mode if mode in ("max-autotune", "max-autotune-no-cudagraphs") else None
        return cls(**options, inductor_mode=inductor_mode, _given=given)

    def __post_init__(self) -> None:
        def bad(key, msg):
            raise ValueError(f"option {key}: {msg}")

        def check_int(key, val, hi=MAX_NUM_BATCHED_TOKENS, why=TOKENS_WHY, what=""):
            if not is_int(val):
                bad(key, f"{what}must be an integer, got {type(val).__name__} {val!r}")
            val = operator.index(val)
            if val < 1:
                bad(key, f"{what}must be an integer >= 1, got {val}")
            if val > hi:
                bad(key, f"{what}{val} is above the limit of {hi} ({why})")
            return val

        for key in ("cudagraph_decoder_replay", "decoder_replay", "trim_io_graphs", "direct_dispatch",
                    "metadata_in_place", "strict", "debug_check_addresses", "debug_check_ranks"):
            if not isinstance(getattr(self, key), bool):
                bad(key, f"must be true or false, got {getattr(self, key)!r}")
        if not isinstance(self.cudagraph_mode, str) or self.cudagraph_mode not in CUDAGRAPH_MODES:
            bad("cudagraph_mode", f"must be one of {CUDAGRAPH_MODES}, got {self.cudagraph_mode!r}")
        if not isinstance(self.compiler, str) or self.compiler not in COMPILERS:
            bad("compiler", f"must be one of {COMPILERS}, got {self.compiler!r}")
        # Limits: MAX_NUM_SEQS and MAX_NUM_BATCHED_TOKENS (their comments say why).
        limits = {"max_num_seqs": (MAX_NUM_SEQS, SEQS_WHY),
                  "max_num_batched_tokens": (MAX_NUM_BATCHED_TOKENS, TOKENS_WHY),
                  "decoder_replay_trim_threshold": (MAX_NUM_BATCHED_TOKENS, TOKENS_WHY),
                  "uniform_decode_query_len": (MAX_NUM_BATCHED_TOKENS, TOKENS_WHY)}
        for key, (hi, why) in limits.items():
            object.__setattr__(self, key, check_int(key, getattr(self, key), hi, why))
        if self.max_cudagraph_capture_size is not None:
            object.__setattr__(self, "max_cudagraph_capture_size",
                               check_int("max_cudagraph_capture_size", self.max_cudagraph_capture_size))
            if self.max_cudagraph_capture_size > self.max_num_batched_tokens:
                bad("max_cudagraph_capture_size", f"{self.max_cudagraph_capture_size} exceeds "
                    f"max_num_batched_tokens={self.max_num_batched_tokens}")
        for key in ("cudagraph_capture_sizes", "decoder_replay_cudagraph_capture_sizes"):
            sizes = getattr(self, key)
            if sizes is None:
                continue
            sizes = _as_list(key, sizes)
            if not sizes:
                bad(key, "must not be empty")
            sizes = [check_int(key, s, what="size ") for s in sizes]
            for s in sizes:
                if s > self.max_num_batched_tokens:
                    bad(key, f"size {s} exceeds max_num_batched_tokens={self.max_num_batched_tokens}")
            object.__setattr__(self, key, tuple(sorted(set(sizes))))
        if (self.cudagraph_capture_sizes and self.max_cudagraph_capture_size is not None
                and max(self.cudagraph_capture_sizes) > self.max_cudagraph_capture_size):
            bad("cudagraph_capture_sizes", f"size {max(self.cudagraph_capture_sizes)} exceeds "
                f"max_cudagraph_capture_size={self.max_cudagraph_capture_size}")
        largest = max(self.capture_sizes(), default=0)
        if self.cudagraph_mode == "full_decode_only" and largest < self.uniform_decode_query_len:
            bad("uniform_decode_query_len", f"{self.uniform_decode_query_len} tokens: under cudagraph_mode="
                f"'full_decode_only' a uniform decode of one request needs a capture size that holds it, and the "
                f"largest is {largest} (cudagraph_capture_sizes / max_cudagraph_capture_size)")
        if self.debug_dump_path is not None:
            path = self.debug_dump_path
            if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
                bad("debug_dump_path", f"must be a directory path, got {path!r}")
            object.__setattr__(self, "debug_dump_path", os.fspath(path))
        if self.splitting_ops is not None:
            ops = _as_list("splitting_ops", self.splitting_ops)
            if not ops or not all(isinstance(o, str) and "::" in o for o in ops):
                bad("splitting_ops", f"must be a non-empty list of 'namespace::op' names, got {self.splitting_ops!r}")
            object.__setattr__(self, "splitting_ops", ops)
        if self.inductor_mode not in (None, "max-autotune", "max-autotune-no-cudagraphs"):
            raise ValueError(f"inductor_mode={self.inductor_mode!r}: set it through mode=")
        if self._given is not None:
            object.__setattr__(self, "_given", frozenset(self._given))

    def given(self) -> frozenset[str]:
        """The options set by the caller: the keys passed to :meth:`from_options`, or,
        for a config built directly, the fields that differ from their defaults."""
        if self._given is not None:
            return self._given
        return frozenset(f.name for f in dataclasses.fields(self)
                         if f.init and f.name not in ("inductor_mode", "_given")
                         and getattr(self, f.name) != f.default)

    def notes(self) -> list[str]:
        """Options the caller set that a switch makes moot, one line each
        (config_notes.py; docs/configuration.md, Options a switch turns off)."""
        from .config_notes import notes

        return notes(self)

    # ---- derived --------------------------------------------------------------------
    @property
    def graphs_enabled(self) -> bool:
        return self.cudagraph_mode != "none"

    @property
    def piecewise_graphs(self) -> bool:
        """Main graphs in pieces, attention eager between them (and replay graphs)."""
        return self.cudagraph_mode in PIECEWISE_MODES

    @property
    def full_graphs(self) -> bool:
        """Whole steps in one graph each, attention included, where attention allows."""
        return self.cudagraph_mode in FULL_MODES

    def full_capture_sizes(self, trims: bool) -> list[int]:
        """The FULL graph sizes: the capture sizes whose steps never trim (below the trim
        threshold, where ``trims``: the model has a replay region that trims in graphs),
        and under full_decode_only only sizes a uniform decode batch of at most
        ``max_num_seqs`` requests pads to."""
        if not self.full_graphs:
            return []
        sizes = self.capture_sizes()
        if trims:
            sizes = [s for s in sizes if s < self.decoder_replay_trim_threshold]
        if self.cudagraph_mode == "full_decode_only":
            sizes = self.uniform_decode_sizes(sizes)
        return sizes

    def uniform_decode_sizes(self, sizes: list[int]) -> list[int]:
        """Of ``sizes``, those a uniform decode of at most ``max_num_seqs`` requests
        pads to: up to the first that holds ``max_num_seqs * uniform_decode_query_len``."""
        cap = padded_size(sizes, self.max_num_seqs * self.uniform_decode_query_len)
        return [s for s in sizes if cap is None or s <= cap]

    @property
    def max_capture_size(self) -> int:
        if self.max_cudagraph_capture_size is not None:
            return self.max_cudagraph_capture_size
        if self.cudagraph_capture_sizes:
            return max(self.cudagraph_capture_sizes)
        return min(1024, self.max_num_batched_tokens)

    def capture_sizes(self) -> list[int]:
        if not self.graphs_enabled:
            return []
        if self.cudagraph_capture_sizes:
            return list(self.cudagraph_capture_sizes)
        return default_capture_sizes(self.max_capture_size)

    def check_window(self, window: int) -> None:
        """Validation that needs the model's window (known once the graph is traced)."""
        window = check_size("the replay region's window (replay_begin's window=)", window)
        if self.decoder_replay_trim_threshold <= window:
            raise ValueError(
                f"option decoder_replay_trim_threshold: {self.decoder_replay_trim_threshold} must exceed "
                f"the sliding window W={window} (smaller graphs have nothing to trim)")

    def replay_capture_sizes(self, window: int) -> list[int]:
        if not (self.piecewise_graphs and self.cudagraph_decoder_replay and self.decoder_replay):
            return []
        if self.decoder_replay_cudagraph_capture_sizes:
            return list(self.decoder_replay_cudagraph_capture_sizes)
        return default_replay_capture_sizes(window, self.max_capture_size, self.max_num_seqs)

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("inductor_mode")
        d.pop("_given")
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()}
