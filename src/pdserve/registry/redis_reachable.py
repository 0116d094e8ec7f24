"""Whether a Redis answers at a URL, asked before anything is started that would need it."""

from __future__ import annotations

import asyncio
import logging
import time

import redis

from pdserve.redaction import redacted_url
from pdserve.registry.redis import TIMEOUT_S, connect

log = logging.getLogger(__name__)
WAIT_RETRY_S = 1.0  # between PINGs while a process waits for its Redis


def check_answers(url: str) -> None:
    """redis.ConnectionError, saying why, when no Redis at `url` answers a PING within TIMEOUT_S (nothing listening,
    no route, its TLS or password refused, another server on that port): `pdserve up` asks before it starts Ray,
    which took 6 s to start and stop again before the first call to Redis failed."""
    client = connect(url)
    try:
        client.ping()
    except redis.ConnectionError:
        raise
    except redis.TimeoutError as e:  # a host that drops the connection's SYN
        raise redis.ConnectionError(f"no answer within {TIMEOUT_S:g} s ({e})") from None
    except redis.RedisError as e:  # InvalidResponse: an HTTP server's answer, say
        raise redis.ConnectionError(f"what answers there is no Redis ({e})") from None
    finally:
        client.close()


async def wait_until_answers(url: str, stop: asyncio.Event, deadline: float, before: str) -> bool:
    """True once a Redis at `url` answers; False when `stop` is set first. A Redis started after this process (its
    pod scheduled later) is waited for, saying so in a log line naming the URL (never its password) and why it does
    not answer, again whenever that changes; past `deadline` (monotonic) redis.ConnectionError with the last reason:
    a URL that names no Redis ends the process then, not never. `before`: what waits for it, for the log line."""
    start, reason = time.monotonic(), ""
    while True:
        try:
            await asyncio.to_thread(check_answers, url)
        except redis.ConnectionError as e:
            left = deadline - time.monotonic()
            if left <= 0:
                waited = time.monotonic() - start
                raise redis.ConnectionError(f"no answer within {waited:.0f} s of waiting ({e})") from None
            if str(e) != reason:
                reason = str(e)
                log.warning(
                    "registry redis at %s does not answer (%s): waiting for it, up to %.0f s more, before %s",
                    redacted_url(url),
                    reason,
                    left,
                    before,
                )
            try:
                await asyncio.wait_for(stop.wait(), min(WAIT_RETRY_S, left))
            except TimeoutError:
                continue
            return False
        if reason:
            log.info("registry redis at %s answers after %.1f s", redacted_url(url), time.monotonic() - start)
        return True
