"""What `pdserve scale --addr` may ask of a cluster: counts in range for the roles of its mode, else INVALID_ARGUMENT
naming the field; while the registry lost its counts, a role not given is asked again later (RESOURCE_EXHAUSTED)."""

from __future__ import annotations

import pytest

from pdserve.config import MAX_WORKERS_PER_ROLE
from pdserve.errors import InvalidRequestError, OverloadedError
from pdserve.protocol.roles import Role
from services.router.scale import scale_target

P, D, C = Role.PREFILL, Role.DECODE, Role.COLOCATED
SPLIT = {P: 1, D: 1}


def asked(prefill: int = 0, decode: int = 0, colocated: int = 0) -> dict[Role, int]:
    return {P: prefill, D: decode, C: colocated}


def test_a_disaggregated_cluster_takes_both_counts_or_keeps_the_one_not_given() -> None:
    assert scale_target(asked(2, 3), SPLIT, {P, D}) == {P: 2, D: 3}
    assert scale_target(asked(1, 1), SPLIT, set()) == {P: 1, D: 1}
    assert scale_target(asked(decode=4), {P: 2, D: 1}, {P, D}) == {P: 2, D: 4}


def test_a_colocated_cluster_takes_its_one_count() -> None:
    assert scale_target(asked(colocated=3), {C: 2}, {C}) == {C: 3}


def test_the_mode_comes_from_the_workers_when_no_counts_were_recorded() -> None:
    assert scale_target(asked(colocated=2), {}, {C}) == {C: 2}
    assert scale_target(asked(colocated=2), {}, set()) == {C: 2}  # nothing known: what is asked
    with pytest.raises(InvalidRequestError) as e:
        scale_target(asked(colocated=2), {}, {P, D})
    assert e.value.field == "colocated"


@pytest.mark.parametrize(
    ("request_counts", "current", "field"),
    [
        (asked(0, 2), {D: 1}, "prefill"),  # none given, none recorded: a role without workers fails every request
        (asked(2, 0), {P: 1}, "decode"),
        (asked(2, MAX_WORKERS_PER_ROLE + 1), SPLIT, "decode"),
        (asked(1, 1, 2), SPLIT, "colocated"),  # a role this mode does not run
        (asked(1, 0, 2), {C: 2}, "prefill"),
        (asked(colocated=MAX_WORKERS_PER_ROLE + 1), {C: 2}, "colocated"),
    ],
)
def test_bad_counts_are_invalid_argument_naming_the_field(
    request_counts: dict[Role, int], current: dict[Role, int], field: str
) -> None:
    with pytest.raises(InvalidRequestError) as e:
        scale_target(request_counts, current, set(current))
    assert e.value.field == field


def test_while_the_registry_lost_its_counts_a_role_not_given_is_asked_again_later() -> None:
    """A Redis restarted empty: the fleet writes its counts back within a second or two. Refused as a count of 0
    before (INVALID_ARGUMENT: never retry), though a retry then succeeds."""
    with pytest.raises(OverloadedError) as e:
        scale_target(asked(prefill=3), {}, {P, D})
    assert e.value.retry_after_ms == 2000 and "retry, or give every role's count" in str(e.value)
    assert scale_target(asked(3, 2), {}, {P, D}) == {P: 3, D: 2}  # every role given: nothing to keep
