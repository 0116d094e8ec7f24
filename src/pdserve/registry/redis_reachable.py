"""Whether a Redis answers at a URL, asked before anything is started that would need it."""

from __future__ import annotations

import redis

from pdserve.registry.redis import TIMEOUT_S, connect


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
