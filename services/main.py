"""The `pdserve` command: pdserve's CLI with the services wired in. This is where the services meet the cluster
machinery (src/pdserve never imports them): `pdserve up` hands these factories to the launcher."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from pdserve import cli
from pdserve.cluster.factories import ClusterServices
from services.router.server import start_router
from services.workers import add_worker_services

SERVICES = ClusterServices(workers=add_worker_services, router=start_router)


def main(argv: Sequence[str] | None = None) -> int:
    return cli.main(argv, SERVICES)


if __name__ == "__main__":
    sys.exit(main())
