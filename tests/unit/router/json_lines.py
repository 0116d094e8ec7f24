"""The router's log lines as a test reads them: each record as its JSON formatter writes it for stderr."""

from __future__ import annotations

import json
import logging

from pdserve.log_setup import JsonFormatter


class JsonLines(logging.Handler):
    """Each record formatted as it is emitted, in the request's context (its id and span are read from it then)."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(JsonFormatter())
        self.lines: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(json.loads(self.format(record)))
