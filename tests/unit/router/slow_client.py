"""A client that sends a request's start, then one byte every 50 ms (slowloris), until the server closes on it."""

from __future__ import annotations

import asyncio


async def dribbled(port: int, start: bytes, byte: bytes, wait_s: float) -> tuple[bytes, float]:
    """What the server answered before closing, and how long after `start` went out it closed (TimeoutError past
    `wait_s`)."""
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(start)
    sent = loop.time()

    async def dribble() -> None:
        while True:
            await asyncio.sleep(0.05)
            writer.write(byte)

    dribbling = asyncio.ensure_future(dribble())
    try:
        answer = await asyncio.wait_for(reader.read(), wait_s)  # to the end: the server closed it
    finally:
        dribbling.cancel()
        writer.close()
    return answer, loop.time() - sent
