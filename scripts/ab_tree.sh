#!/usr/bin/env bash
# Commit REV's package as an importable source tree in DIR (DIR/replay_backend, with
# passes/ mapped into it as pyproject.toml maps it), for gpu_run.sh's bench@DIR step:
# two commits timed on one GPU machine, in turns (docs/benchmarks.md, Comparing two
# commits). DIR should be a folder git ignores, carried to the machine.
#
# usage: bash scripts/ab_tree.sh REV DIR
set -euo pipefail
rev="${1:?usage: ab_tree.sh REV DIR}"
dir="${2:?usage: ab_tree.sh REV DIR}"
cd "$(dirname "$0")/.."
git rev-parse --verify --quiet "$rev^{commit}" > /dev/null || { echo "ab_tree.sh: no commit '$rev'" >&2; exit 2; }
rm -rf "$dir"
mkdir -p "$dir"
git archive "$rev" replay_backend passes | tar -x -C "$dir"
mv "$dir/passes" "$dir/replay_backend/passes"
git rev-parse "$rev" > "$dir/COMMIT"
echo "$dir: $(cat "$dir/COMMIT")"
