"""The fleet built from a command line: what its worker specs carry, which desired counts it starts from, and that a
worker that cannot start is left to the supervisor rather than ending a controller."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from ray.exceptions import AuthenticationError

from pdserve import cli
from pdserve.build import build_resource, current_build
from pdserve.cluster.actors import BUILD_RESOURCE_SHARE
from pdserve.cluster.launcher import Cluster
from pdserve.cluster.ray_join_check import TokenRefused
from pdserve.cluster.supervisor import REPLACE_BACKOFF_S, Slot
from pdserve.config import ClusterConfig, EngineConfig
from pdserve.protocol.roles import Role
from pdserve.registry.base import WorkerState
from pdserve.registry.memory import InMemoryRegistry


def test_the_sigterm_drain_timeout_reaches_every_worker_spec() -> None:
    argv = ["controller", "--ray-address", "auto", "--redis", "redis://r:6379/0", "--worker-drain-timeout-s", "120"]
    config = cli._cluster_config(cli._parser().parse_args(argv))
    cluster = Cluster(config, workers=lambda context: None, registry=InMemoryRegistry(), publish=False)
    assert [s.drain_timeout_s for s in cluster.specs()] == [120.0, 120.0]


def test_the_speed_recheck_timings_reach_every_worker_spec() -> None:
    argv = ["up", "--speed-recheck-s", "0", "--speed-recheck-idle-s", "2"]
    config = cli._cluster_config(cli._parser().parse_args(argv))
    cluster = Cluster(config, workers=lambda context: None, registry=InMemoryRegistry(), publish=False)
    assert [(s.speed_recheck_s, s.speed_recheck_idle_s) for s in cluster.specs()] == [(0.0, 2.0)] * 2


@pytest.mark.parametrize(
    ("flags_before", "live", "flags_now", "desired"),
    [
        ((1, 1), (3, 2), (1, 1), (3, 2)),  # restarted with the same flags: the live scale stays
        ((1, 1), (3, 2), (2, 4), (2, 4)),  # a new revision's flags apply
        (None, None, (2, 1), (2, 1)),  # a first start
    ],
)
def test_a_joined_fleet_keeps_a_live_scale_unless_its_flags_changed(flags_before, live, flags_now, desired) -> None:
    registry = InMemoryRegistry()
    if flags_before:
        registry.set_desired_counts(dict(zip((Role.PREFILL, Role.DECODE), flags_before, strict=True)), from_flags=True)
        registry.set_desired_counts(dict(zip((Role.PREFILL, Role.DECODE), live, strict=True)))  # pdserve scale
    argv = ["controller", "--ray-address", "auto", "--redis", "redis://r:6379/0"]
    argv += ["--prefill", str(flags_now[0]), "--decode", str(flags_now[1])]
    cluster = Cluster(cli._cluster_config(cli._parser().parse_args(argv)), lambda context: None, registry, False)
    cluster._init_desired_counts()
    assert registry.desired_counts() == {Role.PREFILL: desired[0], Role.DECODE: desired[1]}
    assert registry.flag_counts() == {Role.PREFILL: flags_now[0], Role.DECODE: flags_now[1]}


@pytest.mark.parametrize(
    ("found", "starting"),
    [
        ([], ["prefill-0", "decode-1"]),  # a first start: the flags' ids
        (["decode-1", "prefill-0"], ["decode-1", "prefill-0"]),  # a restarted controller: the same workers
        (["decode-3", "prefill-2"], ["decode-3", "prefill-2"]),  # after a rollout surged both: not new ones
        (["decode-4", "decode-5", "prefill-0"], ["decode-4", "decode-5", "prefill-0"]),  # scaled: all adopted
        (["decode-3"], ["decode-3", "prefill-0"]),  # the prefill worker is gone: the flags' one starts
    ],
)
def test_a_restarted_fleet_adopts_every_worker_of_its_roles_whatever_its_id(found, starting) -> None:
    argv = ["controller", "--ray-address", "auto", "--redis", "redis://r:6379/0"]
    cluster = Cluster(
        cli._cluster_config(cli._parser().parse_args(argv)), lambda context: None, InMemoryRegistry(), False
    )
    assert [s.worker_id for s in cluster.starting_specs(found)] == starting
    assert all(s.role == Role(s.worker_id.rpartition("-")[0]) for s in cluster.starting_specs(found))


@pytest.mark.parametrize(
    ("found", "starting"),
    [
        (["decode-2", "prefill-0"], ["decode-2", "prefill-0"]),  # the scale's workers: none of the flags' added
        (["decode-2"], ["decode-2", "prefill-0"]),  # its prefill worker is gone: one starts, not the flags' two
        ([], ["prefill-0", "decode-2"]),
    ],
)
def test_a_fleet_restarted_after_a_scale_down_starts_no_more_than_the_kept_counts(found, starting) -> None:
    """`--prefill 2 --decode 2`, then `pdserve scale --prefill 1 --decode 1`, then the controller restarts."""
    registry = InMemoryRegistry()
    registry.set_desired_counts({Role.PREFILL: 2, Role.DECODE: 2}, from_flags=True)
    registry.set_desired_counts({Role.PREFILL: 1, Role.DECODE: 1})
    argv = ["controller", "--ray-address", "auto", "--redis", "redis://r:6379/0", "--prefill", "2", "--decode", "2"]
    cluster = Cluster(cli._cluster_config(cli._parser().parse_args(argv)), lambda context: None, registry, False)
    cluster._init_desired_counts()
    assert [s.worker_id for s in cluster.starting_specs(found)] == starting


def test_a_restarted_fleet_adopts_the_other_modes_workers_to_drain_them_away() -> None:
    argv = ["controller", "--ray-address", "auto", "--redis", "redis://r:6379/0"]  # disaggregated, 1P:1D
    cluster = Cluster(cli._cluster_config(cli._parser().parse_args(argv)), lambda c: None, InMemoryRegistry(), False)
    cluster.actors.connect = lambda: None
    cluster.actors.found_worker_ids = lambda: ["colocated-0", "colocated-1"]  # a colocated fleet's, left serving
    cluster.actors.get_or_create = lambda spec: (object(), spec.role is Role.COLOCATED)
    cluster._await_start = lambda slot: WorkerState(slot.spec.worker_id, slot.spec.role, f"{slot.spec.worker_id}:1")
    cluster.start_workers()
    slots = cluster.supervisor.slots
    assert sorted(slots) == ["colocated-0", "colocated-1", "decode-1", "prefill-0"]
    assert [w for w, s in sorted(slots.items()) if s.leaving] == ["colocated-0", "colocated-1"]


def test_a_negative_surge_wait_is_refused_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["controller", "--ray-address", "auto", "--redis", "redis://r:6379/0", "--rollout-surge-wait-s", "-1"]
    with pytest.raises(SystemExit) as exit_:
        cli._parser().parse_args(argv)
    assert exit_.value.code == 2 and "argument --rollout-surge-wait-s: must lie in [0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="rollout_surge_wait_s must be >= 0"):  # and a config built in code
        ClusterConfig(rollout_surge_wait_s=-1)


def test_a_fleets_workers_ask_for_its_build_and_with_build_resources_for_nodes_of_it() -> None:
    argv = ["controller", "--ray-address", "auto", "--redis", "redis://r:6379/0", "--role-resources"]
    config = cli._cluster_config(cli._parser().parse_args([*argv, "--build-resources"]))
    cluster = Cluster(config, workers=lambda context: None, registry=InMemoryRegistry(), publish=False)
    spec = cluster.specs()[0]
    assert spec.build == current_build()
    resources = cluster.actors.actor_options(spec)["resources"]
    assert resources == {"pdserve_prefill": 1, build_resource(current_build()): BUILD_RESOURCE_SHARE}
    assert 0 < BUILD_RESOURCE_SHARE < 0.01  # a label: many workers of one build fit a node's one unit
    plain = Cluster(cli._cluster_config(cli._parser().parse_args(argv)), lambda c: None, InMemoryRegistry(), False)
    assert plain.actors.actor_options(spec)["resources"] == {"pdserve_prefill": 1}


def test_a_controller_whose_worker_cannot_start_goes_on_and_leaves_it_to_the_supervisor() -> None:
    argv = ["controller", "--ray-address", "auto", "--redis", "redis://r:6379/0", "--decode", "2"]
    registry = InMemoryRegistry()
    cluster = Cluster(cli._cluster_config(cli._parser().parse_args(argv)), lambda context: None, registry, False)
    cluster.actors.connect = lambda: None
    cluster.actors.found_worker_ids = lambda: ["decode-1", "decode-2", "prefill-0"]  # a restarted controller
    cluster.actors.get_or_create = lambda spec: (object(), True)

    def await_start(slot: Slot) -> WorkerState:
        if slot.spec.worker_id == "decode-2":
            raise RuntimeError("worker decode-2 failed to start 4 times: no such model")
        return WorkerState(slot.spec.worker_id, slot.spec.role, f"{slot.spec.worker_id}:1")

    cluster._await_start = await_start
    cluster.start_workers()
    assert sorted(w.worker_id for w in registry.workers()) == ["decode-1", "prefill-0"]
    failed = cluster.supervisor.slots["decode-2"]
    assert not failed.listed and failed.backoff_s == REPLACE_BACKOFF_S[0]  # replaced as one that never served
    cluster.supervisor.slots.clear()
    with pytest.raises(RuntimeError, match="decode-2 failed to start"):
        cluster.start_workers(fail_fast=True)  # `pdserve up`: its user waits on the start


def test_a_worker_no_node_can_host_fails_its_start_at_the_timeout_instead_of_waiting_forever(monkeypatch) -> None:
    """Ray leaves an actor no node can host pending for good; the wait for it is bounded, so a controller goes on
    (the supervisor retries it) and a scaler's start thread ends."""
    import ray
    from ray.exceptions import GetTimeoutError

    timeouts: list[float | None] = []

    def pending_forever(ref: object, timeout: float | None = None) -> object:
        timeouts.append(timeout)
        raise GetTimeoutError("the actor is pending placement")

    monkeypatch.setattr(ray, "get", pending_forever)
    argv = ["controller", "--ray-address", "auto", "--redis", "redis://r:6379/0"]
    cluster = Cluster(cli._cluster_config(cli._parser().parse_args(argv)), lambda c: None, InMemoryRegistry(), False)
    actor = SimpleNamespace(wait_ready=SimpleNamespace(remote=lambda: "ref"))
    with pytest.raises(RuntimeError, match="prefill-0 did not serve within 0.5 s"):
        cluster._await_start(Slot(cluster.specs()[0], actor), timeout_s=0.5)
    assert timeouts and all(t is not None and t <= 0.5 for t in timeouts)


def test_supervision_that_fails_ends_the_wait_with_its_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug in the supervisor must not leave the process serving on unsupervised, looking healthy."""
    argv = ["controller", "--ray-address", "auto", "--redis", "redis://r:6379/0"]
    cluster = Cluster(
        cli._cluster_config(cli._parser().parse_args(argv)), lambda context: None, InMemoryRegistry(), False
    )

    async def broken() -> None:
        raise KeyError("a bug in supervision")

    monkeypatch.setattr(cluster, "watch", broken)
    monkeypatch.setattr(cluster.actors, "connected", lambda: True)  # its link to Ray holds

    async def supervise() -> bool:
        return await asyncio.wait_for(cluster.supervise_until(asyncio.Event()), 10)

    with pytest.raises(KeyError, match="a bug in supervision"):
        asyncio.run(supervise())


@pytest.mark.parametrize(
    ("error", "tried"),
    [
        (ConnectionAbortedError("Initialization failure from server:\npsutil.ZombieProcess: ..."), 2),
        (ConnectionAbortedError("Initialization failure from server:\nStarting Ray client server failed."), 2),
        (ConnectionRefusedError("nothing listens"), 1),  # a first join that fails otherwise fails at once
    ],
)
def test_a_ray_client_server_that_failed_to_start_its_own_server_is_tried_again(monkeypatch, error, tried) -> None:
    """Ray's client proxier sometimes fails to start the server of one client (the process it started reads as a
    zombie, or exits at once): `pdserve up --ray-address` exited on that, though the next try gets another server.
    Ray's error goes through `WorkerActors.connect`, which words it as a join failure of ours."""
    assert _tries_to_join(monkeypatch, error, retry_join=False) == tried


@pytest.mark.parametrize(
    ("error", "tried"),
    [
        (ValueError("Invalid address format: not-an-address"), 1),
        (AuthenticationError("Token authentication is enabled but Ray couldn't find an authentication token."), 1),
        (TokenRefused("Ray refused the auth token (its Ray Client server answered UNAUTHENTICATED: ...)"), 1),
        (ConnectionError("ray client connection timeout"), 2),  # a head that does not answer (yet)
        (ConnectionRefusedError("nothing listens"), 2),
    ],
)
def test_a_controllers_join_that_ray_refused_as_asked_fails_at_once(monkeypatch, error, tried) -> None:
    """A controller tries a Ray that does not answer again for 5 minutes; an address Ray cannot parse, or no auth
    token where the cluster wants one, was tried for those 5 minutes too once `WorkerActors.connect` worded every
    join failure as a ConnectionError of ours, though no later try differs; so was a token the head refuses
    (`ray_join_check`), which Ray Client reads as a head that does not answer."""
    assert _tries_to_join(monkeypatch, error, retry_join=True) == tried


def test_a_rejoin_that_ray_refuses_as_asked_ends_rather_than_trying_again_at_once(monkeypatch) -> None:
    """A rejoin tries a Ray that does not answer again for as long as it takes; one that Ray refused as asked would
    have been tried again at once, in a loop with no pause."""
    tries = _tries_to_join(monkeypatch, ValueError("Invalid address format: x"), retry_join=True, rejoin=True)
    assert tries == 1


def _tries_to_join(monkeypatch: pytest.MonkeyPatch, error: Exception, retry_join: bool, rejoin: bool = False) -> int:
    """How many times `connect_until` (or `rejoin`) called `ray.init`, whose first call raised `error`; a join that
    fails is expected to raise our own wording of it."""
    config = ClusterConfig(engine=EngineConfig(device="cpu"), ray_address="ray://127.0.0.1:10001")
    cluster = Cluster(config, workers=lambda context: None, registry=InMemoryRegistry(), publish=False)
    tries: list[int] = []

    def ray_init(**kwargs) -> None:
        tries.append(1)
        if len(tries) == 1:
            raise error

    monkeypatch.setattr("ray.is_initialized", lambda: False)
    monkeypatch.setattr("ray.init", ray_init)
    monkeypatch.setattr("pdserve.cluster.actors._check_listening", lambda address: None)
    monkeypatch.setattr("pdserve.cluster.actors.check_join", lambda address: "")
    monkeypatch.setattr("pdserve.cluster.actors._log_ray_auth", lambda: None)
    monkeypatch.setattr("pdserve.cluster.launcher.JOIN_RETRY_S", 0.01)
    monkeypatch.setattr(cluster, "start_until", _started)
    joining = cluster.rejoin(asyncio.Event()) if rejoin else cluster.connect_until(asyncio.Event(), retry_join)
    try:
        assert asyncio.run(asyncio.wait_for(joining, 10))
    except ConnectionError as e:
        assert str(e).startswith("could not join the Ray cluster at --ray-address ray://")
    return len(tries)


async def _started(stop: asyncio.Event, end: object) -> bool:
    return True  # a rejoin's start of the workers, which these tests leave out
