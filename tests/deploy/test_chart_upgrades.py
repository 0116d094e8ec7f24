"""What an upgrade does to a running fleet: each group's live replicas kept unless the values changed them, and a
new build (the image, or what the worker pods are made of) on every pdserve pod the controller compares."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from pdserve.build import build_resource
from tests.deploy.chart import CHART, helm, one, pod_templates, render, render_helper, worker_groups
from tests.deploy.test_chart_validates import check_raycluster

PROBE = """{{- $v := dict "replicas" 2 "minReplicas" 1 "maxReplicas" 8 }}
{{- $five := dict "replicas" 5 }}
apiVersion: v1
kind: ConfigMap
metadata: {name: replicas-probe}
data:
  install: {{ include "pdserve.workerReplicas" (dict "live" "" "values" $v) | quote }}
  scaled: {{ include "pdserve.workerReplicas" (dict "live" (dict "replicas" 5) "values" $v) | quote }}
  past-max: {{ include "pdserve.workerReplicas" (dict "live" (dict "replicas" 12) "values" $v) | quote }}
  below-min: {{ include "pdserve.workerReplicas" (dict "live" (dict "replicas" 0) "values" $v) | quote }}
  values-kept: {{ include "pdserve.workerReplicas" (dict "live" $five "values" $v "rendered" 2.0) | quote }}
  values-changed: {{ include "pdserve.workerReplicas" (dict "live" $five "values" $v "rendered" 1.0) | quote }}
"""


def test_an_upgrade_renders_each_groups_live_replicas_within_the_releases_bounds(tmp_path: Path) -> None:
    """The Ray autoscaler and `pdserve scale --kubernetes` move a group's replicas after install; an upgrade
    rendering the install-time count would put it back (KubeRay's workerGroupSpecs is one atomic field). But an
    upgrade whose values' count is not the one the live object was rendered from (its annotation) applies it, as
    the controller applies changed counts: else its workers would wait for pods that never come. The chart looks
    the live RayCluster up; `helm template` has no cluster, so a probe chart (this one as its subchart) hands the
    helper the live group an upgrade would find."""
    probe = tmp_path / "probe"
    shutil.copytree(CHART, probe / "charts" / "pdserve")
    (probe / "Chart.yaml").write_text("apiVersion: v2\nname: probe\nversion: 0.0.1\n")
    (probe / "templates").mkdir()
    (probe / "templates" / "probe.yaml").write_text(PROBE)
    out = helm("template", "pd", str(probe))
    assert out.returncode == 0, out.stderr
    objects = [d for d in yaml.safe_load_all(out.stdout) if d]
    probed = next(o for o in objects if o["metadata"]["name"] == "replicas-probe")["data"]
    assert probed == {
        **{"install": "2", "scaled": "5", "past-max": "8", "below-min": "1"},
        **{"values-kept": "5", "values-changed": "2"},
    }
    assert [g["replicas"] for g in worker_groups(objects).values()] == [1, 1]  # no live object: the values'
    (rc,) = [o for o in objects if o["kind"] == "RayCluster"]
    assert json.loads(rc["metadata"]["annotations"]["pdserve.io/values-replicas"]) == {"prefill": 1, "decode": 1}


def probe_version_guard(tmp_path: Path, running: str | None, strategy: str) -> subprocess.CompletedProcess[str]:
    """The chart's Ray version guard, as an upgrade over a RayCluster whose spec says `running` would call it (None:
    an install), through a probe chart: `helm template` has no live object to look up."""
    probe = tmp_path / "probe"
    shutil.copytree(CHART, probe / "charts" / "pdserve")
    (probe / "Chart.yaml").write_text("apiVersion: v2\nname: probe\nversion: 0.0.1\n")
    (probe / "templates").mkdir()
    live = "" if running is None else f'(dict "rayVersion" "{running}")'
    values = f'(dict "ray" (dict "version" "2.60.0" "upgradeStrategy" "{strategy}"))'
    guard = f'{{{{ include "pdserve.rayVersionGuard" (dict "live" {live or "nil"} "values" {values}) }}}}'
    (probe / "templates" / "probe.yaml").write_text(f"# {guard}\n")
    return helm("template", "pd", str(probe))


@pytest.mark.parametrize(
    ("running", "strategy", "refused"),
    [
        ("2.59.0", "", True),  # a new Ray over a head KubeRay will not replace: refused
        ("2.59.0", "Recreate", False),  # KubeRay replaces every pod of the cluster
        ("2.60.0", "", False),
        (None, "", False),  # an install, or `helm template`
    ],
)
def test_an_upgrade_that_changes_the_ray_version_is_refused_unless_kuberay_recreates_the_cluster(
    tmp_path: Path, running: str | None, strategy: str, refused: bool
) -> None:
    out = probe_version_guard(tmp_path, running, strategy)
    assert (out.returncode != 0) == refused, out.stderr
    if refused:
        assert "runs Ray 2.59.0" in out.stderr and "ray.upgradeStrategy=Recreate" in out.stderr


def probe_token_guard(tmp_path: Path, guard: str, live: dict[str, object] | None) -> str | None:
    """The chart's Ray token guard called as `guard` (a template call) through a probe chart whose `.Values.live` is
    `live` (a RayCluster's spec, as an upgrade's lookup finds it; None: an install): `helm template` has nothing live
    to look up. None when it renders, else helm's error."""
    probe = tmp_path / "probe"
    shutil.copytree(CHART, probe / "charts" / "pdserve")
    (probe / "Chart.yaml").write_text("apiVersion: v2\nname: probe\nversion: 0.0.1\n")
    (probe / "values.yaml").write_text(json.dumps({"live": live}))
    (probe / "templates").mkdir()
    (probe / "templates" / "probe.yaml").write_text(f"# {{{{ {guard} }}}}\n")
    out = helm("template", "pd", str(probe))
    return None if out.returncode == 0 else out.stderr


@pytest.mark.parametrize(
    ("enabled", "secret", "strategy", "refused"),
    [
        (True, "pd-pdserve-ray-token", "", None),  # the generated Secret, kept across upgrades
        (True, "pd-ray-token", "", "the token in Secret pd-ray-token, and the running head's env names pd-pdserve"),
        (False, "", "", "RAY_AUTH_MODE=disabled, and the running head has token"),
        (True, "pd-ray-token", "Recreate", None),  # KubeRay replaces the head too
    ],
)
def test_an_upgrade_that_changes_the_ray_token_is_refused_unless_kuberay_recreates_the_cluster(
    tmp_path: Path, enabled: bool, secret: str, strategy: str, refused: str | None
) -> None:
    """KubeRay keeps the running head pod, and with it the token it started with and the Secret its env names: the
    controller and new worker pods presenting another token (a Secret switched to, as GitOps users are told to set,
    or auth turned off) would be refused, the controller restarting for good, and the head's container could not
    start again once Helm deleted the Secret; so the upgrade is refused as a Ray version change is."""
    live = one(render(), "RayCluster")["spec"]
    values = f'(dict "ray" (dict "authToken" (dict "enabled" {str(enabled).lower()}) "upgradeStrategy" "{strategy}"))'
    guard = f'include "pdserve.rayTokenGuard" (dict "live" .Values.live "values" {values} "secret" "{secret}")'
    error = probe_token_guard(tmp_path, guard, live)
    assert (error is None) if refused is None else (error is not None and refused in error), error
    if refused:
        assert "ray.upgradeStrategy=Recreate" in str(error)
    assert probe_token_guard(tmp_path / "install", guard, None) is None  # no RayCluster yet
    assert 'include "pdserve.rayTokenGuard"' in (CHART / "templates" / "raycluster.yaml").read_text()  # on upgrade


def test_the_recreate_strategy_is_rendered_as_kuberay_takes_it() -> None:
    rc = one(render(sets={"ray.upgradeStrategy": "Recreate"}), "RayCluster")
    assert rc["spec"]["upgradeStrategy"] == {"type": "Recreate"}
    check_raycluster(rc)
    assert "upgradeStrategy" not in one(render(), "RayCluster")["spec"]


def test_an_upgrade_to_a_new_image_is_a_new_build_on_every_pod_and_a_new_worker_resource() -> None:
    """The controller rolls adopted workers whose build is not its own: every pdserve container's PDSERVE_BUILD
    names its own image, and a new tag moves the worker groups' build resource, so that the new image's workers
    cannot land on the old image's pods."""
    (old_env, old_resources), (new_env, new_resources) = builds({"image.tag": "1.0.0"}), builds({"image.tag": "1.1.0"})
    assert set(old_env) == {"controller", "router", "prefill", "decode"}, old_env  # the head runs no pdserve
    router_image = old_env.pop("router")  # a router rolls no workers: its image alone
    assert router_image.endswith("pdserve:1.0.0") and new_env.pop("router") == router_image.replace("1.0.0", "1.1.0")
    (old_build,) = set(old_env.values())
    assert old_build.split()[0].endswith("pdserve:1.0.0")
    assert set(new_env.values()) == {old_build.replace("1.0.0", "1.1.0")}
    assert old_resources == {build_resource(old_build)} and len(new_resources) == 1 and new_resources != old_resources


@pytest.mark.parametrize(
    ("sets", "new_build"),
    [
        ({"clusterSecret.existingSecret": "pd-cluster-secret"}, True),  # what GitOps users are told to set
        ({"prefill.tolerations": []}, True),
        ({"otel.endpoint": "http://collector:4317"}, True),
        ({"drain.timeoutSeconds": 90}, True),
        ({"router.port": 50052}, True),  # the preStop's drain calls the router there
        ({"tmp.sizeLimit": "16Gi"}, True),  # the /tmp emptyDir Ray's session files and logs fill
        ({"prefill.replicas": 3, "decode.maxReplicas": 9}, False),  # counts change no pod
        ({"router.replicas": 3, "redis.resources.limits.memory": "1Gi"}, False),  # nothing a worker pod holds
        ({"engine.kvCacheGb": 4, "bindAddress": "::"}, False),  # the controller's flags: workers restart in place
        ({"ray.authToken.allowUnauthenticated": True}, False),  # an opt-in the chart checks, in no pod
    ],
)
def test_a_change_to_what_worker_pods_are_made_of_is_a_new_build(sets: dict[str, object], new_build: bool) -> None:
    """KubeRay never recreates a running pod for a changed template: a worker pod change the fleet must get (a
    Secret switched to an existing one, tolerations, OTel, the drain's grace) is a new build, which the controller
    rolls onto new pods as it does a new image; a change of counts, or of what no worker pod holds, is not."""
    (before_env, before_resources), (after_env, after_resources) = builds({}), builds(sets)
    assert (after_env != before_env) is new_build and (after_resources != before_resources) is new_build
    assert after_env["router"] == before_env["router"]  # the router is not restarted for the workers' pods


def builds(sets: dict[str, object]) -> tuple[dict[str, str], set[str]]:
    """Each pdserve component's PDSERVE_BUILD, and the worker groups' build resources, as the chart renders them."""
    objects = render(["gpu.yaml"], sets)
    env: dict[str, str] = {}
    for component, template in pod_templates(objects).items():
        for c in template["spec"]["containers"]:
            values = [e["value"] for e in c.get("env", []) if e["name"] == "PDSERVE_BUILD"]
            if values and component != "smoke-test":  # not the `helm test` client: it serves nothing
                env[component] = values[0]
    words = [shlex.split(g["rayStartParams"]["resources"])[0] for g in worker_groups(objects).values()]
    return env, {k for w in words for k in json.loads(w) if k.startswith("pdserve_build_")}


def head_image_note(tmp_path: Path, head_image: str | None, strategy: str = "") -> str:
    """The chart's note on the running head's image, as an upgrade whose namespace has a head pod of the release
    running `head_image` would render it (None: no such pod, as on install or under `helm template`), beside
    another release's head and a worker pod, through a probe chart: `helm template` has no live pods to look up."""

    def pod(cluster: str, node_type: str, image: str) -> str:
        labels = f'(dict "ray.io/cluster" "{cluster}" "ray.io/node-type" "{node_type}")'
        containers = f'(list (dict "name" "ray-head" "image" "{image}"))'
        return f'(dict "metadata" (dict "labels" {labels}) "spec" (dict "containers" {containers}))'

    pods = [pod("other-pdserve", "head", "elsewhere:9"), pod("pd-pdserve", "worker", "worker:1")]
    if head_image is not None:
        pods.append(pod("pd-pdserve", "head", head_image))
    args = f'(dict "pods" (list {" ".join(pods)}) "cluster" "pd-pdserve" "image" "r/pdserve:2" "strategy" "{strategy}")'
    return render_helper(tmp_path, f'include "pdserve.headImageNote" {args}')


def test_an_upgrade_to_an_image_the_running_head_does_not_run_warns_in_its_notes(tmp_path: Path) -> None:
    """KubeRay keeps the head pod's image; the controller (Ray Client) and new worker pods run the new one, and the
    head unpickles the controller's objects with its own pdserve: the notes say so and name the way out."""
    note = head_image_note(tmp_path, "r/pdserve:1")
    assert note.startswith("The Ray head still runs r/pdserve:1:") and "run r/pdserve:2" in note
    assert "Python minor version" in note and "--set ray.upgradeStrategy=Recreate" in note
    assert head_image_note(tmp_path, "r/pdserve:2") == ""  # the same image
    assert head_image_note(tmp_path, None) == ""  # an install: no head yet (not another release's)
    assert head_image_note(tmp_path, "r/pdserve:1", "Recreate") == ""  # KubeRay replaces the head too
    assert "lookup" in (CHART / "templates" / "NOTES.txt").read_text()  # the notes read the live pods
