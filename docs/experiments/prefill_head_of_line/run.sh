#!/usr/bin/env bash
# Short chat prompts behind long RAG prompts on one prefill worker, before (BEFORE: a worktree of 575d263, first come,
# first served) and after (this checkout: short prompts first, engine/short_first.py), alternately: each round a
# fresh 1P:1D smollm2-135m cluster, 3 requests of each class alone, then 180 s of Poisson arrivals at 0.5x and 1.0x of
# 0.333 req/s (one over the mix's mean TTFT alone, measured in the first round before), 80% short (64-200 tokens,
# TTFT SLO 3 s), 20% long (2048-4096 tokens, 40 s); 16 output tokens. report.py prints the table.
# From the repository root, its venv active; about 9 minutes a side and round. BEFORE_REV, SIDES (the first runs the
# BEFORE_REV worktree's code, the second this checkout's) and LOADS pick another comparison: the stretch's was
# BEFORE_REV=fcfbd1f BEFORE=/tmp/pdserve-hol-base SIDES="base stretch" LOADS=1 ROUNDS="1 2 3".
set -euo pipefail
out=$PWD/docs/experiments/prefill_head_of_line
before=${BEFORE:-/tmp/pdserve-hol-before}
read -r -a sides <<< "${SIDES:-fcfs final}"
[ -d "$before" ] || git worktree add --detach "$before" "${BEFORE_REV:-575d263}"
for round in ${ROUNDS:-1 2 3}; do
  for side in "${sides[@]}"; do
    code=$PWD; [ "$side" = "${sides[0]}" ] && code=$before
    echo "$side, round $round:"
    # From its own tree: `pdserve up` runs `python -m`, which imports the working directory's services/ first.
    # shellcheck disable=SC2086  # LOADS: one or more numbers
    (cd "$code" && PYTHONPATH=$code/src:$code python "$out/hol.py" --capacity 0.333 --loads ${LOADS:-0.5 1} \
      --rows "$out/rows-$side-$round.json")
  done
done
python "$out/report.py" "$out"
