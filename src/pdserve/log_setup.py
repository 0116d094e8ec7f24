"""How every pdserve process logs: one JSON object per line on stderr, each naming its service, worker, request and
span, and without the ERROR records libraries make when a caller leaves mid-stream."""

from __future__ import annotations

import json
import logging
import os
import time
import traceback
from typing import Any

from opentelemetry import trace

from pdserve.telemetry import request_id_var


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, request_id (null outside a request), the current
    span's trace_id and span_id (OpenTelemetry's log data model names; absent outside a span), extras. The ids lead
    from a log line to its request's trace in the tracing backend."""

    _SKIP = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            "request_id": getattr(record, "request_id", None) or request_id_var.get(),
        }
        span = trace.get_current_span().get_span_context()
        if span.is_valid and not span.is_remote:  # a caller's traceparent alone (tracing off) is no span of ours
            line["trace_id"] = trace.format_trace_id(span.trace_id)
            line["span_id"] = trace.format_span_id(span.span_id)
        extras = {k: v for k, v in vars(record).items() if k not in self._SKIP and not k.startswith("_")}
        line.update({k: v for k, v in extras.items() if k not in line})
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def configure_logging(level: str | int = "INFO", service: str | None = None, worker_id: str | None = None) -> None:
    """Structured logs on stderr for this process, at `level` (a name or number); each line names the `service`
    and, in a worker, its `worker_id` (a driver's stderr carries every worker's lines)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter())
    if service:
        handler.addFilter(_ServiceFilter(service, worker_id))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    logging.Formatter.converter = time.gmtime
    quiet_caller_left_errors()


def quiet_caller_left_errors() -> None:
    """Drops the libraries' ERROR records a caller leaving mid-stream makes (below); idempotent."""
    for name in _CALLER_LEFT_ERRORS:
        logging.getLogger(name).addFilter(_DROP_CALLER_LEFT)  # one filter object: added once however often called


# ERROR records, each with a traceback, that a caller leaving mid-stream makes in libraries, never a fault of this
# service's (the request itself is counted and logged as cancelled). grpc.aio logs a streaming handler's failed
# write (grpc/grpc#42295; pdserve's own streams, written by rpc/stream_writer.py, turn it into the cancel it is, but
# a handler that writes itself, gRPC's Health.Watch, still raises it). OpenTelemetry's gRPC interceptors, closed in
# another context than their own, cannot detach the span context they attached
# (open-telemetry/opentelemetry-python-contrib#2357). At a few thousand cancels a minute they buried real errors.
_CALLER_LEFT_ERRORS = {
    "grpc._cython.cygrpc": ("ExecuteBatchError raised in core by servicer method", "ExecuteBatchError"),
    "opentelemetry.context": ("Failed to detach context", "ValueError"),
}


class _CallerLeftFilter(logging.Filter):
    """A failed detach is dropped only where an OpenTelemetry gRPC interceptor's generator was being closed: one of our
    own (a context attached in one task and detached in another, which breaks span parenting) is still logged."""

    def filter(self, record: logging.LogRecord) -> bool:
        message, error = _CALLER_LEFT_ERRORS.get(record.name, ("", ""))
        raised = record.exc_info[1] if record.exc_info else None
        if not (message and record.getMessage().startswith(message) and type(raised).__name__ == error):
            return True
        if record.name != "opentelemetry.context":
            return False
        closing = raised.__context__ if raised is not None else None
        frames = traceback.extract_tb(closing.__traceback__) if isinstance(closing, GeneratorExit) else []
        return not any(f"opentelemetry{os.sep}instrumentation{os.sep}grpc{os.sep}" in f.filename for f in frames)


_DROP_CALLER_LEFT = _CallerLeftFilter()


class _ServiceFilter(logging.Filter):
    def __init__(self, service: str, worker_id: str | None) -> None:
        super().__init__()
        self.service = service
        self.worker_id = worker_id

    def filter(self, record: logging.LogRecord) -> bool:
        record.service = self.service
        if self.worker_id:
            record.worker_id = self.worker_id
        return True
