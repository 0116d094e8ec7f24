"""What a cluster process puts in its environment before Ray starts or any internal channel is made: the cluster
secret and the internal mTLS files. Workers inherit both (`env.worker_env`); every internal server and channel
reads them (`rpc/credentials.py`, `security/cluster_secret.py`)."""

from __future__ import annotations

import logging

from pdserve import env
from pdserve.config import ClusterConfig

log = logging.getLogger(__name__)


def prepare_internal_security(config: ClusterConfig, make_secret: bool) -> None:
    """`make_secret`: a local `pdserve up`, which starts every process of its cluster, makes a fresh secret when
    none is set. A controller, a router apart, or `up` joined to a Ray cluster (whose detached workers outlive it)
    must share one set by the operator (the chart's Secret): each making its own would refuse the other's calls,
    so they only warn when it is missing."""
    if make_secret:
        env.ensure_cluster_secret()
    elif not env.cluster_secret():
        log.warning(
            "PDSERVE_CLUSTER_SECRET is not set: workers take internal RPCs from anyone who can reach them; "
            "set the same secret on the controller, every router and every worker node"
        )
    c = config
    if c.internal_tls_cert and c.internal_tls_key and c.internal_tls_ca:
        env.export_internal_tls(c.internal_tls_cert, c.internal_tls_key, c.internal_tls_ca, c.internal_tls_server_name)
