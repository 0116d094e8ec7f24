"""Every container of the chart on a read-only root filesystem, writing only to its volumes."""

from __future__ import annotations

from tests.deploy.chart import Objects, one, pod_templates


def test_every_container_runs_on_a_read_only_root_with_a_writable_tmp(rendered: dict[str, Objects]) -> None:
    """Policies such as Kyverno's require-ro-rootfs refuse a container whose root filesystem is writable. Each pdserve
    container (init ones and the Ray autoscaler's too) writes to its emptyDir at /tmp instead, HOME pointing there;
    Redis writes only to its data volume. A pdserve up on a read-only root with a tmpfs at /tmp served requests."""
    for values, objects in rendered.items():
        templates = pod_templates(objects)
        for component, template in templates.items():
            spec = template["spec"]
            volumes = {v["name"]: v for v in spec.get("volumes", [])}
            for c in [*spec.get("initContainers", []), *spec["containers"]]:
                where = (values, component, c["name"])
                assert c["securityContext"]["readOnlyRootFilesystem"] is True, where
                if component == "redis":
                    assert [m["mountPath"] for m in c["volumeMounts"]] == ["/data"], where
                    continue
                (tmp,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/tmp"]
                assert "emptyDir" in volumes[tmp["name"]], where
                assert {"name": "HOME", "value": "/tmp"} in c["env"], where
        autoscaler = one(objects, "RayCluster")["spec"].get("autoscalerOptions")
        if autoscaler is not None:  # a sidecar KubeRay adds to the head pod: the head's /tmp
            assert autoscaler["securityContext"]["readOnlyRootFilesystem"] is True
            (tmp,) = autoscaler["volumeMounts"]
            head_volumes = {v["name"]: v for v in templates["ray-head"]["spec"]["volumes"]}
            assert tmp["mountPath"] == "/tmp" and "emptyDir" in head_volumes[tmp["name"]], values
