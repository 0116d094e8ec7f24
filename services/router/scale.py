"""`pdserve scale --addr` as the router answers it: the counts asked for, checked against the cluster's shape,
become the registry's desired counts, which the fleet (in `pdserve up`, or a `pdserve controller` reading Redis)
starts or drains workers to match. The router only records the wish: starting a worker takes far longer than an
RPC should, and the fleet may be another process."""

from __future__ import annotations

from pdserve.cluster.scaling import SCALE_CHECK_S
from pdserve.config import MAX_WORKERS_PER_ROLE
from pdserve.errors import InvalidRequestError, OverloadedError
from pdserve.protocol.roles import Role, mode_roles, other_mode_role


def scale_target(asked: dict[Role, int], current: dict[Role, int], registered: set[Role]) -> dict[Role, int]:
    """The desired counts once `asked` is applied (a count of 0 is one not given: its role keeps its current count),
    or InvalidRequestError naming the field. The cluster's mode comes from its desired counts, else from the
    workers registered, else from what is asked: a colocated cluster takes `colocated` alone, a disaggregated one
    `prefill` and `decode`, each at least 1. With no counts recorded while workers serve (a Redis restarted empty),
    a role not given has no count to keep until the fleet writes its counts back (within SCALE_CHECK_S):
    OverloadedError, whose retry hint says when to ask again."""
    known = set(current) or registered
    colocated = Role.COLOCATED in known if known else bool(asked.get(Role.COLOCATED))
    wanted = mode_roles(colocated)
    if refused := other_mode_role(asked, colocated):
        raise InvalidRequestError(*refused)
    target = {role: asked.get(role, 0) or current.get(role, 0) for role in wanted}
    if not current and registered and not all(target.values()):
        raise OverloadedError(
            "the registry holds no desired worker counts (a Redis restarted empty?) until the fleet writes them back; "
            "retry, or give every role's count",
            retry_after_ms=round(2 * SCALE_CHECK_S * 1000),
        )
    for role, n in target.items():
        if not 1 <= n <= MAX_WORKERS_PER_ROLE:
            raise InvalidRequestError(str(role), f"must be 1 to {MAX_WORKERS_PER_ROLE}, got {n}")
    return target
