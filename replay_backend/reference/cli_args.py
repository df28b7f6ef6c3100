"""The ``replay-backend`` command line's argument types: each checks its value where it is
parsed, so a bad number, device or path is one ``replay-backend: error: ...`` line and
exit status 2, before any model is built."""
from __future__ import annotations

import argparse
import math
import os
import tempfile

import torch


def check_dir(path: str, flag: str) -> None:
    """``path`` is (made) a directory this process can write a file in."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot write there ({e.strerror or e})") from None


def check_file(path: str, flag: str) -> None:
    """A file can be written at ``path`` (its directory exists and takes files)."""
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path}: is a directory, not a file")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ValueError(f"{flag} {path}: cannot write there (permission denied)")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"{flag} {path}: its directory {folder} does not exist")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot write there ({e.strerror or e})") from None


class Parser(argparse.ArgumentParser):
    """Every usage error as one line on stderr, exit status 2: the same form as the
    errors ``main`` reports from its own checks."""

    def error(self, message: str):
        self.exit(2, f"replay-backend: error: {message} (see '{self.prog} --help')\n")


def int_arg(lo: int, hi: int | None = None, even: bool = False, why: str = ""):
    """An argparse type: an integer in ``[lo, hi]`` (even, if asked)."""
    def integer(text: str) -> int:
        try:
            val = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if val < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {val}")
        if hi is not None and val > hi:
            raise argparse.ArgumentTypeError(f"{val} is above the limit of {hi}" + (f" ({why})" if why else ""))
        if even and val % 2:
            raise argparse.ArgumentTypeError(f"must be even (a cache block holds pairs of positions), got {val}")
        return val
    return integer


def number(lo: float = 0.0, above: bool = False):
    """An argparse type: a finite number >= ``lo`` (> ``lo`` when ``above``)."""
    def number(text: str) -> float:
        try:
            val = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(val) or val < lo or (above and val == lo):
            raise argparse.ArgumentTypeError(f"must be a finite number {'>' if above else '>='} {lo:g}, got {text!r}")
        return val
    return number


def int_list(lo: int = 1, hi: int | None = None, why: str = ""):
    """An argparse type: comma-separated integers, each in ``[lo, hi]``."""
    one = int_arg(lo, hi, why=why)

    def integers(text: str) -> list[int]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
        return [one(t) for t in items]
    return integers


def names(choices=None):
    """An argparse type: comma-separated names, each one of ``choices`` when given."""
    def names(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected comma-separated names, got {text!r}")
        bad = [t for t in items if choices is not None and t not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(bad)}; choose from {', '.join(choices)}")
        return items
    return names


def profile_points(text: str) -> list[str]:
    """An argparse type: comma-separated ``ISL/CONC`` points."""
    points = [t.strip() for t in text.split(",") if t.strip()]
    for p in points:
        isl, _, conc = p.partition("/")
        if not (isl.isdigit() and conc.isdigit() and int(isl) >= 1 and int(conc) >= 1):
            raise argparse.ArgumentTypeError(f"{p!r}: expected ISL/CONC, e.g. 1024/1")
    if not points:
        raise argparse.ArgumentTypeError(f"expected comma-separated ISL/CONC points, got {text!r}")
    return [f"{int(p.split('/')[0])}/{int(p.split('/')[1])}" for p in points]


def device(text: str) -> str:
    """An argparse type: cpu, or a CUDA device this machine has."""
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device; use cpu, cuda or cuda:N") from None
    if dev.type == "cpu":
        return "cpu"
    if dev.type != "cuda":
        raise argparse.ArgumentTypeError(f"{text!r}: the reference model runs on cpu or cuda")
    if not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: CUDA is not available here (torch {torch.__version__}); "
                                         "use --device cpu")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text!r}: this machine has {torch.cuda.device_count()} CUDA "
                                         f"device(s), cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return str(dev)


LEN_WHY = "MAX_MODEL_LEN: positions must stay exact as float32"


def check_layout(max_model_len: int, num_seqs: int, what: str) -> None:
    """The cache a command will allocate, refused before any model is built."""
    from ..kv_cache import CacheLayout

    try:
        CacheLayout(max_model_len, num_seqs)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None
