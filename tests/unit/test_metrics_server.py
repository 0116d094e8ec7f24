"""The metrics port keeps no connection that sends nothing: its server runs a thread per connection, and one left
open and silent (a stuck client, or many of them) would hold that thread for good. Scrapes still answer."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request

import pytest

from pdserve import telemetry
from pdserve.telemetry import Telemetry

pytestmark = pytest.mark.timeout(60)


def test_a_silent_connection_is_closed_and_its_thread_ends(monkeypatch):
    monkeypatch.setattr(telemetry, "METRICS_READ_TIMEOUT_S", 0.5)
    t = Telemetry("pdserve-test")
    port = t.serve_metrics("127.0.0.1", 0)
    try:
        threads = threading.active_count()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as silent:
            time.sleep(0.2)  # accepted: its handler thread runs, waiting for a request line
            assert threading.active_count() == threads + 1
            start = time.monotonic()
            assert silent.recv(1) == b""  # the server closed it (a socket timeout here: it kept it)
        assert time.monotonic() - start < 5
        deadline = time.monotonic() + 5
        while threading.active_count() > threads and time.monotonic() < deadline:
            time.sleep(0.05)
        assert threading.active_count() == threads
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as scrape:
            assert scrape.status == 200 and b"process_cpu_seconds_total" in scrape.read()
    finally:
        t.shutdown()


def test_a_silent_connection_closed_writes_no_traceback(monkeypatch, capfd):
    """socketserver prints what a handler lets out to stderr: one traceback per idle connection, unlogged."""
    monkeypatch.setattr(telemetry, "METRICS_READ_TIMEOUT_S", 0.3)
    t = Telemetry("pdserve-test")
    port = t.serve_metrics("127.0.0.1", 0)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as silent:
            assert silent.recv(1) == b""
        time.sleep(0.2)  # its thread's last words, if any, are written
        assert "Traceback" not in capfd.readouterr().err
    finally:
        t.shutdown()
