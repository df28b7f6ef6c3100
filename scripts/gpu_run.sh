#!/usr/bin/env bash
# On a GPU machine without network: install this checkout in place, then run the steps
# named, each with its own time limit, its log under OUTDIR (line by line, so a step cut
# short by its limit still leaves what it printed).
#
# usage: bash scripts/gpu_run.sh OUTDIR STEP...
#   wheels                      install .whl/*.whl (carried wheels, e.g. flashinfer-python and
#                               apache-tvm-ffi) into /tmp/site, on PYTHONPATH for the later steps
#   tests:SECONDS               python3 -m pytest tests/test_gpu.py
#   pytest:SECONDS:ARGS         python3 -m pytest ARGS (other test files, e.g. tests/test_gpu_full.py)
#   decode:SECONDS:ARGS         replay-backend decode-bench ARGS
#   soak:SECONDS:ARGS           python3 scripts/soak.py ARGS (give it --max-seconds below SECONDS)
#   bench:SECONDS:ARGS          replay-backend bench ARGS (give it --max-seconds below SECONDS)
#   bench@DIR:SECONDS:ARGS      the same bench of the package tree in DIR (relative to the
#                               repository root, no ':' in it; scripts/ab_tree.sh makes one of a
#                               commit) instead of this checkout: an A/B on one machine
#   decode@DIR:SECONDS:ARGS     the same for decode-bench
#   check:SECONDS:ARGS          python3 scripts/flashinfer_check.py ARGS (after wheels)
#   probe:SECONDS:ARGS          python3 scripts/graph_launch_probe.py ARGS (a CUDA graph's launch
#                               against its kernels' time, by kernel count and graphs per step)
# ARGS split into words as a shell splits them (quotes group words); e.g.
#   bash scripts/gpu_run.sh $OUT tests:300 \
#       "soak:560:--preset mini-2k --dtype bfloat16 --steps 500 --seed 2 --max-seconds 420"
set -uo pipefail
out="${1:?usage: gpu_run.sh OUTDIR STEP...}"; shift
mkdir -p "$out" && out="$(cd "$out" && pwd)" || { echo "gpu_run.sh: cannot use OUTDIR '$out'" >&2; exit 2; }
repo="$PWD"
split_args() {  # ARGS as a shell would split them, NUL-separated, without expanding anything
    python3 -c 'import shlex, sys; sys.stdout.write("\0".join(shlex.split(sys.argv[1])))' "$1"
}
for step in "$@"; do  # a bad step stops the run before any step, not half-way
    IFS=: read -r kind limit args <<< "$step"
    split_args "$args" > /dev/null 2>&1 || { echo "gpu_run.sh: cannot split the arguments of step '$step'" >&2; exit 2; }
    case "$kind" in
        bench@*|decode@*)
            [ -d "$repo/${kind#*@}/replay_backend" ] \
                || { echo "gpu_run.sh: no package tree in ${kind#*@} (scripts/ab_tree.sh makes one)" >&2; exit 2; } ;;
        wheels|tests|pytest|soak|bench|check|probe|decode) ;;
        *) echo "gpu_run.sh: unknown step '$kind' (wheels, tests, pytest, soak, bench, bench@DIR, check, probe," \
                "decode, decode@DIR)" >&2
           exit 2 ;;
    esac
done
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
status=0
n=0
for step in "$@"; do
    n=$((n + 1))
    IFS=: read -r kind limit args <<< "$step"
    tree=
    case "$kind" in bench@*|decode@*) tree="${kind#*@}"; kind="${kind%%@*}" ;; esac
    mapfile -d '' -t argv < <(split_args "$args")  # -k "a and not b": two words
    if [ "$kind" = wheels ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl > "$out/wheels.log" 2>&1 || { cat "$out/wheels.log"; exit 1; }
        export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
        echo "== wheels: $(cd .whl && echo *.whl)"
        continue
    fi
    case "$kind" in
        tests) cmd=(python3 -m pytest -v -rA -p no:warnings -p no:cacheprovider tests/test_gpu.py "${argv[@]}") ;;
        soak) cmd=(python3 scripts/soak.py --json "$out/soak$n.json" "${argv[@]}") ;;
        bench) cmd=(replay-backend bench --json "$out/bench$n.json" --out "$out/bench$n.md" "${argv[@]}") ;;
        check) cmd=(python3 scripts/flashinfer_check.py "${argv[@]}") ;;
        probe) cmd=(python3 scripts/graph_launch_probe.py --json "$out/probe$n.json" "${argv[@]}") ;;
        pytest) cmd=(python3 -m pytest -v -rA -p no:warnings -p no:cacheprovider "${argv[@]}") ;;
        decode) cmd=(replay-backend decode-bench --out "$out/decode$n.json" "${argv[@]}") ;;
    esac
    if [ -n "$tree" ]; then
        # The entry point does not put the working folder on sys.path, and PYTHONPATH
        # comes before the editable install of this checkout.
        cmd=(env PYTHONPATH="$repo/$tree${PYTHONPATH:+:$PYTHONPATH}" "${cmd[@]}")
        echo "== package of $tree ($(cat "$repo/$tree/COMMIT" 2>/dev/null)): $(cd / && \
            PYTHONPATH="$repo/$tree${PYTHONPATH:+:$PYTHONPATH}" python3 -c \
            'import replay_backend; print(replay_backend.__file__)')"
    fi
    log="$out/$kind$n.log"
    echo "== $kind${tree:+ of $tree} (limit ${limit}s): ${cmd[*]}"
    timeout "$limit" "${cmd[@]}" 2>&1 | tr '\r' '\n' | grep --line-buffered -v -e 'graphs: ' -e '^ *$' > "$log"
    rc=${PIPESTATUS[0]}
    tail -25 "$log"
    echo "== $kind exit $rc"
    [ "$rc" = 0 ] || status=1
done
exit "$status"
