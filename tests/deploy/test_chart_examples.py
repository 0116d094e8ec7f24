"""What the example values files leave a user to get right: the GPU example's shared model volume, its KV
cache size, and its decode pods' spreading."""

from __future__ import annotations

from typing import Any

import yaml

from tests.deploy.chart import EXAMPLES, one, pod_templates, render, selects, worker_groups

GPU_BYTES = 80e9  # the example's nodeSelector: NVIDIA-H100-80GB-HBM3
# SmolLM2-135M (its config.json): 30 layers, 3 KV heads of 64; bf16 KV; 16-token blocks.
KV_BLOCK_BYTES = 2 * 16 * 3 * 64 * 2 * 30
WEIGHT_BYTES = 135e6 * 2


def test_the_gpu_examples_shared_volume_says_to_name_an_rwx_storage_class() -> None:
    """ReadWriteMany binds only on a class that provides it, which a cluster's default often does not: the
    example carries the line to uncomment, where the chart reads it."""
    text = (EXAMPLES / "gpu.yaml").read_text()
    assert "# storageClassName:" in text
    values = yaml.safe_load(text.replace("# storageClassName: <your RWX storage class>", "storageClassName: rwx"))
    assert values["model"]["cache"]["persistentVolumeClaim"]["storageClassName"] == "rwx"
    pvc = one(
        render(["gpu.yaml"], {"model.cache.persistentVolumeClaim.storageClassName": "rwx"}), "PersistentVolumeClaim"
    )
    assert pvc["spec"]["storageClassName"] == "rwx" and pvc["spec"]["accessModes"] == ["ReadWriteMany"]


def test_the_gpu_example_sizes_the_kv_cache_to_its_gpu() -> None:
    """pdserve's default 1 GiB leaves an 80 GB GPU nearly idle; the example's size fills most of what the weights
    leave, with room for the CUDA context, activations and graphs."""
    args = pod_templates(render(["gpu.yaml"]))["controller"]["spec"]["containers"][0]["args"]
    kv_bytes = float(args[args.index("--kv-cache-gb") + 1]) * 2**30
    assert 0.5 * GPU_BYTES < kv_bytes < GPU_BYTES - WEIGHT_BYTES - 8 * 2**30
    assert kv_bytes // KV_BLOCK_BYTES > 100_000


def test_the_gpu_examples_decode_spreading_selects_its_own_releases_decode_pods() -> None:
    objects = render(["gpu.yaml"])
    term = worker_groups(objects)["decode"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    selector = term["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]["labelSelector"]
    labels: dict[str, Any] = pod_templates(objects)["decode"]["metadata"]["labels"]
    assert selects(selector, labels)
    assert not selects(selector, {**labels, "app.kubernetes.io/instance": "another-release"})
    assert not selects(selector, pod_templates(objects)["prefill"]["metadata"]["labels"])
