"""The gRPC services each worker role runs, built from the worker's context (`WorkerRuntime` calls this).

Imported by every `pdserve` command (services/main.py): what needs torch is imported where a worker builds it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.cluster.factories import Closeable, WorkerContext
from pdserve.protocol.roles import Role
from pdserve.security.cluster_secret import ClusterSecret
from pdserve.v1 import worker_pb2, worker_pb2_grpc

if TYPE_CHECKING:
    from pdserve.transfer.torch_dist import TorchDistReceiver, TorchDistSender

_SERVICES = worker_pb2.DESCRIPTOR.services_by_name


def add_worker_services(ctx: WorkerContext) -> Closeable | None:
    """Adds the role's services to the worker's server; returns its KV transfer endpoint (closed at shutdown)."""
    if ctx.spec.role is Role.PREFILL:
        return _add_prefill(ctx)
    return _add_decode(ctx)


def _add_prefill(ctx: WorkerContext) -> TorchDistSender:
    from pdserve import env
    from pdserve.transfer.torch_dist import TorchDistSender
    from services.prefill.run_and_send import RunAndSend
    from services.prefill.servicer import PrefillServicer

    engine, spec = ctx.engine, ctx.spec
    secret = ClusterSecret.from_env().transfer_key
    sender = TorchDistSender(
        spec.advertise_host, device=engine.device, model_fingerprint=engine.fingerprint, secret=secret
    )
    run_and_send = RunAndSend(engine, sender, spec.worker_id, ctx.telemetry, ctx.metrics, env.fault_config())
    servicer = PrefillServicer(run_and_send)
    ctx.server.add(
        lambda s: worker_pb2_grpc.add_PrefillWorkerServicer_to_server(servicer, s),
        [_SERVICES["PrefillWorker"].full_name],
    )
    return sender


def _add_decode(ctx: WorkerContext) -> TorchDistReceiver | None:
    """A decode worker takes KV hand-offs; a colocated one prefills its requests itself."""
    from pdserve import env
    from pdserve.transfer.torch_dist import TorchDistReceiver
    from services.decode.handoff import Handoff
    from services.decode.prefill_client import PrefillClient
    from services.decode.servicer import DecodeServicer

    engine, spec, cluster = ctx.engine, ctx.spec, ClusterSecret.from_env()
    receiver, handoff = None, None
    if spec.role is Role.DECODE:
        receiver = TorchDistReceiver(
            spec.advertise_host,
            device=engine.device,
            model_fingerprint=engine.fingerprint,
            secret=cluster.transfer_key,
            bind_host=spec.host,
            store_port=spec.transfer_port,
        )
        prefill = PrefillClient(ctx.telemetry)
        timeout_s = spec.kv_transfer_timeout_s
        handoff = Handoff(engine, receiver, prefill, spec.worker_id, ctx.telemetry, timeout_s, ctx.metrics)
    servicer = DecodeServicer(engine, handoff, spec.worker_id, spec.role, ctx.telemetry, env.fault_config(), cluster)
    ctx.server.add(
        lambda s: worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, s),
        [_SERVICES["DecodeWorker"].full_name],
    )
    return receiver
