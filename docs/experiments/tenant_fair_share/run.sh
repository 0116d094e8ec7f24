#!/usr/bin/env bash
# Tenants' fair share, three sides: "fifo" (commit c4a3f3c, fair_share_reserve 0: neither the reserve nor the
# workers' fair queue), "reserve" (c4a3f3c, fair_share_reserve 0.05: the reserve alone) and "both" (this
# checkout, 0.05: the reserve and the workers' fair queue), alternately, three rounds. Each: a 1P:1D tiny-random
# cluster with API keys of two tenants and two loadgen runs at once, "flood" at 60 req/s (about three times what
# the cluster serves on two cores) and "quiet" at 2 req/s, 512 prompt tokens and 64 output tokens each, Poisson
# arrivals, 30 s. report.py keeps each result's figures in rows.json and prints the medians. From the repository
# root, its venv active; about 8 minutes; needs a quiet machine.
set -euo pipefail
here=$PWD
out=$here/docs/experiments/tenant_fair_share
before=/tmp/pdserve-fair-share-before
[ -d "$before" ] || git worktree add --detach "$before" c4a3f3c
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python - "$work/keys.toml" <<'PY'
import sys
from pdserve.security.api_keys import digest
with open(sys.argv[1], "w") as f:
    for name in ("flood", "quiet"):
        f.write(f'[[keys]]\nname = "{name}"\nsha256 = "{digest(name + "-secret")}"\ntenant = "{name}"\n')
PY
mkdir "$work/runs"
for round in 1 2 3; do
  for side in fifo:$before:0 reserve:$before:0.05 both:$here:0.05; do
    IFS=: read -r label code reserve <<< "$side"
    printf '[router]\nfair_share_reserve = %s\n' "$reserve" > "$work/router.toml"
    (cd "$code" && PYTHONPATH=$code/src:$code exec python -m services.main up --model tiny-random \
      --mode disaggregated --prefill 1 --decode 1 --port 50751 --api-keys "$work/keys.toml" \
      --router-config "$work/router.toml") > "$work/up.log" 2>&1 &
    up=$!
    until grep -q '^ready' "$work/up.log"; do kill -0 $up; sleep 1; done
    common=(--addr 127.0.0.1:50751 --model tiny-random --random-input-len 512 --random-output-len 64
            --warmup-requests 0)
    python -m loadgen "${common[@]}" --api-key flood-secret --request-rate 60 --num-prompts 1800 --seed 1 \
      --result-json "$work/runs/flood-$label-$round.json" > "$work/flood.log" 2>&1 &
    flood=$!
    python -m loadgen "${common[@]}" --api-key quiet-secret --request-rate 2 --num-prompts 60 --seed 2 \
      --result-json "$work/runs/quiet-$label-$round.json" > "$work/quiet.log" 2>&1 || true
    wait $flood || true
    kill -INT $up; wait $up || true
  done
done
python "$out/report.py" "$work/runs" --json "$out/rows.json"
