"""Assembles the router: tokenizer and model config (read from metadata, torch-free), placement, the service."""

from __future__ import annotations

from pdserve.config import RouterConfig
from pdserve.engine.model_files import locate_model, read_model_config, tokenizer_folder
from pdserve.engine.tokenizer import Tokenizer
from pdserve.registry.base import PrefixIndex, Registry
from pdserve.rpc.server import Server
from pdserve.telemetry import Telemetry
from pdserve.v1 import admin_pb2, admin_pb2_grpc, generate_pb2, generate_pb2_grpc
from services.router.admin import AdminServicer
from services.router.lifecycle import RequestLifecycle
from services.router.load_tracker import LoadTracker
from services.router.placement import RoundRobinPlacement, SLOAwarePlacement
from services.router.predictor import Predictor
from services.router.servicer import GenerationServicer


async def start_router(
    model: str,
    registry: Registry,
    prefix_index: PrefixIndex,
    config: RouterConfig,
    host: str,
    port: int,
    telemetry: Telemetry | None = None,
    advertise_host: str | None = None,
) -> tuple[Server, RequestLifecycle]:
    """The serving router and its request lifecycle (whose `draining` flag and `in_flight` count drive a drain)."""
    telemetry = telemetry or Telemetry("pdserve-router")
    path = locate_model(model)  # the workers, started first, have built a built-in model into the cache
    tokenizer, model_config = Tokenizer(tokenizer_folder(path)), read_model_config(path)
    tracker = LoadTracker()
    policy_cls = SLOAwarePlacement if config.policy == "slo" else RoundRobinPlacement
    policy = policy_cls(registry, prefix_index, Predictor(config, tracker))
    lifecycle = RequestLifecycle(tokenizer, model_config, config, policy, prefix_index, tracker, telemetry)
    servicer = GenerationServicer(lifecycle)
    server = Server(host, port, telemetry.server_interceptors(), advertise_host)
    server.add(
        lambda s: generate_pb2_grpc.add_GenerationServicer_to_server(servicer, s),
        [generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name],
    )
    admin = AdminServicer(registry, lifecycle)
    server.add(
        lambda s: admin_pb2_grpc.add_AdminServicer_to_server(admin, s),
        [admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name],
    )
    await server.start()
    await server.set_serving(True)
    return server, lifecycle
