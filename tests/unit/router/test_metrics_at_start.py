"""A freshly started router's /metrics, before any request: every counter whose label values are a closed set is
there at 0 for each tenant the router knows (an open cluster's one, a key table's and "" for a caller without a
valid key), so that Prometheus' rate() and increase() see the first occurrence of each; a key reload adds its new
tenants' series."""

from __future__ import annotations

import itertools
from pathlib import Path

import httpx2
from prometheus_client.parser import text_string_to_metric_families

from pdserve.build import current_build
from pdserve.config import RouterConfig, SLOClass
from pdserve.metrics import FINISH_REASONS, MOVE_KINDS, REQUEST_OUTCOMES, SLO_JUDGEMENTS
from pdserve.registry.memory import InMemoryPrefixIndex, InMemoryRegistry
from pdserve.security.api_keys import OPEN_TENANT, digest
from pdserve.telemetry import Telemetry
from services.router.key_reload import KeyReload
from services.router.server import start_router
from tests.unit.router.router_builder import Router


def keys_file(*tenants: str) -> str:
    return "".join(f'[[keys]]\nname = "{t}"\nsha256 = "{digest(t)}"\ntenant = "{t}"\n' for t in tenants)


async def scrape(config: RouterConfig) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """name -> sorted labels -> value, of a router started with `config` and not yet asked anything."""
    telemetry = Telemetry("pdserve-router")
    server, _ = await start_router(
        "tiny-random", InMemoryRegistry(), InMemoryPrefixIndex(), config, "127.0.0.1", 0, telemetry
    )
    try:
        port = telemetry.serve_metrics("127.0.0.1", 0)
        async with httpx2.AsyncClient(timeout=10) as http:
            text = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
    finally:
        await server.stop(None)
        telemetry.shutdown()
    series: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if not k.startswith("otel_scope_")))
            series.setdefault(s.name, {})[labels] = s.value
    return series


def zeros(series: dict[tuple[tuple[str, str], ...], float]) -> set[tuple[tuple[str, str], ...]]:
    assert all(value == 0 for value in series.values())
    return set(series)


async def test_an_open_routers_counters_start_at_zero_for_every_outcome() -> None:
    series = await scrape(RouterConfig(slo_classes=(SLOClass(3, 1000, 100),)))
    requests = zeros(series["pdserve_requests_total"])
    assert requests == {(("outcome", o), ("tenant", OPEN_TENANT)) for o in REQUEST_OUTCOMES}
    successes = zeros(series["pdserve_request_success_total"])
    assert successes == {(("finish_reason", r), ("tenant", OPEN_TENANT)) for r in FINISH_REASONS}
    assert zeros(series["pdserve_request_moves_total"]) == {(("kind", k),) for k in MOVE_KINDS}
    slos = ("own", "default", "priority>=3")  # each SLO a request may be held to: its own, the class's, the default
    judged = itertools.product(slos, SLO_JUDGEMENTS, SLO_JUDGEMENTS)
    expected = {(("slo", s), ("tenant", OPEN_TENANT), ("tpot", p), ("ttft", t)) for s, t, p in judged}
    assert zeros(series["pdserve_requests_slo_total"]) == expected
    for name in ("pdserve_prompt_tokens_total", "pdserve_generation_tokens_total"):
        assert zeros(series[name]) == {(("tenant", OPEN_TENANT),)}


async def test_a_router_exports_its_build_and_its_process() -> None:
    """As each worker does: which build it runs (a rollout followed by `count by (build)`), and the process
    collector's memory, CPU and start time."""
    series = await scrape(RouterConfig())
    assert series["pdserve_build_info"] == {(("build", current_build()), ("role", "router")): 1}
    for name in ("process_resident_memory_bytes", "process_cpu_seconds_total", "process_start_time_seconds"):
        assert list(series[name].values())[0] > 0, name


async def test_a_keyed_routers_counters_start_at_zero_for_its_tenants_and_unauthenticated_callers(
    tmp_path: Path,
) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text(keys_file("team-a", "team-b"))
    requests = zeros((await scrape(RouterConfig(api_keys_file=str(keys))))["pdserve_requests_total"])
    expected = {(("outcome", o), ("tenant", t)) for o in REQUEST_OUTCOMES for t in ("team-a", "team-b")}
    assert requests == expected | {(("outcome", "unauthenticated"), ("tenant", ""))}


async def test_a_key_reload_counts_a_new_tenant_from_zero(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(keys_file("a"))
    reload = KeyReload(str(path))
    telemetry = Telemetry("pdserve-router")
    lifecycle = Router([]).lifecycle(reload.table, telemetry=telemetry)
    path.write_text(keys_file("a", "b"))
    reload.reload(lifecycle)
    counts = {
        (s.labels["outcome"], s.labels["tenant"]): s.value
        for f in telemetry.registry.collect()
        for s in f.samples
        if s.name == "pdserve_requests_total"
    }
    assert {tenant for _, tenant in counts} == {"", "a", "b"}
    assert all(counts[(outcome, "b")] == 0 for outcome in REQUEST_OUTCOMES)
    telemetry.shutdown()
