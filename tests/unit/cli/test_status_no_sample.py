"""`pdserve status` without a latency sample (a prefill worker's TPOT, a worker just added): `-` in the table and
null in JSON, from a router that leaves the field unset; never 0.0, which would read as the best latency of all."""

from __future__ import annotations

import json

from pdserve.client_commands import status_record
from pdserve.protocol.compatibility import UNSAID_KV_WIRE_VERSION
from pdserve.registry.base import WorkerState
from pdserve.status_view import plain_text, rows
from pdserve.v1 import admin_pb2 as apb
from services.router.admin import worker_status
from services.router.recent_latencies import RecentLatencies


def reply() -> apb.ClusterStatusResponse:
    recent = RecentLatencies()
    recent.add("prefill-0", "ttft", 0.0125)
    recent.add("decode-0", "ttft", 0.5)
    recent.add("decode-0", "tpot", 0.02)
    workers = [("prefill-0", "prefill"), ("decode-0", "decode"), ("decode-new", "decode")]
    return apb.ClusterStatusResponse(
        workers=[worker_status(WorkerState(i, role, "10.0.0.1:1"), "SERVING", recent) for i, role in workers]
    )


def test_the_router_leaves_a_latency_without_samples_unset() -> None:
    prefill, decode, new = reply().workers
    assert prefill.HasField("ttft_p50_ms") and prefill.ttft_p50_ms == 12.5
    assert not prefill.HasField("tpot_p50_ms") and not prefill.HasField("tpot_p99_ms")
    assert decode.HasField("tpot_p99_ms") and decode.tpot_p99_ms == 20.0
    assert not any(new.HasField(f) for f in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms"))


def test_the_table_shows_a_dash_without_samples() -> None:
    prefill, decode, new = (row[-3:-1] for row in rows(reply()))  # the speed after them
    assert (prefill, decode, new) == (["12.5 / 12.5", "-"], ["500.0 / 500.0", "20.0 / 20.0"], ["-", "-"])
    text = plain_text(reply(), "127.0.0.1:50051")
    assert "0.0 / 0.0" not in text and text.splitlines()[-1].split()[-3:-1] == ["-", "-"]


def test_json_gives_null_without_samples() -> None:
    prefill, decode, new = json.loads(json.dumps(status_record(reply())))["workers"]
    assert (prefill["ttft_p50_ms"], prefill["tpot_p50_ms"], prefill["tpot_p99_ms"]) == (12.5, None, None)
    assert (decode["tpot_p50_ms"], decode["tpot_p99_ms"]) == (20.0, 20.0)
    assert [new[f] for f in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")] == [None] * 4
    assert new["id"] == "decode-new" and new["health"] == "SERVING"


def test_json_gives_features_and_the_kv_wire_version_a_worker_too_old_to_say_speaks() -> None:
    """A worker of a build before the fields says neither: it honours no feature and speaks the unsaid version."""
    now = WorkerState("decode-1", "decode", "10.0.0.1:2", features=("output_constraint",), kv_wire_version=4)
    old = WorkerState("decode-0", "decode", "10.0.0.1:1")
    r = apb.ClusterStatusResponse(workers=[worker_status(w, "SERVING", RecentLatencies()) for w in (now, old)])
    listed = json.loads(json.dumps(status_record(r)))["workers"]
    assert [(w["features"], w["kv_wire_version"]) for w in listed] == [
        (["output_constraint"], 4),
        ([], UNSAID_KV_WIRE_VERSION),
    ]
    assert all(0 <= w["state_age_s"] < 60 for w in listed)  # both just made


def test_the_speed_factor_is_shown_and_a_router_too_old_to_say_reads_as_unknown() -> None:
    """The worker's live correction of its profile, which the router prices it by: a worker priced twice as slow as
    its neighbour says why it gets no traffic. Unset (an older router): `-` and null, never the profile's 1.00x."""
    slow = WorkerState("prefill-1", "prefill", "10.0.0.1:2", speed_factor=2.5)
    r = apb.ClusterStatusResponse(workers=[worker_status(slow, "SERVING", RecentLatencies())])
    r.workers.add(id="prefill-old", role="prefill", health="SERVING")  # from a router before the field
    assert [row[-1] for row in rows(r)] == ["2.50x", "-"]
    listed = json.loads(json.dumps(status_record(r)))["workers"]
    assert [w["speed_factor"] for w in listed] == [2.5, None]
