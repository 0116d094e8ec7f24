#!/usr/bin/env bash
# Tenants' fair share on and off: a 1P:1D tiny-random cluster with API keys of two tenants, started with
# fair_share_reserve 0 (off) and 0.05 (the default) alternately, three rounds. In each, two loadgen runs at once:
# "flood" at 60 req/s (about three times what the cluster serves on two cores) and "quiet" at 2 req/s, 512
# prompt tokens and 64 output tokens each, Poisson arrivals, 30 s. report.py keeps each result's figures in
# rows.json and prints the medians. From the repository root; about 5 minutes; needs a quiet machine.
set -euo pipefail
out=$PWD/docs/experiments/tenant_fair_share
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
  for reserve in 0 0.05; do
    printf '[router]\nfair_share_reserve = %s\n' "$reserve" > "$work/router.toml"
    pdserve up --model tiny-random --mode disaggregated --prefill 1 --decode 1 --port 50751 \
      --api-keys "$work/keys.toml" --router-config "$work/router.toml" > "$work/up.log" 2>&1 &
    up=$!
    until grep -q '^ready' "$work/up.log"; do kill -0 $up; sleep 1; done
    common=(--addr 127.0.0.1:50751 --model tiny-random --random-input-len 512 --random-output-len 64
            --warmup-requests 0)
    python -m loadgen "${common[@]}" --api-key flood-secret --request-rate 60 --num-prompts 1800 --seed 1 \
      --result-json "$work/runs/flood-$reserve-$round.json" > "$work/flood.log" 2>&1 &
    flood=$!
    python -m loadgen "${common[@]}" --api-key quiet-secret --request-rate 2 --num-prompts 60 --seed 2 \
      --result-json "$work/runs/quiet-$reserve-$round.json" > "$work/quiet.log" 2>&1 || true
    wait $flood || true
    kill -INT $up; wait $up || true
  done
done
python "$out/report.py" "$work/runs" --json "$out/rows.json"
