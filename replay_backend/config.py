"""Backend options (SPEC §5, §6, §8): parsing, validation and capture-size schedules."""
from __future__ import annotations

import bisect
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

CUDAGRAPH_MODES = ("piecewise", "none")
COMPILERS = ("inductor", "eager")
MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# Dump directory when the option is not given: turns dumps on without touching code.
DUMP_ENV_VAR = "DSV41_REPLAY_DUMP"


def default_capture_sizes(max_size: int) -> list[int]:
    """The published PIECEWISE schedule: 1, 2, 4, then multiples of 8 up to 256, then of
    16, up to ``max_size`` (which is always included)."""
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, max_size + 1, 16)]
    return sorted({s for s in sizes if s <= max_size} | {max_size})


def default_replay_capture_sizes(window: int, max_cudagraph_capture_size: int,
                                 max_num_seqs: int) -> list[int]:
    """SPEC §6: step W up to 16*W, then 1/8 of each power-of-two interval, up to the bound."""
    bound = min(max_cudagraph_capture_size, max_num_seqs * window)
    sizes, s = [], window
    while s < bound:
        sizes.append(s)
        s += max(window, 2 ** (s.bit_length() - 4))
    sizes.append(bound)
    return sorted(set(sizes))


def padded_size(sizes: list[int] | tuple[int, ...], n: int) -> int | None:
    """Smallest size >= n, or None when n is above the largest. ``sizes`` ascending: the
    step path keeps its lists sorted, since sorting 80 sizes per step is host time."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


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
    strict: bool = False  # fallbacks raise instead of being logged and counted
    debug_check_addresses: bool = False  # check input addresses on every replay, not only the first
    debug_dump_path: str | None = None
    inductor_mode: str | None = field(default=None, repr=False)

    # ---- construction ---------------------------------------------------------------
    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None = None, mode: str | None = None) -> "ReplayConfig":
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is not supported; choose one of {[m for m in MODES if m]}")
        options = dict(options or {})
        names = {f.name for f in dataclasses.fields(cls) if f.name != "inductor_mode"}
        unknown = sorted(set(options) - names)
        if unknown:
            raise ValueError(f"unknown dsv41_replay option(s) {unknown}; known options: {sorted(names)}")
        for key in ("cudagraph_capture_sizes", "decoder_replay_cudagraph_capture_sizes", "splitting_ops"):
            if options.get(key) is not None:
                val = options[key]
                if isinstance(val, (str, bytes)) or not hasattr(val, "__iter__"):
                    if key == "splitting_ops" and isinstance(val, str):
                        val = [v for v in val.split(",") if v]
                    else:
                        raise ValueError(f"option {key} must be a list, got {val!r}")
                options[key] = tuple(val)
        if options.get("debug_dump_path") is None and os.environ.get(DUMP_ENV_VAR):
            options["debug_dump_path"] = os.environ[DUMP_ENV_VAR]
        inductor_mode = mode if mode in ("max-autotune", "max-autotune-no-cudagraphs") else None
        return cls(**options, inductor_mode=inductor_mode)

    def __post_init__(self) -> None:
        def bad(key, msg):
            raise ValueError(f"option {key}: {msg}")

        def check_int(key, val, lo=1):
            if isinstance(val, bool) or not isinstance(val, int) or val < lo:
                bad(key, f"must be an integer >= {lo}, got {val!r}")

        for key in ("cudagraph_decoder_replay", "decoder_replay", "trim_io_graphs", "direct_dispatch",
                    "metadata_in_place", "strict", "debug_check_addresses"):
            if not isinstance(getattr(self, key), bool):
                bad(key, f"must be true or false, got {getattr(self, key)!r}")
        if self.cudagraph_mode not in CUDAGRAPH_MODES:
            bad("cudagraph_mode", f"must be one of {CUDAGRAPH_MODES}, got {self.cudagraph_mode!r}")
        if self.compiler not in COMPILERS:
            bad("compiler", f"must be one of {COMPILERS}, got {self.compiler!r}")
        for key in ("max_num_seqs", "max_num_batched_tokens", "decoder_replay_trim_threshold"):
            check_int(key, getattr(self, key))
        if self.max_cudagraph_capture_size is not None:
            check_int("max_cudagraph_capture_size", self.max_cudagraph_capture_size)
            if self.max_cudagraph_capture_size > self.max_num_batched_tokens:
                bad("max_cudagraph_capture_size", f"{self.max_cudagraph_capture_size} exceeds "
                    f"max_num_batched_tokens={self.max_num_batched_tokens}")
        for key in ("cudagraph_capture_sizes", "decoder_replay_cudagraph_capture_sizes"):
            sizes = getattr(self, key)
            if sizes is None:
                continue
            if not sizes:
                bad(key, "must not be empty")
            for s in sizes:
                check_int(key, s)
                if s > self.max_num_batched_tokens:
                    bad(key, f"size {s} exceeds max_num_batched_tokens={self.max_num_batched_tokens}")
            object.__setattr__(self, key, tuple(sorted(set(sizes))))
        if (self.cudagraph_capture_sizes and self.max_cudagraph_capture_size is not None
                and max(self.cudagraph_capture_sizes) > self.max_cudagraph_capture_size):
            bad("cudagraph_capture_sizes", f"size {max(self.cudagraph_capture_sizes)} exceeds "
                f"max_cudagraph_capture_size={self.max_cudagraph_capture_size}")
        if self.debug_dump_path is not None:
            path = self.debug_dump_path
            if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
                bad("debug_dump_path", f"must be a directory path, got {path!r}")
            object.__setattr__(self, "debug_dump_path", os.fspath(path))
        if self.splitting_ops is not None and (
                not self.splitting_ops or not all(isinstance(o, str) and "::" in o for o in self.splitting_ops)):
            bad("splitting_ops", f"must be a non-empty list of 'namespace::op' names, got {self.splitting_ops!r}")

    # ---- derived --------------------------------------------------------------------
    @property
    def graphs_enabled(self) -> bool:
        return self.cudagraph_mode == "piecewise"

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
        if self.decoder_replay_trim_threshold <= window:
            raise ValueError(
                f"option decoder_replay_trim_threshold: {self.decoder_replay_trim_threshold} must exceed "
                f"the sliding window W={window} (smaller graphs have nothing to trim)")

    def replay_capture_sizes(self, window: int) -> list[int]:
        if not (self.graphs_enabled and self.cudagraph_decoder_replay and self.decoder_replay):
            return []
        if self.decoder_replay_cudagraph_capture_sizes:
            return list(self.decoder_replay_cudagraph_capture_sizes)
        return default_replay_capture_sizes(window, self.max_capture_size, self.max_num_seqs)

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("inductor_mode")
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()}
