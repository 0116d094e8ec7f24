"""How `pdserve status` shows the cluster to a person: every cell whole, however it is read.

Piped or redirected, the output is plain aligned columns, one worker per line, for grep and awk. On a
terminal it is a table when the table fits the width and otherwise one block of `field  value` lines per
worker: a table squeezed into a narrow terminal cuts its cells to "deco…", which is what this avoids.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from pdserve.v1 import admin_pb2 as apb

_Cell = Callable[[apb.WorkerStatus], str]
COLUMNS: tuple[tuple[str, _Cell], ...] = (
    ("worker", lambda w: w.id),
    ("role", lambda w: w.role),
    ("address", lambda w: w.address),
    ("health", lambda w: w.health),
    ("running", lambda w: str(w.running)),
    ("waiting", lambda w: str(w.waiting)),
    ("queued tok", lambda w: str(w.queued_prefill_tokens)),
    ("KV used/total", lambda w: f"{w.kv_blocks_used}/{w.kv_blocks_total} ({w.kv_blocks_cached} cached)"),
    ("TTFT p50/p99 ms", lambda w: _latency(w, "ttft")),
    ("TPOT p50/p99 ms", lambda w: _latency(w, "tpot")),
    ("speed", lambda w: f"{w.speed_factor:.2f}x" if w.HasField("speed_factor") else "-"),
)
_UNBOUNDED = 1 << 16  # measure the table as if the terminal had no edge
_RIGHT = {"TTFT p50/p99 ms", "TPOT p50/p99 ms", "speed"}


def latency_ms(w: apb.WorkerStatus, field: str) -> float | None:
    """A latency field of the router's reply; None when it had no sample (a prefill worker's TPOT, a worker just
    added), never 0, which would read as the best latency of all."""
    return getattr(w, field) if w.HasField(field) else None


def _latency(w: apb.WorkerStatus, kind: str) -> str:
    p50, p99 = latency_ms(w, f"{kind}_p50_ms"), latency_ms(w, f"{kind}_p99_ms")
    return "-" if p50 is None or p99 is None else f"{p50:.1f} / {p99:.1f}"


def title(reply: apb.ClusterStatusResponse, address: str) -> str:
    desired = _desired(reply)
    draining = ", draining" if reply.draining else ""
    mixed = _builds(reply) + _kv_wire_versions(reply) + _features(reply) + _tokenizers(reply)
    return f"pdserve at {address}: {reply.in_flight} in flight{draining}{desired}{mixed}"


def _builds(reply: apb.ClusterStatusResponse) -> str:
    """`; builds img:v1 (1 worker), img:v2 (2 workers)` while workers run more than one: a rollout under way, or a
    worker left on an old node. Nothing while they agree."""
    counts = Counter(w.build or "unnamed" for w in reply.workers)
    if len(counts) < 2:
        return ""
    return "; builds " + ", ".join(f"{b} ({n} worker{'s' if n > 1 else ''})" for b, n in sorted(counts.items()))


def _kv_wire_versions(reply: apb.ClusterStatusResponse) -> str:
    """`; KV wire v3 (2 workers), v4 (1 worker)` while workers speak more than one: a prefill worker hands off
    only to decode workers of its own version, so each version needs both roles live."""
    counts = Counter(w.kv_wire_version for w in reply.workers if w.kv_wire_version)
    if len(counts) < 2:
        return ""
    return "; KV wire " + ", ".join(f"v{v} ({n} worker{'s' if n > 1 else ''})" for v, n in sorted(counts.items()))


def _features(reply: apb.ClusterStatusResponse) -> str:
    """`; output_constraint on 2 of 3 workers` for each feature not every worker honours: its requests go only to
    those that do."""
    counts = Counter(f for w in reply.workers for f in set(w.features))
    total = len(reply.workers)
    return "".join(f"; {f} on {n} of {total} workers" for f, n in sorted(counts.items()) if n < total)


def _tokenizers(reply: apb.ClusterStatusResponse) -> str:
    """`; tokenizer ebab3b7e903b792d (this router's) on 0 of 2 workers, 6a6fb509e8d32202 on 2` while a worker runs
    another tokenizer than this router's, which takes none of its requests (a vocabulary's rollout half done)."""
    counts = Counter(w.tokenizer for w in reply.workers if w.tokenizer)
    if not reply.tokenizer or set(counts) <= {reply.tokenizer}:
        return ""
    others = ", ".join(f"{t} on {n}" for t, n in sorted(counts.items()) if t != reply.tokenizer)
    own = f"{reply.tokenizer} (this router's) on {counts[reply.tokenizer]} of {len(reply.workers)} workers"
    return f"; tokenizer {own}, {others}"


def _desired(reply: apb.ClusterStatusResponse) -> str:
    """`; desired 2 prefill, 1 decode (serving 1 prefill, 1 decode)` while they differ; the fleet's counts."""
    if not reply.desired:
        return ""
    order = {"prefill": 0, "decode": 1}
    desired = sorted(reply.desired.items(), key=lambda rn: order.get(rn[0], 2))
    serving = {
        r: sum(w.role == r and w.health == "SERVING" and not w.draining for w in reply.workers) for r, _ in desired
    }
    text = "; desired " + ", ".join(f"{n} {r}" for r, n in desired)
    if serving != dict(desired):
        text += " (serving " + ", ".join(f"{serving[r]} {r}" for r, _ in desired) + ")"
    return text


def rows(reply: apb.ClusterStatusResponse) -> list[list[str]]:
    return [[cell(w) for _, cell in COLUMNS] for w in reply.workers]


def plain_text(reply: apb.ClusterStatusResponse, address: str) -> str:
    """Columns padded to their widest cell, two spaces apart; nothing depends on a terminal's width."""
    table = [[name for name, _ in COLUMNS], *rows(reply)]
    widths = [max(len(row[i]) for row in table) for i in range(len(COLUMNS))]
    lines = ["  ".join(_pad(c, w, n) for c, w, (n, _) in zip(row, widths, COLUMNS, strict=True)) for row in table]
    return "\n".join([title(reply, address), *(line.rstrip() for line in lines)])


def print_status(reply: apb.ClusterStatusResponse, address: str, console: Console) -> None:
    """To a terminal: the table if it fits whole, else one block per worker. Elsewhere: plain_text."""
    if not console.is_terminal:
        console.file.write(plain_text(reply, address) + "\n")
        return
    table = _table(reply, address)
    natural = Measurement.get(console, console.options.update_width(_UNBOUNDED), table).maximum
    if natural <= console.width:
        console.print(table)
        return
    console.print(title(reply, address), overflow="fold", highlight=False)
    label_width = max(len(name) for name, _ in COLUMNS[1:])
    for row in rows(reply):
        console.print()
        console.print(Text(row[0], style="bold"), overflow="fold")
        for (name, _), cell in zip(COLUMNS[1:], row[1:], strict=True):
            console.print(f"  {name:<{label_width}}  {cell}", overflow="fold", highlight=False, markup=False)


def _table(reply: apb.ClusterStatusResponse, address: str) -> Table:
    table = Table(title=title(reply, address))
    for name, _ in COLUMNS:
        table.add_column(name, justify="right" if name in _RIGHT else "left", no_wrap=True)
    for row in rows(reply):
        table.add_row(*row)
    return table


def _pad(cell: str, width: int, column: str) -> str:
    return cell.rjust(width) if column in _RIGHT else cell.ljust(width)
