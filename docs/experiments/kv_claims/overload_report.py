"""The report of an overload_soak.py run: statuses, refusals and their hints, TTFT of large and small requests,
the shared claims hash over time, the routers' memory, threads and descriptors, log errors, and how often a large
request was overtaken by a later one.

    PYTHONPATH=src:. python docs/experiments/kv_claims/overload_report.py RUN_DIR
"""

from __future__ import annotations

import collections
import json
import re
import sys
from pathlib import Path

d = Path(sys.argv[1])


def jl(name):
    p = d / name
    return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


def pct(xs, q):
    xs = sorted(xs)
    if not xs:
        return None
    k = min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))
    return xs[k]


events = jl("events.jsonl")
ev = {e["event"]: e["t"] for e in events}
print("events:", {k: v for k, v in ev.items() if k not in ("cluster process tree",)})
reqs = jl("requests.jsonl")
print(f"requests: {len(reqs)}")
st = collections.Counter(r["status"] for r in reqs)
print("final status:", dict(st))
print("by size/final:", dict(collections.Counter((("L" if r["large"] else "S"), r["status"]) for r in reqs)))
print("by router/final:", dict(collections.Counter((r["router"], r["status"]) for r in reqs)))
print("refusals total:", sum(r["refusals"] for r in reqs), "refusals without hint:", sum(r["no_hint"] for r in reqs))
msgs = collections.Counter()
for r in reqs:
    for k, v in r["refusal_msgs"].items():
        msgs[k] += v
print("refusal messages:")
for k, v in msgs.most_common():
    print(f"  {v:6d}  {k}")
errs = [(r["id"], r["router"], e) for r in reqs for e in r["errors"]]
print(f"non-OK non-RE attempt errors: {len(errs)} over {len({i for i, _, _ in errs})} requests")
ec = collections.Counter((rt, e["code"], re.sub(r"\d+", "N", e["msg"])[:160]) for _, rt, e in errs)
for k, v in ec.most_common():
    print(f"  {v:5d} router{k[0] + 1} {k[1]}: {k[2]}")
if errs:
    ts = [e["t"] for _, _, e in errs]
    print(f"  error times: {min(ts):.1f} .. {max(ts):.1f}")
    buckets = collections.Counter(int(t) // 5 * 5 for t in ts)
    print("  per 5 s:", dict(sorted(buckets.items())))
    print("  with tokens already streamed:", sum(1 for _, _, e in errs if e["tokens"]))
failed_final = [r for r in reqs if r["status"] not in ("OK", "RESOURCE_EXHAUSTED")]
print(
    "requests whose final status is an error:", len(failed_final), [(r["id"], r["status"]) for r in failed_final][:10]
)
for name, large in (("large", True), ("small", False)):
    served = [r["ttft"] for r in reqs if r["large"] == large and r["ttft"] is not None]
    refs = [r["refusals"] for r in reqs if r["large"] == large]
    unserved = [r for r in reqs if r["large"] == large and r["ttft"] is None]
    print(
        f"{name}: n={len(refs)} served={len(served)} ttft p50={pct(served, 0.5)} p90={pct(served, 0.9)} "
        f"p99={pct(served, 0.99)} max={max(served) if served else None}; refusals p50={pct(refs, 0.5)} "
        f"p90={pct(refs, 0.9)} max={max(refs) if refs else None}"
    )
    if unserved:
        waits = [round(r["end"] - r["start"], 1) for r in unserved]
        print(f"   never got a token (load stopped / error): {len(unserved)}, waited {sorted(waits)}")
    # TTFT in phases
    for lo, hi, label in (
        (0, ev.get("redis stop", 0), "before redis restart"),
        (ev.get("redis stop", 0), ev.get("redis stop", 0) + 30, "redis restart +30s"),
        (ev.get("router2 SIGKILL", 0) - 0.01, ev.get("router2 SIGKILL", 0) + 30, "router kill +30s"),
    ):
        xs = [r["ttft"] for r in reqs if r["large"] == large and r["ttft"] is not None and lo <= r["start"] < hi]
        if xs:
            print(f"   started {label}: n={len(xs)} p50={pct(xs, 0.5)} p90={pct(xs, 0.9)} max={max(xs)}")
    by_router = collections.defaultdict(list)
    for r in reqs:
        if r["large"] == large and r["ttft"] is not None:
            by_router[r["router"]].append(r["ttft"])
    print("   by router:", {k + 1: (len(v), pct(v, 0.5), pct(v, 0.9), max(v)) for k, v in sorted(by_router.items())})
ok = [r for r in reqs if r["status"] == "OK"]
dur = (ev.get("load stopped", 0) - ev.get("load started", 0)) or 1
print(f"OK/s: {len(ok) / dur:.2f}; tokens/s: {sum(r['tokens'] for r in ok) / dur:.0f}")

claims = jl("claims.jsonl")
errs_c = [c for c in claims if "err" in c]
ok_c = [c for c in claims if "claims" in c]
sizes = collections.Counter(len(c["claims"]) for c in ok_c)
print(f"claims samples: {len(claims)} ok, {len(errs_c)} failed reads (t {[c['t'] for c in errs_c][:5]}...)")
print("  entries per sample:", dict(sorted(sizes.items())))
fields = collections.Counter(k for c in ok_c for k in c["claims"])
print("  fields seen:", dict(fields))
nonempty = [c for c in ok_c if c["claims"]]
if nonempty:
    print(f"  nonempty samples: first t={nonempty[0]['t']} last t={nonempty[-1]['t']}")
    # expiry: entries whose until (Unix ms) is in the past at sample time
    stale = []
    rem = []
    blocks = collections.Counter()
    for c in nonempty:
        for k, v in c["claims"].items():
            b, until = (int(x) for x in v.split()[:2])
            blocks[b] += 1
            left = (until - c["wall_ms"]) / 1000
            rem.append(left)
            if left < 0:
                stale.append((c["t"], k, v, round(left, 1)))
    print(
        f"  remaining life of entries when sampled: min {min(rem):.1f}s max {max(rem):.1f}s; "
        f"expired-but-present samples: {len(stale)} {stale[:8]}"
    )
    print("  claimed block sizes seen (samples):", dict(sorted(blocks.items())[:30]))
    # distinct claims (field, value) and how long each value persisted
    distinct = collections.OrderedDict()
    for c in nonempty:
        for k, v in c["claims"].items():
            distinct.setdefault((k, v.split()[0]), [c["t"], c["t"]])[1] = c["t"]
    print(
        f"  distinct (worker, blocks) claim episodes: {len(distinct)}; longest seen span "
        f"{max(b - a for a, b in distinct.values()):.1f}s"
    )
after = [c for c in ok_c if c["t"] > ev.get("load stopped", 1e9)]
print(
    "  after load stopped:",
    [(c["t"], c["claims"]) for c in after if c["claims"]][:10],
    "samples:",
    len(after),
    "last:",
    after[-1] if after else None,
)
# during redis restart
rs = ev.get("redis stop")
if rs:
    print(
        "  around redis restart:",
        [(c["t"], len(c["claims"]) if "claims" in c else "ERR") for c in claims if rs - 4 <= c["t"] <= rs + 20],
    )

print("proc samples:")
for p in jl("proc.jsonl"):
    print(
        " ",
        p.get("t"),
        p.get("phase", ""),
        "r1",
        {k: p["router1"].get(k) for k in ("VmRSS", "Threads", "fds")},
        f"r2(gen{p['router2_gen']})",
        {k: p["router2"].get(k) for k in ("VmRSS", "Threads", "fds")},
    )

print("status after:")
for s in jl("status.jsonl"):
    stt = s["status"]
    if isinstance(stt, dict):
        ws = [
            (
                w.get("id"),
                w.get("role"),
                w.get("kv_blocks_used"),
                w.get("kv_blocks_total"),
                w.get("state"),
                w.get("in_flight", w.get("running")),
            )
            for w in stt.get("workers", [])
        ]
        print(" ", s["t"], s["phase"], s.get("router"), ws)
    else:
        print(" ", s["t"], s["phase"], s.get("router"), str(stt)[:300])

for log in sorted(d.glob("*.log")):
    text = log.read_text(errors="replace").splitlines()
    bad = [line for line in text if re.search(r"\bERROR\b|Traceback|CRITICAL", line)]
    warn = [line for line in text if re.search(r"\bWARNING\b", line)]
    print(f"{log.name}: {len(text)} lines, ERROR/Traceback {len(bad)}, WARNING {len(warn)}")
    for line in bad[:8]:
        print("    E", line[:300])
    wc = collections.Counter(re.sub(r"\d+", "N", line)[:200] for line in warn)
    for k, v in wc.most_common(8):
        print(f"    W x{v}", k)

# --- extra: contiguous claim episodes in the hash, and large-request overtaking
runs = []
cur = None
for c in claims:
    if "claims" not in c:
        continue
    v = c["claims"].get("decode-1")
    b = v.split()[0] if v else None
    if cur and cur[0] == b:
        cur[2] = c["t"]
    else:
        if cur and cur[0]:
            runs.append(cur)
        cur = [b, c["t"], c["t"]]
if cur and cur[0]:
    runs.append(cur)
spans = sorted(((r[2] - r[1], r[0], r[1]) for r in runs), reverse=True)
print(f"contiguous same-size claim runs in hash (2 s samples): {len(runs)}; longest: {spans[:6]}")
L = sorted((r for r in reqs if r["large"] and r["ttft"] is not None), key=lambda r: r["start"])
over = []
for r in L:
    first = r["start"] + r["ttft"]
    n = sum(1 for o in L if o["start"] > r["start"] and o["start"] + o["ttft"] < first)
    over.append((n, r["id"], r["ttft"], r["refusals"], r["prompt"] + r["max_tokens"]))
over.sort(reverse=True)
print("large requests overtaken by later large ones (count, id, ttft, refusals, tokens):", over[:8])
print("  large requests overtaken at least once:", sum(1 for o in over if o[0] > 0), "of", len(over))
big = [r for r in L if r["ttft"] > 30]
print(
    "  large with ttft>30s:",
    [(r["id"], r["router"], r["ttft"], r["refusals"], r["prompt"] + r["max_tokens"], r["start"]) for r in big],
)
