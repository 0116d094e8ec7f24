"""Mooncake-format traces: JSONL, a request a line, its timestamp (ms), input_length, output_length and optional
hash_ids (one shared prompt block each). One reader and one check, so loadgen replays and `pdserve plan` simulates
the same requests: the planner accepted `"input_length": 12.7` (truncated) and `"output_length": "5"`, which loadgen
refused, and planned every line where loadgen replayed the first --num-prompts."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.capped_read import read_capped
from pdserve.request_rate import MAX_SPAN_S

# The largest trace read: 100,000 requests (the most `pdserve plan --num-requests` simulates) of 2 KiB lines, each
# the 256 hash ids of a 128k-token prompt; a million lines without hash ids (~70 bytes each) fit too.
MAX_TRACE_BYTES = 256 * 2**20


@dataclass(frozen=True)
class TraceRequest:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...] = ()  # loadgen's shared prompt blocks; the planner simulates no prefix cache


def read_trace(path: Path, limit: int | None = None) -> list[TraceRequest]:
    """The trace's requests in timestamp order (equal stamps in file order), the first `limit` of them (None: all),
    each checked first: a ValueError names the line and what it lacks, or the bound (size, span) it is past, which
    both commands report as a usage error."""
    try:
        text = read_capped(path, MAX_TRACE_BYTES, "--trace", "100,000 lines of 2 KiB").decode()
    except UnicodeDecodeError as e:  # it named neither the trace nor the flag
        raise ValueError(f"trace {path} is not UTF-8 text ({e})") from None
    requests = [_request(path, n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not requests:
        raise ValueError(f"trace {path} holds no requests")
    requests = sorted(requests, key=lambda r: r.timestamp_ms)[:limit]
    if (span := (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1e3) > MAX_SPAN_S:  # replayed for ever
        raise ValueError(f"trace {path} spans {span:.3g} s, past the {MAX_SPAN_S:g} s (~32 years) arrivals may span")
    return requests


def _request(path: Path, n: int, text: str) -> TraceRequest:
    def bad(what: str) -> ValueError:
        return ValueError(f"trace {path}, line {n}: {what}, in {text[:200]!r}")

    try:
        line: Any = json.loads(text)
    except ValueError:
        raise bad("not JSON") from None
    if not isinstance(line, dict):
        raise bad("not a JSON object")
    for key in ("timestamp", "input_length", "output_length"):
        if key not in line:
            raise bad(f"no {key!r}")
    at, hash_ids = line["timestamp"], line.get("hash_ids", [])
    if not _number(at) or not math.isfinite(at):
        raise bad(f"timestamp {at!r} is not a time in ms")
    lengths = (line["input_length"], line["output_length"])
    if not all(_integer(x) and x >= 1 for x in lengths):  # a server reads max_tokens 0 as its own default
        raise bad(f"input_length and output_length must be integers of at least 1, got {lengths}")
    if not isinstance(hash_ids, list) or not all(_integer(h) and h >= 0 for h in hash_ids):
        raise bad(f"hash_ids must be a list of integers >= 0, got {hash_ids!r}")
    return TraceRequest(at, *lengths, tuple(hash_ids))


def _integer(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)
