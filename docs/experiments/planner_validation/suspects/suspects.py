"""The README's suspects (2P:1D at 16 req/s): clusters started one after another per variant, three replays of one
trace each, with each replay's per-thread scheduler statistics. A variant is "default", "rr" (the router's
round-robin placement) or a GIL switch interval in seconds, set in every cluster process by the
sitecustomize.py beside this file.

    PYTHONPATH=docs/experiments/planner_validation/suspects:src:. python \
        docs/experiments/planner_validation/suspects/suspects.py 2:1 16 default,0.0005,default,0.0005
"""

import argparse
import itertools
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, "scripts")  # from the repository root
from planner_load import cluster_args, measure, shape_of, warm_up, write_trace  # noqa: E402

from loadgen.workload import WorkloadConfig  # noqa: E402
from pdserve.cluster.local_process import ClusterProcess, descendants  # noqa: E402
from pdserve.engine.model_files import read_model_config  # noqa: E402
from pdserve.engine.models import resolve_model  # noqa: E402
from pdserve.planner import workload  # noqa: E402
from pdserve.planner.hardware import HardwareProfile  # noqa: E402
from pdserve.planner.plan import SLO, simulate  # noqa: E402

args = argparse.Namespace(
    model="tiny-random",
    kv_cache_gb=0.25,
    slo_ttft_ms=500,
    slo_tpot_ms=50,
    input_len=1024,
    output_len=32,
    range_ratio=0.5,
    warmup=48,
    rates=[float(sys.argv[2])],
    num_requests=150,
)
config = sys.argv[1]
variants = sys.argv[3].split(",")  # e.g. default,0.0005,default,0.0005
cal = HardwareProfile.load(Path("docs/experiments/planner_validation/calibrated_profile.json"))
shape = shape_of(config)
vocab = read_model_config(resolve_model("tiny-random")).vocab_size
load = workload.synthetic(1.0, 1024, 32, 150, 0.5, 1, 0)
seeds = itertools.count(100)
out = []


def sched(pids):
    d = {}
    for pid in pids:
        for t in Path(f"/proc/{pid}/task").glob("*"):
            try:
                run, wait, n = map(int, (t / "schedstat").read_text().split())
                name = (t / "comm").read_text().strip()
                pname = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                continue
            d[(pid, int(t.name))] = (f"{pname}/{name}", run, wait, n)
    return d


def diff(a, b):
    rows = []
    for k, (name, run, wait, n) in b.items():
        r0, w0, n0 = a.get(k, (name, 0, 0, 0))[1:]
        if n - n0:
            rows.append((name, (run - r0) / 1e9, (wait - w0) / 1e9, n - n0))
    return rows


with tempfile.TemporaryDirectory() as tmp:
    tmp = Path(tmp)
    trace = tmp / "trace.jsonl"
    write_trace(trace, load, args.rates[0])
    replayed = workload.from_trace(trace)
    pred = simulate(cal, shape, replayed, replayed.rate, SLO(500, 50))
    print("predicted p90 ttft", pred.ttft_ms[1], flush=True)
    for i, v in enumerate(variants):
        env = {} if v in ("default", "rr") else {"PDSERVE_EXP_SWITCH": v}
        policy = ["--policy", "round-robin"] if v == "rr" else []
        c = ClusterProcess(*cluster_args(shape, args), *policy, log_path=tmp / f"c{i}.log", env=env)
        try:
            warm_up(c.address, args, vocab, next(seeds))
            for rep in range(3):
                pids = descendants(c.proc.pid) | {c.proc.pid, os.getpid()}
                s0 = sched(pids)
                m = measure(c.address, WorkloadConfig("trace", 150, vocab, trace=trace), args, next(seeds))
                row = dict(variant=v, rep=rep, p90=m["p90_ttft_ms"], p50=m.get("p50_ttft_ms"), load=os.getloadavg()[0])
                print(json.dumps(row), flush=True)
                rows = diff(s0, sched(pids))
                tot_run = sum(r[1] for r in rows)
                tot_wait = sum(r[2] for r in rows)
                tot_n = sum(r[3] for r in rows)
                per_slice = 1e3 * tot_wait / max(tot_n, 1)
                print(f"  run {tot_run:.2f}s wait {tot_wait:.2f}s slices {tot_n} -> {per_slice:.3f} ms/slice")
                agg = {}
                for name, run, wait, n in rows:
                    a = agg.setdefault(name, [0, 0, 0])
                    a[0] += run
                    a[1] += wait
                    a[2] += n
                for name, (run, wait, n) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:8]:
                    print(f"    {name:40s} run {run:6.2f} wait {wait:6.2f} n {n:6d} {1e3 * wait / n:6.3f} ms/slice")
                out.append(row)
        finally:
            c.stop()
print(json.dumps(out))
