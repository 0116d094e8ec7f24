"""What the cluster code is handed to run. The services live outside src/pdserve, which never imports them: the
entry point that starts a cluster composes them (services/main.py) and passes these factories down.

Ray pickles a worker actor's arguments, so a factory must be a top-level callable of an importable module.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pdserve.cluster.worker_spec import WorkerSpec
    from pdserve.config import RouterConfig
    from pdserve.engine.async_engine import AsyncEngine
    from pdserve.metrics import WorkerMetrics
    from pdserve.registry.base import PrefixIndex, Registry
    from pdserve.rpc.server import Server
    from pdserve.telemetry import Telemetry


class Closeable(Protocol):
    def close(self) -> None: ...


@dataclass(frozen=True)
class WorkerContext:
    """What a worker's services are built from, once its engine is loaded and before its server starts."""

    spec: WorkerSpec
    engine: AsyncEngine
    server: Server
    telemetry: Telemetry
    metrics: WorkerMetrics


# Adds the role's gRPC services to `context.server`; returns what the worker closes at shutdown (its KV
# transfer endpoint), if anything.
WorkerServices = Callable[[WorkerContext], "Closeable | None"]


class StreamRelay(Protocol):
    def cut_all(self, why: str) -> int: ...


class RouterHandle(Protocol):
    """What the launcher needs of a running router to drain it."""

    draining: bool

    @property
    def relay(self) -> StreamRelay:
        """What a drain whose grace ran out cuts."""

    @property
    def in_flight(self) -> int: ...


class RouterServer(Protocol):
    """The router's listeners (gRPC, and HTTP when asked), drained and stopped together."""

    address: str
    http: Any

    async def set_serving(self, serving: bool) -> None: ...

    async def stop(self, grace_s: float | None) -> None: ...


class StartRouter(Protocol):
    """Starts the router's listeners: gRPC bound on host:port and named by `advertise_host` (default: host), the
    HTTP API on `http_port` unless None."""

    def __call__(
        self,
        model: str,
        registry: Registry,
        prefix_index: PrefixIndex,
        config: RouterConfig,
        host: str,
        port: int,
        telemetry: Telemetry,
        advertise_host: str | None = None,
        *,
        http_port: int | None = None,
    ) -> Awaitable[tuple[RouterServer, RouterHandle]]: ...


@dataclass(frozen=True)
class ClusterServices:
    """Everything `pdserve up`, `controller` and `router` run that is not cluster machinery."""

    workers: WorkerServices
    router: StartRouter
