"""Render helm/kiln offline (Helm's Go SDK through helm-python-sdk) for a matrix of values.

Every test in tests/helm that looks at manifests runs over VALUE_SETS: each names one way a person
would install the chart (GPU node pool, autoscaling, external Redis and S3, ingress...).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "kiln"
RELEASE = "kiln"
NAMESPACE = "kiln"
KUBE_VERSION = "1.30.0"

_HPA_ALL = {"autoscaling": {"enabled": True}}

VALUE_SETS: dict[str, dict] = {
    # `helm install kiln helm/kiln`: in-chart Redis, the store on a ReadWriteMany volume.
    "defaults": {},
    "gpu-workers": {"gpuWorkers": {"enabled": True, "arch": "sm_80"}},
    "hpa-on": {
        "api": _HPA_ALL,
        "runtime": _HPA_ALL,
        "cpuWorkers": _HPA_ALL,
        "gpuWorkers": {"enabled": True, **_HPA_ALL},
    },
    "hpa-off": {
        "api": {"autoscaling": {"enabled": False}, "replicaCount": 3},
        "runtime": {"autoscaling": {"enabled": False}, "replicaCount": 4},
        "gpuWorkers": {"enabled": True, "autoscaling": {"enabled": False}, "replicaCount": 2},
    },
    # The README's production example: external Redis and S3, credentials in Secrets.
    "external-redis-s3": {
        "redis": {"enabled": False, "existingSecret": "kiln-redis", "existingSecretKey": "url"},
        "artifactStore": {
            "type": "s3",
            "s3": {
                "bucket": "kiln-artifacts",
                "prefix": "prod/",
                "endpointUrl": "https://minio.storage.svc:9000",
                "region": "eu-west-1",
                "existingSecret": "kiln-s3",
            },
        },
        "api": {"auth": {"existingSecret": "kiln-api-keys"}},
        "gpuWorkers": {"enabled": True},
    },
    # External Redis without credentials, S3 through the pods' identity (IRSA), no key Secret.
    "external-redis-url-irsa": {
        "redis": {"enabled": False, "url": "redis://redis.cache.svc:6379/2"},
        "artifactStore": {"type": "s3", "s3": {"bucket": "kiln-artifacts"}},
        "serviceAccount": {
            "annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/kiln"}
        },
    },
    "in-chart-redis-ephemeral": {"redis": {"enabled": True, "persistence": {"enabled": False}}},
    "pvc-existing-claim": {
        "artifactStore": {
            "type": "pvc",
            "pvc": {"existingClaim": "shared-kiln", "mountPath": "/store"},
        }
    },
    "ingress": {
        "ingress": {
            "enabled": True,
            "proxyBodySize": "2g",
            "hosts": [
                {
                    "host": "kiln.example.com",
                    "paths": [
                        {"path": "/", "pathType": "Prefix", "service": "api"},
                        {"path": "/v2", "pathType": "Prefix", "service": "runtime"},
                    ],
                }
            ],
            "tls": [{"secretName": "kiln-tls", "hosts": ["kiln.example.com"]}],
        },
        "networkPolicy": {
            "ingressFrom": [
                {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress"}}}
            ]
        },
    },
    # Several CPU pools (generic and per CPU model), GPUs, HPAs on some, ServiceMonitors.
    "full-stack": {
        "cpuWorkers": {
            "pools": [
                {"name": "generic", "queues": ["cpu"], "concurrency": 2},
                {
                    "name": "znver4",
                    "queues": ["cpu", "cpu.znver4"],
                    "nodeSelector": {"kiln.dev/cpu": "znver4"},
                    "autoscaling": {"enabled": True, "maxReplicas": 12},
                },
            ]
        },
        "gpuWorkers": {"enabled": True, "arch": "sm_90"},
        "api": {"auth": {"existingSecret": "kiln-api-keys"}, "autoscaling": {"enabled": True}},
        "ingress": {"enabled": True},
        "metrics": {"serviceMonitor": {"enabled": True}},
        "commonLabels": {"team": "ml-platform"},
    },
}


@dataclass(frozen=True)
class Rendering:
    name: str
    values: dict  # the chart's defaults merged with the value set
    manifests: dict  # template path -> rendered text
    docs: tuple  # every object, parsed

    def of_kind(self, kind: str) -> list[dict]:
        return [d for d in self.docs if d["kind"] == kind]

    def named(self, kind: str, name: str) -> dict:
        (doc,) = [d for d in self.of_kind(kind) if d["metadata"]["name"] == name]
        return doc

    @property
    def yaml_text(self) -> str:
        return "\n---\n".join(
            text
            for path, text in self.manifests.items()
            if path.endswith((".yaml", ".yml")) and text.strip()
        )

    def workloads(self) -> list[dict]:
        return [d for d in self.docs if d["kind"] in ("Deployment", "StatefulSet")]

    def containers(self):
        """(workload, pod spec, container) for every container of every workload."""
        for workload in self.workloads():
            pod = workload["spec"]["template"]["spec"]
            for container in pod.get("containers", []) + pod.get("initContainers", []):
                yield workload, pod, container

    def kiln_containers(self):
        """Containers running the Kiln image (everything but Redis)."""
        for workload, pod, container in self.containers():
            if workload["metadata"]["labels"]["app.kubernetes.io/component"] != "redis":
                yield workload, pod, container


def render(values: dict) -> Rendering:
    return _render(json.dumps(values, sort_keys=True))


@functools.cache
def _render(values_json: str) -> Rendering:
    import helm_python as helm

    values = json.loads(values_json)
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE)
        merged = chart.merge_values(values)
    docs = []
    for path, text in manifests.items():
        if path.endswith((".yaml", ".yml")):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return Rendering("", merged, manifests, tuple(docs))


def rendered(name: str) -> Rendering:
    r = render(VALUE_SETS[name])
    return Rendering(name, r.values, r.manifests, r.docs)


def fullname() -> str:
    return RELEASE  # the release is named like the chart, so the full name is the release's
