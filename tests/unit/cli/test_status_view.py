"""`pdserve status` output: every worker id and role whole, piped, on a wide terminal and on a narrow one."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from pdserve.status_view import COLUMNS, plain_text, print_status
from pdserve.v1 import admin_pb2 as apb

ADDRESS = "127.0.0.1:50051"


def reply() -> apb.ClusterStatusResponse:
    """What the router answers for a cluster of three workers, one of each role, with long ids."""
    workers = [
        ("colocated-7f3e9a1c", "colocated", "10.0.0.17:41233"),
        ("decode-1a2b3c4d", "decode", "10.0.0.17:40111"),
        ("prefill-0", "prefill", "10.0.0.17:40007"),
    ]
    return apb.ClusterStatusResponse(
        workers=[
            apb.WorkerStatus(
                id=worker_id,
                role=role,
                address=address,
                health="SERVING",
                running=3,
                waiting=1,
                queued_prefill_tokens=2048,
                kv_blocks_used=120,
                kv_blocks_cached=40,
                kv_blocks_total=4096,
                ttft_p50_ms=812.25,
                ttft_p99_ms=1940.5,
                tpot_p50_ms=41.0,
                tpot_p99_ms=88.75,
            )
            for worker_id, role, address in workers
        ],
        in_flight=5,
        draining=False,
    )


def render(terminal: bool, width: int) -> str:
    out = io.StringIO()
    console = Console(file=out, force_terminal=terminal, width=width, color_system=None, legacy_windows=False)
    print_status(reply(), ADDRESS, console)
    return out.getvalue()


def assert_whole(text: str) -> None:
    """Ids, roles, addresses and health each whole on one line; longer cells may wrap at a space, never cut."""
    assert "…" not in text and "..." not in text
    for w in reply().workers:
        for value in (w.id, w.role, w.address, w.health):
            assert value in text, f"{value!r} is cut in:\n{text}"
    words = " ".join(text.split())
    assert words.count("120/4096 (40 cached)") == 3 and words.count("812.2 / 1940.5") == 3


def test_piped_output_is_plain_aligned_text_one_worker_a_line():
    text = render(terminal=False, width=40)  # a pipe's "width" must not matter
    assert text == plain_text(reply(), ADDRESS) + "\n"
    assert_whole(text)
    lines = text.splitlines()
    assert lines[0] == f"pdserve at {ADDRESS}: 5 in flight"
    header, body = lines[1], lines[2:]
    assert len(body) == 3 and not any(c in text for c in "│┃━─")
    for line, w in zip(body, reply().workers, strict=True):
        assert line.split()[:4] == [w.id, w.role, w.address, w.health]
        # aligned: each column starts where its header does
        for name, _ in COLUMNS[:4]:
            start = header.index(name)
            assert line[start - 1 : start] in ("", " ") and line[start] != " "


@pytest.mark.parametrize("width", [24, 40, 80])
def test_a_narrow_terminal_gets_one_block_per_worker_nothing_cut(width):
    text = render(terminal=True, width=width)
    assert_whole(text)
    assert "┃" not in text  # the table did not fit, so none was squeezed
    for w in reply().workers:
        assert f"\n{w.id}\n" in text and "  role" in text


def test_a_wide_terminal_gets_the_table():
    text = render(terminal=True, width=200)
    assert_whole(text)
    assert "┃" in text or "│" in text
    for w in reply().workers:
        row = next(line for line in text.splitlines() if w.id in line)
        assert w.role in row and w.address in row  # one row per worker


def test_the_title_shows_the_desired_counts_and_the_serving_ones_while_they_differ():
    r = apb.ClusterStatusResponse(
        workers=[
            apb.WorkerStatus(id="prefill-0", role="prefill", health="SERVING"),
            apb.WorkerStatus(id="prefill-2", role="prefill", health="NOT_SERVING"),  # still warming up
            apb.WorkerStatus(id="decode-1", role="decode", health="SERVING"),
        ],
        desired={"decode": 1, "prefill": 2},
    )
    title = plain_text(r, ADDRESS).splitlines()[0]
    assert title.endswith("; desired 2 prefill, 1 decode (serving 1 prefill, 1 decode)")
    r.workers[1].health = "SERVING"
    assert plain_text(r, ADDRESS).splitlines()[0].endswith("; desired 2 prefill, 1 decode")
    assert "desired" not in plain_text(reply(), ADDRESS)  # unknown counts: nothing said


def test_the_title_names_the_builds_while_workers_run_more_than_one():
    r = reply()
    for w, b in zip(r.workers, ("img:v2", "img:v1", "img:v2"), strict=True):
        w.build = b
    assert plain_text(r, ADDRESS).splitlines()[0].endswith("; builds img:v1 (1 worker), img:v2 (2 workers)")
    r.workers[1].build = "img:v2"
    assert "builds" not in plain_text(r, ADDRESS)  # one build: nothing said


def test_the_title_names_kv_wire_versions_and_features_while_workers_differ():
    """A rollout that changes the KV header or adds a feature: what splits placement is said, and only then."""
    r = reply()
    for w, version in zip(r.workers, (3, 4, 4), strict=True):
        w.kv_wire_version = version
        w.features.append("output_constraint")
    r.workers[2].features.append("other_feature")
    title = plain_text(r, ADDRESS).splitlines()[0]
    assert title.endswith("; KV wire v3 (1 worker), v4 (2 workers); other_feature on 1 of 3 workers")
    r.workers[0].kv_wire_version = 4
    r.workers[0].features.append("other_feature")
    r.workers[1].features.append("other_feature")
    assert plain_text(r, ADDRESS).splitlines()[0] == f"pdserve at {ADDRESS}: 5 in flight"


def test_the_title_names_the_tokenizers_while_a_worker_runs_another_than_the_routers():
    """A vocabulary's rollout half done: the workers of another tokenizer take none of this router's requests."""
    r = reply()
    r.tokenizer = "a" * 16
    for w, t in zip(r.workers, ("a" * 16, "b" * 16, ""), strict=True):  # "": a worker too old to say
        w.tokenizer = t
    title = plain_text(r, ADDRESS).splitlines()[0]
    assert title.endswith(f"; tokenizer {'a' * 16} (this router's) on 1 of 3 workers, {'b' * 16} on 1")
    r.workers[1].tokenizer = "a" * 16
    assert "tokenizer" not in plain_text(r, ADDRESS)  # every worker the router's: nothing said
    r.tokenizer, r.workers[1].tokenizer = "", "b" * 16
    assert "tokenizer" not in plain_text(r, ADDRESS)  # a router too old to say
