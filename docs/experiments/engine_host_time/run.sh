#!/bin/bash
# A/B of the engine's host time per sequence per decode step: the code at BEFORE (a commit) against this
# checkout, alternately, ROUNDS rounds per shape; one JSON line per run in rows.jsonl.
set -eu -o pipefail
cd "$(dirname "$0")/../../.."
BEFORE=${1:?usage: run.sh BEFORE_COMMIT [ROUNDS]}
ROUNDS=${2:-3}
PY=$PWD/.venv/bin/python
OUT=docs/experiments/engine_host_time/rows.jsonl
tree=$(mktemp -d)
git worktree add -q "$tree" "$BEFORE"
trap 'git worktree remove --force "$tree"' EXIT
: > "$OUT"
for shape in "32 512" "64 1024"; do
  set -- $shape
  for round in $(seq "$ROUNDS"); do
    for side in before after; do
      src=$([ $side = before ] && echo "$tree/src" || echo "$PWD/src")
      row=$(PYTHONPATH=$src "$PY" docs/experiments/engine_host_time/host_time.py --batch "$1" --context "$2")
      echo "{\"side\": \"$side\", \"round\": $round, ${row#\{}" | tee -a "$OUT"
    done
  done
done
