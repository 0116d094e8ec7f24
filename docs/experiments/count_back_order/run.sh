#!/usr/bin/env bash
# The placement's cost before and after the freed-sequences count, alternated, in one run: BEFORE is a checkout of
# the commit before it (git worktree add /tmp/before <commit>), this tree the after.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
tree=$(cd "$here/../../.." && pwd)
before=${BEFORE:?a checkout of the commit before the freed-sequences count}
for round in 1 2 3; do
  PYTHONPATH="$before/src:$before" "$tree/.venv/bin/python" "$here/placement_cost.py" "before-$round"
  PYTHONPATH="$tree/src:$tree" "$tree/.venv/bin/python" "$here/placement_cost.py" "after-$round"
done
