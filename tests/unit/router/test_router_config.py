"""RouterConfig: SLO precedence, priority queue bounds, TOML files."""

from __future__ import annotations

import pytest

from pdserve.config import RouterConfig, SLOClass
from pdserve.protocol.request_checks import RequestLimits


def test_slo_for_prefers_the_request_then_its_priority_class_then_the_default():
    cfg = RouterConfig(
        default_ttft_ms=5000,
        default_tpot_ms=500,
        slo_classes=(SLOClass(priority=5, ttft_ms=500, tpot_ms=50), SLOClass(priority=0, ttft_ms=2000, tpot_ms=200)),
    )
    assert cfg.slo_for(-1, 0, 0) == (5000, 500)  # below every class
    assert cfg.slo_for(0, 0, 0) == (2000, 200)
    assert cfg.slo_for(4, 0, 0) == (2000, 200)
    assert cfg.slo_for(5, 0, 0) == (500, 50)
    assert cfg.slo_for(9, 0, 0) == (500, 50)  # the highest class it reaches
    assert cfg.slo_for(9, 123, 0) == (123, 50)
    assert cfg.slo_for(0, 0, 7) == (2000, 7)
    assert cfg.slo_for(-3, 42, 4) == (42, 4)
    assert RouterConfig().slo_for(3, 0, 0) == (RouterConfig.default_ttft_ms, RouterConfig.default_tpot_ms)


def test_queue_bound_by_priority():
    cfg = RouterConfig(max_queued_prefill_tokens=10_000, low_priority_reserve=0.2)
    assert cfg.queue_bound(1) == 10_000
    assert cfg.queue_bound(0) == pytest.approx(8_000)
    assert cfg.queue_bound(-1) == pytest.approx(6_000)
    assert RouterConfig(low_priority_reserve=0.75).queue_bound(-1) == 0


def test_router_config_from_toml_file(tmp_path):
    path = tmp_path / "router.toml"
    path.write_text(
        """
[router]
default_ttft_ms = 1500
max_in_flight = 7
policy = "round-robin"

[[router.slo_classes]]
priority = 1
ttft_ms = 300
tpot_ms = 30

[[router.slo_classes]]
priority = 0
ttft_ms = 900.5
tpot_ms = 90

[router.request_limits]
max_stop = 4

[other]
ignored = true
"""
    )
    cfg = RouterConfig.from_file(str(path), max_in_flight=None, transfer_gbps=10.0)
    assert cfg.default_ttft_ms == 1500 and cfg.default_tpot_ms == RouterConfig.default_tpot_ms
    assert cfg.max_in_flight == 7  # a None override leaves the file's value
    assert cfg.transfer_gbps == 10.0
    assert cfg.policy == "round-robin"
    assert cfg.slo_classes == (SLOClass(1, 300, 30), SLOClass(0, 900.5, 90))
    assert cfg.slo_for(0, 0, 0) == (900.5, 90) and cfg.slo_for(2, 0, 0) == (300, 30)
    assert cfg.request_limits == RequestLimits(max_stop=4)  # the others keep their defaults
    assert RouterConfig.from_file(str(path), max_in_flight=3).max_in_flight == 3

    empty = tmp_path / "empty.toml"
    empty.write_text("")
    assert RouterConfig.from_file(str(empty)) == RouterConfig()

    bad = tmp_path / "bad.toml"
    bad.write_text('[router]\npolicy = "random"\n')
    with pytest.raises(ValueError, match="policy"):
        RouterConfig.from_file(str(bad))


def test_first_token_timeout_must_be_positive_and_finite():
    assert RouterConfig().first_token_timeout_s == 60.0
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="first_token_timeout_s"):
            RouterConfig(first_token_timeout_s=bad)


def test_the_assumed_transfer_speed_must_be_positive_and_finite():
    """Zero would divide every placement's KV transfer time by zero: refused at start, not INTERNAL per request."""
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="transfer_gbps"):
            RouterConfig(transfer_gbps=bad)


def test_the_http_body_limit_defaults_to_derived_and_is_a_router_setting(tmp_path):
    assert RouterConfig().max_http_body_bytes == 0  # what a valid body can hold (test_request_size.py)
    path = tmp_path / "router.toml"
    path.write_text("[router]\nmax_http_body_bytes = 65536\n")
    assert RouterConfig.from_file(str(path)).max_http_body_bytes == 65536
    with pytest.raises(ValueError, match="max_http_body_bytes"):
        RouterConfig(max_http_body_bytes=-1)


@pytest.mark.parametrize(
    "bad",
    [
        {"max_in_flight": 0},
        {"max_queued_prefill_tokens": -1},
        {"default_ttft_ms": 0.0},
        {"default_tpot_ms": float("nan")},
        {"heartbeat_s": 0.0},
        {"sse_keepalive_s": 0.0},  # a comment after every silence of no length: a busy loop
        {"sse_keepalive_s": 1e-6},
        {"default_max_tokens": 0},  # every request without max_tokens would be refused as the caller's error
        {"slo_classes": (SLOClass(priority=1, ttft_ms=0.0, tpot_ms=50.0),)},
        {"ejection_s": -1.0},
        {"no_workers_wait_s": float("inf")},
        {"low_priority_reserve": 1.5},
        {"slo_headroom": 0.0},
        {"max_connection_age_s": -1.0},
        {"max_connection_age_s": 1e-4},  # 0 ms to gRPC
        {"max_connection_age_s": 3e6},  # past gRPC's C int of milliseconds
    ],
)
def test_settings_out_of_range_are_refused_naming_them(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        RouterConfig(**bad)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("[router]\nmax_inflight = 10\n", "unknown key(s) max_inflight in [router]"),
        ("[[router.slo_classes]]\npriority = 1\nttft_ms = 100\ntpot_ms = 50\ntbt_ms = 3\n", "tbt_ms"),
        ("[router.request_limits]\nmax_prompt = 5\n", "unknown key(s) max_prompt in [router.request_limits]"),
        ("[routr]\nmax_in_flight = 10\n", "no [router] table (it has [routr])"),  # dropped without a word before
        ("max_in_flight = 10\n", "max_in_flight outside any table"),
        ('[router]\nmax_in_flight = "10"\n', "[router] max_in_flight must be a whole number, got '10'"),
        ("[router]\nmax_in_flight = 1.5\n", "[router] max_in_flight must be a whole number, got 1.5"),
        ("[router]\nmax_in_flight = true\n", "[router] max_in_flight must be a whole number, got True"),
        ('[router]\nreflection = "false"\n', "[router] reflection must be true or false, got 'false'"),  # was truthy
        ("[router]\nslo_classes = 5\n", "[router] slo_classes must be an array of tables, got 5"),
        ("[[router.slo_classes]]\nttft_ms = 1\ntpot_ms = 1\n", "[[router.slo_classes]] #1 lacks priority"),
        ('[[router.slo_classes]]\npriority = "1"\nttft_ms = 1\ntpot_ms = 1\n', "#1 priority must be a whole number"),
        ('[router.request_limits]\nmax_stop = "16"\n', "[router.request_limits] max_stop must be a whole number"),
        ("[router]\nejection_s = inf\n", "ejection_s must not be negative, got inf"),
        ("[router]\nmax_in_flight = \n", "not valid TOML"),
    ],
)
def test_a_config_file_that_says_something_else_is_refused_naming_the_file_and_key(tmp_path, text, says):
    path = tmp_path / "router.toml"
    path.write_text(text)
    with pytest.raises(ValueError) as refused:
        RouterConfig.from_file(str(path))
    assert str(refused.value).startswith(f"{path}: ") and says in str(refused.value)


def test_a_whole_number_for_a_float_setting_is_taken_as_a_float(tmp_path):
    path = tmp_path / "router.toml"
    path.write_text("[router]\ndefault_ttft_ms = 1500\n")
    assert RouterConfig.from_file(str(path)).default_ttft_ms == 1500.0
