"""How steady the calibration's serving latency is: requests sent one at a time to an idle 1P:1D cluster (after the
validation's warm-up), each one's TTFT less what the simulator predicts for it alone from the raw profile (the
residual the calibration takes the median of). Run three times, minutes apart, right after run 7 (see the README
beside `suspects/`; the figures are in sequential-residuals.log).

    PATH=.venv/bin:$PATH PYTHONPATH=src:. python docs/experiments/planner_validation/suspects/sequential_residuals.py
"""

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, "scripts")  # from the repository root
from planner_load import cluster_args, measure, random_load, shape_of, warm_up  # noqa: E402

from pdserve.cluster.local_process import ClusterProcess  # noqa: E402
from pdserve.engine.model_files import read_model_config  # noqa: E402
from pdserve.engine.models import resolve_model  # noqa: E402
from pdserve.planner.hardware import HardwareProfile  # noqa: E402
from pdserve.planner.simulator import Simulator  # noqa: E402
from pdserve.planner.workload import SimRequest  # noqa: E402

args = argparse.Namespace(
    model="tiny-random",
    kv_cache_gb=0.25,
    input_len=1024,
    output_len=32,
    range_ratio=0.5,
    slo_ttft_ms=500,
    slo_tpot_ms=50,
    rates=[16.0],
    warmup=48,
)
profile = HardwareProfile.load(Path("docs/experiments/planner_validation/profile-run7.json"))
shape = shape_of("1:1")
vocab = read_model_config(resolve_model(args.model)).vocab_size
with tempfile.TemporaryDirectory() as tmp:
    cluster = ClusterProcess(*cluster_args(shape, args), log_path=Path(tmp) / "cluster.log")
    try:
        warm_up(cluster.address, args, vocab, 100)
        result = measure(cluster.address, random_load(args, vocab, 96, args.output_len), args, 101, 1)
    finally:
        cluster.stop()
records = [r for r in result["requests"] if r["ttft_ms"]]
measured = np.array([r["ttft_ms"] for r in records])
alone = np.array(
    [Simulator(profile, shape).run([SimRequest(0.0, r["input_len"], r["output_len"])]).ttft_s[0] * 1e3 for r in records]
)
for name, values in (("measured TTFT", measured), ("simulated alone", alone), ("residual", measured - alone)):
    print(f"{name}: p10/p50/p90/p99 {np.percentile(values, [10, 50, 90, 99]).round(1).tolist()} ms")
