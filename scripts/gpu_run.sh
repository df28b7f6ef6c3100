#!/usr/bin/env bash
# Runs on the GPU machine: install without network, GPU tests, then the benchmark.
# usage: bash scripts/gpu_run.sh OUTDIR [bench args...]
# env: SKIP_TESTS=1, TEST_TIMEOUT=s, SOAK="soak.py args", SOAK_TIMEOUT=s,
#      ACCURACY_PROBE="accuracy_probe.py args", PROBE_TIMEOUT=s,
#      TRIM_PROBES=1 (row_moves_probe.py, graph_launch_probe.py, trim_probe.py on both trim paths and
#      at 4K, trim_op_python.py),
#      FIRST_STEPS="first_steps_probe.py args" (Triton builds inside the first served steps),
#      BENCH_TIMEOUT=s, WARM_COMPILE=1 (a second, warm compile-only run)
set -uo pipefail
out="${1:?outdir}"; shift
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
    timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -rA -p no:warnings tests/test_gpu.py 2>&1 | tee "$out/gpu_tests.log" | tail -25
fi
if [ -n "${SOAK:-}" ]; then  # e.g. SOAK="--preset mini-1k --dtype float32 --steps 500 --max-seconds 300"
    # shellcheck disable=SC2086  # the variable holds several arguments
    timeout "${SOAK_TIMEOUT:-540}" python3 scripts/soak.py $SOAK --json "$out/soak.json" 2>&1 | tr '\r' '\n' \
        | grep -v -e "graphs: " -e '^ *$' -e 'warn' | tee "$out/soak.log" | tail -30
fi
if [ -n "${ACCURACY_PROBE:-}" ]; then  # e.g. ACCURACY_PROBE="--layers 4,21,40 --isl 1024,4096"
    # shellcheck disable=SC2086  # the variable holds several arguments
    timeout "${PROBE_TIMEOUT:-300}" python3 scripts/accuracy_probe.py $ACCURACY_PROBE 2>&1 \
        | tee "$out/accuracy_probe.log" | grep -v '^ *$' | tail -12
fi
if [ -n "${FIRST_STEPS:-}" ]; then  # e.g. FIRST_STEPS="--shapes 1024/1,4096/1,8192/1"
    # shellcheck disable=SC2086  # the variable holds several arguments
    timeout "${PROBE_TIMEOUT:-300}" python3 scripts/first_steps_probe.py $FIRST_STEPS 2>&1 \
        | tr '\r' '\n' | grep -v -e "graphs: " -e '^ *$' | tee "$out/first_steps.log" | tail -20
fi
if [ "${TRIM_PROBES:-0}" = 1 ]; then
    timeout 120 python3 scripts/row_moves_probe.py 2>&1 | tee "$out/row_moves_probe.log" | tail -4
    timeout 120 python3 scripts/graph_launch_probe.py 2>&1 | tee "$out/graph_launch_probe.log"
    # graphed at 1K, main layers without graphs at 2K, graphed at 4K
    for probe in "1024 512,1024" "2048 512,1024" "4096 512,1024,4096"; do
        read -r isl sizes <<< "$probe"  # not `set --`: the bench's arguments are "$@"
        timeout 150 python3 scripts/trim_probe.py --preset mini-2k --layers 8 --isl "$isl" --sizes "$sizes" \
            --steps 50 > "$out/trim_probe_$isl.log" 2>&1
        grep -E "^(step|trim op|  )" "$out/trim_probe_$isl.log" | head -24
    done
    timeout 120 python3 scripts/trim_op_python.py 2>&1 | tee "$out/trim_op_python.log" | tail -5
fi
if [ "$#" -gt 0 ]; then
    timeout "${BENCH_TIMEOUT:-400}" replay-backend bench --json "$out/bench.json" --out "$out/bench.md" "$@" 2>&1 \
        | tee "$out/bench.log" | grep -v '^{' | tail -40
    if [ "${WARM_COMPILE:-0}" = 1 ]; then  # again in a fresh process: Inductor's disk caches are warm
        timeout 200 replay-backend bench --compile-only 2>&1 | tee "$out/compile_warm.log" | tail -2
    fi
fi
