"""Assembles the router: tokenizer and model config (read from metadata, torch-free), placement, the service,
and its listeners: gRPC always, the OpenAI-compatible HTTP API when asked, both on one request lifecycle."""

from __future__ import annotations

import logging

from pdserve.config import RouterConfig
from pdserve.engine.model_files import locate_model, read_model_config, tokenizer_folder
from pdserve.engine.tokenizer import Tokenizer
from pdserve.registry.base import PrefixIndex, Registry
from pdserve.registry.redis import RedisRegistry
from pdserve.rpc.credentials import server_tls
from pdserve.rpc.server import Server
from pdserve.security.quotas import LocalQuotas, Quotas
from pdserve.security.redis_quotas import RedisQuotas
from pdserve.telemetry import Telemetry
from pdserve.v1 import admin_pb2, admin_pb2_grpc, generate_pb2, generate_pb2_grpc
from services.router.admin import AdminServicer
from services.router.admitted import ClusterAdmitted
from services.router.gone_workers import GoneWorkers, PerWorkerState
from services.router.http.app import openai_app
from services.router.http.server import HttpServer
from services.router.key_reload import KeyReload
from services.router.lifecycle import RequestLifecycle
from services.router.load_tracker import LoadTracker
from services.router.own_holds import OwnHolds
from services.router.parse_after_key import ParseAfterKeyCheck
from services.router.peer_check import PeerCheck
from services.router.placement import SLOAwarePlacement
from services.router.predictor import Predictor
from services.router.relay import Relay
from services.router.request_size import max_grpc_request_bytes
from services.router.round_robin_placement import RoundRobinPlacement
from services.router.servicer import GENERATE_METHOD, GenerationServicer
from services.router.shared_claims import SharedKVClaims
from services.router.shared_moving import SharedMoving
from services.router.worker_presence import WorkerPresence

log = logging.getLogger(__name__)

GENERATION_SERVICE = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


class RouterServer:
    """The router's listeners, drained and stopped together (then the background work of its quotas, admitted
    totals, shared KV claims and moving streams, gone workers' state, API key reloads, the watch on its own holds, and
    its relay's channels to workers): the launcher sees one server."""

    def __init__(
        self,
        grpc_server: Server,
        http: HttpServer | None,
        quotas: Quotas,
        admitted: ClusterAdmitted,
        gone_workers: GoneWorkers,
        relay: Relay,
        shared_claims: SharedKVClaims | None,
        shared_moving: SharedMoving | None,
        key_reload: KeyReload | None,
        peers: PeerCheck,
        presence: WorkerPresence,
        own_holds: OwnHolds,
    ) -> None:
        self.grpc = grpc_server
        self.http = http
        self.peers = peers
        peers.on_change = self._apply_health
        self.presence = presence
        presence.on_change = self._apply_health
        self.own_holds = own_holds
        self._serving = False
        self.quotas = quotas
        self.admitted = admitted
        self.gone_workers = gone_workers
        self.relay = relay
        self.shared_claims = shared_claims
        self.shared_moving = shared_moving
        self.key_reload = key_reload
        self.address = grpc_server.address
        self.port = grpc_server.port

    async def set_serving(self, serving: bool) -> None:
        """gRPC health, NOT_SERVING whatever `serving` says while the workers refuse the router's cluster
        credentials, and its Generation service's while it has no live workers (worker_presence.py); the HTTP API's
        /health follows the lifecycle's `draining` flag and the same refusal."""
        self._serving = serving
        await self._apply_health()

    async def _apply_health(self) -> None:
        held = () if self.presence.servable else (GENERATION_SERVICE,)
        await self.grpc.set_serving(self._serving and not self.peers.refused, held)

    async def stop(self, grace_s: float | None) -> None:
        try:
            if self.http is not None:
                await self.http.stop()
            await self.grpc.stop(grace_s)
        finally:  # the background work stops however the listeners did
            await self.peers.close()
            await self.presence.close()
            await self.own_holds.close()
            await self.gone_workers.close()
            if self.key_reload is not None:  # its close never raises
                await self.key_reload.close()
            try:
                await self.quotas.close()
                await self.admitted.close()
            finally:
                try:
                    if self.shared_claims is not None:
                        await self.shared_claims.close()
                    if self.shared_moving is not None:  # its close never raises
                        await self.shared_moving.close()
                finally:
                    await self.relay.close_channels()

    async def wait(self) -> None:
        await self.grpc.wait()


async def start_router(
    model: str,
    registry: Registry,
    prefix_index: PrefixIndex,
    config: RouterConfig,
    host: str,
    port: int,
    telemetry: Telemetry | None = None,
    advertise_host: str | None = None,
    *,
    http_port: int | None = None,
) -> tuple[RouterServer, RequestLifecycle]:
    """The serving router and its request lifecycle (whose `draining` flag and `in_flight` count drive a drain).
    `http_port`: also serve the OpenAI-compatible HTTP API there (0: any free port; None: not at all)."""
    telemetry = telemetry or Telemetry("pdserve-router")
    path = locate_model(model)  # the workers, started first, have built a built-in model into the cache
    tokenizer, model_config = Tokenizer(tokenizer_folder(path)), read_model_config(path)
    tracker = LoadTracker()
    policy_cls = SLOAwarePlacement if config.policy == "slo" else RoundRobinPlacement
    policy = policy_cls(registry, prefix_index, Predictor(config, tracker), tokenizer=tokenizer.digest)
    key_reload = _key_reload(config, host, port)
    keys = key_reload.table if key_reload else None
    quotas = _quotas(registry, config)
    lifecycle = RequestLifecycle(
        tokenizer, model_config, config, policy, prefix_index, tracker, telemetry, model, keys, quotas
    )
    servicer = GenerationServicer(lifecycle)
    tls = server_tls(config.tls_cert, config.tls_key, config.tls_client_ca)
    interceptors = telemetry.server_interceptors()
    server = Server(
        host,
        port,
        interceptors,
        reflection=config.reflection,
        tls=tls,
        advertise_host=advertise_host,
        max_connection_age_s=config.max_connection_age_s or None,
        checked_by_handler=[GENERATE_METHOD],  # counted as the caller's mistake with every other refusal
        inner=[ParseAfterKeyCheck([GENERATE_METHOD])],
        max_receive_message_bytes=max_grpc_request_bytes(config.request_limits, model_config),
    )
    server.add(
        lambda s: generate_pb2_grpc.add_GenerationServicer_to_server(servicer, s),
        [GENERATION_SERVICE],
    )
    admitted = ClusterAdmitted(registry, lifecycle.admitted)
    admin = AdminServicer(registry, lifecycle, admitted)
    server.add(
        lambda s: admin_pb2_grpc.add_AdminServicer_to_server(admin, s),
        [admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name],
    )
    # Asked before either listener starts: HTTP /health, unlike gRPC health, answers 200 from its start.
    peers = PeerCheck(registry)
    await peers.check()  # a router the workers refuse never reports SERVING, not even for a moment
    http = None
    if http_port is not None:
        age = config.max_connection_age_s or None
        stall = config.reader_stall_timeout_s
        http = HttpServer(
            openai_app(lifecycle, peers), host, http_port, tls, max_connection_age_s=age, write_stall_timeout_s=stall
        )
    await server.start()
    if http is not None:
        await http.start()
    admitted.start()
    if key_reload is not None:
        key_reload.start(lifecycle)
    predictor = policy.predictor
    gone: list[PerWorkerState] = [
        tracker,
        predictor.calibration,
        predictor.load_calibration,
        predictor.fixed_cost,
        predictor.best,
        lifecycle.recent,
        policy.offered,
    ]
    gone_workers = GoneWorkers(registry, gone)
    gone_workers.start()
    shared_claims = await _shared_claims(registry, config, predictor)
    shared_moving = None
    if isinstance(registry, RedisRegistry):  # the routers of one registry leave each other's moving streams a place
        shared_moving = SharedMoving(registry.url, tracker)
        await shared_moving.start()
    presence = WorkerPresence(policy)
    parts = (quotas, admitted, gone_workers, lifecycle.relay, shared_claims, shared_moving, key_reload, peers, presence)
    router = RouterServer(server, http, *parts, lifecycle.own_holds)
    await router.set_serving(True)
    peers.start()
    presence.start()
    lifecycle.own_holds.start()
    return router, lifecycle


async def _shared_claims(registry: Registry, config: RouterConfig, predictor: Predictor) -> SharedKVClaims | None:
    """The routers that share a Redis registry share their KV claims there; a lone router keeps its own."""
    if not (config.kv_claims and isinstance(registry, RedisRegistry)):
        return None
    shared = SharedKVClaims(registry.url, predictor.claims)
    await shared.start()
    return shared


def _quotas(registry: Registry, config: RouterConfig) -> Quotas:
    """The routers that share a Redis registry share their API keys' limits there; a lone router keeps its own."""
    if isinstance(registry, RedisRegistry):
        return RedisQuotas(registry.url, budget_s=config.quota_budget_s)
    return LocalQuotas()


def _key_reload(config: RouterConfig, host: str, port: int) -> KeyReload | None:
    """The API keys, kept as their file says, or None and a warning: without keys anyone who reaches the port is
    served, at any priority, and may call the Admin service (drain, scale)."""
    if config.api_keys_file:
        reload = KeyReload(config.api_keys_file)
        log.info("API keys required: %d keys from %s", len(reload.table), config.api_keys_file)
        return reload
    log.warning(
        "no --api-keys: this cluster is OPEN; anyone who can reach %s:%d may send requests at any priority, and "
        "drain or scale its workers (the Admin service)",
        host,
        port,
    )
    return None
