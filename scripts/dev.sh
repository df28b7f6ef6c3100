#!/usr/bin/env bash
# One-step set-up and run: `bash scripts/dev.sh demo` or `bash scripts/dev.sh test`.
# Creates .venv (with system site packages, so a machine that already has
# torch >= 2.11 keeps it), installs torch 2.13 only when no suitable torch is there,
# installs this package in editable mode with its test extras, then runs the job.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${VENV:-.venv}"
[ -x "$venv/bin/python" ] || python3 -m venv --system-site-packages "$venv"
py="$venv/bin/python"
if ! "$py" - <<'PY' 2>/dev/null
import sys, torch
major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
sys.exit(0 if (major, minor) >= (2, 11) else 1)
PY
then
    "$py" -m pip install -q torch==2.13.0
fi
stamp="$venv/.dsv41-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    "$py" -m pip install -q -e ".[test]"
    # Triton (the GPU machine's version) where pip has a wheel for this machine: the CPU
    # tests run the row-moves and cache-write kernels under its interpreter (they skip without it).
    "$py" -m pip install -q triton==3.6.0 2>/dev/null \
        || echo "dev.sh: no Triton wheel here; the kernels' interpreter tests skip" >&2
    touch "$stamp"
fi
job="${1:-demo}"
shift || true
case "$job" in
    demo) exec "$venv/bin/replay-backend" demo "$@" ;;
    # One worker per core, at most four (each holds its own torch and models): the suite
    # is mostly single-threaded Python (tracing, Inductor's codegen), so the workers
    # overlap. `-n 0` runs it in this process.
    test) workers=$(nproc 2>/dev/null || echo 1)
          exec "$py" -m pytest -q -n "$(( workers < 4 ? workers : 4 ))" "$@" ;;
    *) echo "usage: bash scripts/dev.sh demo|test [args...]" >&2; exit 2 ;;
esac
