"""deploy/k8s: every manifest validates against the Kubernetes OpenAPI schemas (offline,
``kubernetes-validate``, strict: unknown fields fail), and the topology the operations
guide promises holds: a 3-node NATS cluster, Redis with a replica, active-active
scheduler, scaled edge and tokenizer Deployments, one GPU worker per GPU node, probes and
resource requests on every container."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
NAMESPACE = "prefixmesh"
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet")
# Ports the prefixmesh services serve /health and /metrics on (shared/runtime/metrics.py).
APP_PORTS = {"edge": 8000, "metrics": 9100}
INTERNAL_PORT = 9200


def _kustomization() -> dict[str, Any]:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


def _docs() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for name in _kustomization()["resources"]:
        for doc in yaml.safe_load_all((K8S / name).read_text()):
            if doc:
                docs.append((name, doc))
    return docs


DOCS = _docs()


def _by_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for _f, d in DOCS if d["kind"] == kind}


def _containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return doc["spec"]["template"]["spec"]["containers"]


@pytest.fixture(scope="module")
def k8s_validate():
    import kubernetes_validate as kv  # the [test] extra

    return kv, kv.latest_version()


def test_kustomization_lists_every_manifest() -> None:
    listed = set(_kustomization()["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk
    assert _kustomization()["namespace"] == NAMESPACE


@pytest.mark.parametrize("doc", [d for _f, d in DOCS],
                         ids=[f"{f}:{d['kind']}/{d['metadata']['name']}" for f, d in DOCS])
def test_manifest_validates_against_the_kubernetes_schema(k8s_validate, doc: dict) -> None:
    kv, version = k8s_validate
    kv.validate(doc, version, strict=True)


def test_a_broken_manifest_fails_validation(k8s_validate) -> None:
    kv, version = k8s_validate
    doc = yaml.safe_load(yaml.safe_dump(_by_kind("Deployment")["edge"]))
    doc["spec"]["replicas"] = "three"
    with pytest.raises(kv.ValidationError):
        kv.validate(doc, version, strict=True)
    doc = yaml.safe_load(yaml.safe_dump(_by_kind("Deployment")["edge"]))
    doc["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kv.ValidationError):
        kv.validate(doc, version, strict=True)


def test_every_container_has_probes_and_resource_requests() -> None:
    for _f, doc in DOCS:
        if doc["kind"] not in WORKLOADS:
            continue
        for c in _containers(doc):
            where = f"{doc['metadata']['name']}/{c['name']}"
            assert c.get("livenessProbe") and c.get("readinessProbe"), where
            req = c["resources"]["requests"]
            assert req.get("cpu") and req.get("memory"), where
            assert c["resources"].get("limits", {}).get("memory"), where


def test_nats_is_a_three_node_jetstream_cluster() -> None:
    nats = _by_kind("StatefulSet")["nats"]
    assert nats["spec"]["replicas"] == 3
    conf = _by_kind("ConfigMap")["nats-config"]["data"]["nats.conf"]
    routes = re.findall(r"nats://(nats-\d)\.nats-headless:6222", conf)
    assert sorted(routes) == ["nats-0", "nats-1", "nats-2"]
    assert "jetstream" in conf and "store_dir: /data" in conf
    assert nats["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    assert _by_kind("PodDisruptionBudget")["nats"]["spec"]["maxUnavailable"] == 1


def test_redis_has_a_persistent_replica() -> None:
    redis = _by_kind("StatefulSet")["redis"]
    assert redis["spec"]["replicas"] >= 2
    assert "--replicaof redis-0.redis-headless" in " ".join(_containers(redis)[0]["args"])
    conf = _by_kind("ConfigMap")["redis-config"]["data"]["redis.conf"]
    assert "appendonly yes" in conf
    primary = _by_kind("Service")["redis-primary"]["spec"]["selector"]
    assert primary["statefulset.kubernetes.io/pod-name"] == "redis-0"
    env = _by_kind("ConfigMap")["prefixmesh-env"]["data"]
    assert env["PM_REDIS_URL"].startswith("redis://redis-primary:6379")
    assert env["PM_NATS_URL"] == "nats://nats:4222"


def test_scheduler_is_active_active_and_scales_on_decisions() -> None:
    sched = _by_kind("Deployment")["scheduler"]
    assert sched["spec"]["replicas"] >= 2
    env = {e["name"]: e.get("value") for e in _containers(sched)[0]["env"]}
    assert env["PM_LEASE"] == "true"  # the lease picks the snapshot writer, not the router
    assert "PM_HA" not in env
    # A rolling update adds a pod before removing one: routing capacity never drops.
    assert sched["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert _by_kind("PodDisruptionBudget")["scheduler"]["spec"]["minAvailable"] == 1
    hpa = _by_kind("HorizontalPodAutoscaler")["scheduler"]["spec"]
    assert hpa["scaleTargetRef"]["name"] == "scheduler"
    assert hpa["maxReplicas"] > hpa["minReplicas"] >= 2
    (metric,) = hpa["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == "prefixmesh_scheduler_decisions_per_second"


@pytest.mark.parametrize("name", ["edge", "tokenizer"])
def test_edge_and_tokenizer_scale(name: str) -> None:
    dep = _by_kind("Deployment")[name]
    hpa = _by_kind("HorizontalPodAutoscaler")[name]
    assert dep["spec"]["replicas"] >= 2
    assert hpa["spec"]["scaleTargetRef"]["name"] == name
    assert hpa["spec"]["maxReplicas"] > hpa["spec"]["minReplicas"] >= 2


def test_one_gpu_worker_per_gpu_node() -> None:
    ds = _by_kind("DaemonSet")["worker-gpu"]
    spec = ds["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    (c,) = spec["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert {e["name"]: e.get("value") for e in c["env"]}["PM_BACKEND"] == "vllm"
    assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= 600


def test_services_probe_and_are_scraped_on_their_http_port() -> None:
    for _f, doc in DOCS:
        if doc["kind"] not in WORKLOADS or doc["metadata"]["name"] in ("nats", "redis"):
            continue
        name = doc["metadata"]["name"]
        port = APP_PORTS.get(name, INTERNAL_PORT)
        notes = doc["spec"]["template"]["metadata"]["annotations"]
        assert notes["prometheus.io/scrape"] == "true" and notes["prometheus.io/port"] == str(port)
        (c,) = _containers(doc)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports[c["readinessProbe"]["httpGet"]["port"]] == port, name
        assert c["readinessProbe"]["httpGet"]["path"] == "/health"
        assert c["securityContext"]["runAsNonRoot"] is True


def test_everything_lives_in_the_namespace() -> None:
    for _f, doc in DOCS:
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == NAMESPACE, doc["metadata"]["name"]
