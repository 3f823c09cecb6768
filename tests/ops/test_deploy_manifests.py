"""deploy/kubernetes: the core resources validate against Kubernetes' own OpenAPI schemas
(kubernetes-validate), the CRD-based ones carry their required fields, and every name they rely on
exists in the server: the port, /health, /data, the launcher variables, the metric series."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tgi_compat.api.cli.launcher import FLAGS
from tgi_compat.api.observability.metrics import ServerMetrics

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.30.0"
CRD_KINDS = {"ScaledObject", "InferencePool"}  # validated by their operators' CRDs, not core schemas


def _documents() -> dict[str, dict]:
    docs = {}
    for path in sorted(DEPLOY.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            docs[doc["kind"]] = doc
    return docs


DOCS = _documents()


@pytest.mark.parametrize("kind", sorted(set(DOCS) - CRD_KINDS - {"Kustomization"}))
def test_core_resources_validate_against_the_kubernetes_schema(kind):
    kubernetes_validate.validate(DOCS[kind], KUBERNETES_VERSION, strict=True)


def test_kustomization_lists_the_core_resources():
    listed = set(DOCS["Kustomization"]["resources"])
    assert listed == {"pvc.yaml", "deployment.yaml", "service.yaml", "hpa.yaml"}
    assert all((DEPLOY / name).exists() for name in listed)


def _container() -> dict:
    [container] = DOCS["Deployment"]["spec"]["template"]["spec"]["containers"]
    return container


def test_probes_hit_health_on_the_served_port_and_the_cache_is_on_data():
    container = _container()
    assert container["ports"] == [{"name": "http", "containerPort": 80, "protocol": "TCP"}]  # the image's PORT
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # a model download fits
    assert {"name": "data", "mountPath": "/data"} in container["volumeMounts"]  # HF_HOME=/data in the image
    assert container["resources"]["limits"]["nvidia.com/gpu"] == container["resources"]["requests"]["nvidia.com/gpu"]
    flag_variables = {flag.env for flag in FLAGS}
    assert {env["name"] for env in container["env"]} - {"HF_TOKEN"} <= flag_variables
    spec = DOCS["Deployment"]["spec"]
    assert spec["selector"]["matchLabels"] == DOCS["Service"]["spec"]["selector"]
    assert spec["template"]["spec"]["terminationGracePeriodSeconds"] > 90  # the drain limit


def _served_series() -> set[str]:
    metrics = ServerMetrics(max_input_tokens=32, max_total_tokens=64, model_name="m")
    metrics.set_engine_stats(1, 1, 8, 8, 64)
    return {line.split("{")[0].split(" ")[0] for line in metrics.render().decode().splitlines() if line[:1] != "#"}


def test_autoscalers_and_the_inference_pool_read_series_the_server_serves():
    served = _served_series()
    assert {"vllm:num_requests_waiting", "vllm:gpu_cache_usage_perc", "vllm:lora_requests_info"} <= served
    hpa_metric = DOCS["HorizontalPodAutoscaler"]["spec"]["metrics"][0]["pods"]["metric"]["name"]
    assert hpa_metric in served
    keda = DOCS["ScaledObject"]["spec"]
    assert keda["scaleTargetRef"]["name"] == DOCS["Deployment"]["metadata"]["name"]
    for trigger in keda["triggers"]:
        assert trigger["type"] == "prometheus" and trigger["metadata"]["query"].split("(", 1)[1].split("{")[0] in served
    pool = DOCS["InferencePool"]["spec"]
    assert pool["selector"]["matchLabels"] == DOCS["Deployment"]["spec"]["selector"]["matchLabels"]
    assert pool["targetPorts"] == [{"number": 80}] and pool["endpointPickerRef"]["name"]
