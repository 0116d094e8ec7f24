#!/usr/bin/env bash
# The hand-off before and after b500bad (the prefill side no longer waits for its engine's next step before the
# first token): the same traces replayed on clusters of each, alternately, by scripts/validate_planner.py (each
# side with its own simulator's prediction beside it). From the repository root at b500bad or later; about 20
# minutes on two cores; needs a quiet machine.
set -euo pipefail
out=docs/experiments/handoff_wait
profile=$PWD/docs/experiments/planner_validation/profile-run3.json
before=/tmp/pdserve-handoff-before
[ -d "$before" ] || git worktree add --detach "$before" b500bad~1
for round in 1 2; do
  for side in before after; do
    dir=$PWD; [ "$side" = before ] && dir=$before
    (cd "$dir" && PYTHONPATH=src:. python scripts/validate_planner.py --model tiny-random --profile "$profile" \
      --configs 1:1,2:1 --rates 10,16 --repeat 3 --num-requests 150 --input-len 1024 --output-len 32 \
      --slo-ttft-ms 500 --slo-tpot-ms 50 --json "$OLDPWD/$out/rows-$side-$round.json") \
      | tee "$out/results-$side-$round.txt"
  done
done
