"""A raw ASGI caller of the HTTP API: one POST of a JSON body, then a disconnect once the test says it hung up
(`gone`), at a moment an HTTP client could not choose (its first event, a write waiting on a full window)."""

from __future__ import annotations

import asyncio
import json
from typing import Any


class HangingUpCaller:
    def __init__(self, body: dict[str, Any], path: str = "/v1/completions") -> None:
        self._request = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]
        self.gone = asyncio.Event()
        self.scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": "POST", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "headers": [(b"content-type", b"application/json")], "scheme": "http", "server": ("r", 80),
            "client": ("c", 1),
        }  # fmt: skip

    async def receive(self) -> dict[str, Any]:
        if self._request:
            return self._request.pop(0)
        await self.gone.wait()
        return {"type": "http.disconnect"}
