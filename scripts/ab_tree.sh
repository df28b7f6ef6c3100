#!/usr/bin/env bash
# Commit REV's package as an importable source tree in DIR (DIR/replay_backend, with
# passes/ mapped into it as pyproject.toml maps it), for gpu_run.sh's bench@DIR and
# decode@DIR steps: two commits timed on one GPU machine, in turns (docs/benchmarks.md,
# Comparing two commits). DIR is relative to the repository root, under out/ (which git
# ignores) or another ignored folder, and is carried to the machine. A DIR this script
# made before is replaced.
#
# usage: bash scripts/ab_tree.sh REV DIR
set -euo pipefail
rev="${1:?usage: ab_tree.sh REV DIR}"
dir="${2:?usage: ab_tree.sh REV DIR}"
cd "$(dirname "$0")/.."
fail() { echo "ab_tree.sh: $*" >&2; exit 2; }
git rev-parse --verify --quiet "$rev^{commit}" > /dev/null || fail "no commit '$rev'"
git show "$rev:pyproject.toml" | grep -q '^"replay_backend.passes" = "passes"$' \
    || fail "$rev's pyproject.toml does not map replay_backend.passes to passes/ as this script does"
if [ -e "$dir" ]; then
    [ -f "$dir/COMMIT" ] || fail "$dir exists and is not a tree this script made: not replacing it"
    [ -z "$(git ls-files -- "$dir")" ] || fail "$dir holds tracked files: not replacing it"
    rm -rf "$dir"
fi
mkdir -p "$dir"
git archive "$rev" replay_backend passes | tar -x -C "$dir"
mv "$dir/passes" "$dir/replay_backend/passes"
git rev-parse "$rev^{commit}" > "$dir/COMMIT"
echo "$dir: $(cat "$dir/COMMIT")"
