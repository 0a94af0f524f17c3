"""helm/kiln: lint, render for every value set, validate against Kubernetes 1.30, and check what a
cluster operator relies on (labels, probes, resources, queues, secrets, security, autoscaling)."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from runtime_server.settings import RuntimeSettings
from tests.helm.dockerfile import image_entrypoints
from tests.helm.rendering import CHART, KUBE_VERSION, VALUE_SETS, fullname, rendered
from tuner_workers.settings import KilnSettings

SETS = sorted(VALUE_SETS)
STANDARD_LABELS = (
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/component",
    "app.kubernetes.io/part-of",
    "app.kubernetes.io/version",
    "app.kubernetes.io/managed-by",
    "helm.sh/chart",
)
SELECTOR_LABELS = ("app.kubernetes.io/name", "app.kubernetes.io/instance")
# Kinds whose schema is a CRD's, which kubernetes-validate has no copy of.
CRD_KINDS = {"ServiceMonitor"}
BIN = Path(sys.executable).parent


def worker_deployments(r):
    return [d for d in r.of_kind("Deployment") if component(d) == "worker"]


def component(doc) -> str:
    return doc["metadata"]["labels"]["app.kubernetes.io/component"]


def pool_of(doc) -> str:
    return doc["metadata"]["labels"]["kiln.dev/worker-pool"]


def env_of(r, container) -> dict:
    """The container's environment: its ConfigMaps' data, then its own env entries."""
    env = {}
    for source in container.get("envFrom", []):
        ref = source["configMapRef"]["name"]
        env.update(r.named("ConfigMap", ref)["data"])
    for entry in container.get("env", []):
        env[entry["name"]] = entry.get("value", entry.get("valueFrom"))
    return env


def expected_pools(values) -> dict[str, tuple[list[str], int]]:
    """pool name -> (queues, concurrency) as the values ask for them."""
    defaults = values["cpuWorkers"]
    pools = {
        p["name"]: (p["queues"], p.get("concurrency", defaults["concurrency"]))
        for p in defaults["pools"]
    }
    if values["gpuWorkers"]["enabled"]:
        # Builds of the architecture, and the tuned jobs that must measure on its GPUs.
        arch = values["gpuWorkers"]["arch"]
        pools["gpu"] = ([f"cuda.{arch}", f"cuda.{arch}.gpu"], 1)
    return pools


# -- lint and Kubernetes schemas ---------------------------------------------------------------


@pytest.mark.parametrize("name", SETS)
def test_lint_is_clean_in_strict_mode(name):
    import helm_python as helm

    report = helm.lint(str(CHART), VALUE_SETS[name], strict=True, kube_version=f"v{KUBE_VERSION}")
    problems = report["errors"] + [m for m in report["messages"] if m["severity"] >= 2]
    assert not problems, problems


@pytest.mark.parametrize("name", SETS)
def test_every_manifest_validates_strictly_against_kubernetes_1_30(name, tmp_path):
    r = rendered(name)
    path = tmp_path / f"{name}.yaml"
    path.write_text(r.yaml_text)
    result = subprocess.run(
        [BIN / "kubernetes-validate", "--strict", "-k", KUBE_VERSION, str(path)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # Every object was checked, except the CRD kinds it has no schema for.
    checked = result.stdout.count(" passed for resource ")
    assert checked == len([d for d in r.docs if d["kind"] not in CRD_KINDS])
    for doc in r.docs:
        if doc["kind"] in CRD_KINDS:
            assert doc["apiVersion"] == "monitoring.coreos.com/v1"


@pytest.mark.parametrize("name", SETS)
def test_renders_the_whole_stack(name):
    r = rendered(name)
    kinds = {d["kind"] for d in r.docs}
    assert {"Deployment", "Service", "ServiceAccount", "ConfigMap"} <= kinds
    assert {"NetworkPolicy", "PodDisruptionBudget"} <= kinds
    names = {d["metadata"]["name"] for d in r.of_kind("Deployment")}
    base = fullname()
    assert {f"{base}-api", f"{base}-runtime"} <= names
    assert {f"{base}-worker-{p}" for p in expected_pools(r.values)} <= names
    assert bool(r.of_kind("StatefulSet")) == r.values["redis"]["enabled"]
    store = r.values["artifactStore"]
    wants_claim = store["type"] == "pvc" and not store["pvc"]["existingClaim"]
    assert bool(r.of_kind("PersistentVolumeClaim")) == wants_claim
    assert bool(r.of_kind("Ingress")) == r.values["ingress"]["enabled"]


# -- labels and selectors ----------------------------------------------------------------------


@pytest.mark.parametrize("name", SETS)
def test_selectors_are_within_pod_labels(name):
    r = rendered(name)
    pods = [(d["spec"]["template"]["metadata"]["labels"], component(d)) for d in r.workloads()]
    for workload in r.workloads():
        selector = workload["spec"]["selector"]["matchLabels"]
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items(), workload["metadata"]["name"]
    # Services, PDBs and NetworkPolicies select pods of this release, and each selects some pod.
    selectors = [(d, d["spec"]["selector"]) for d in r.of_kind("Service")]
    selectors += [
        (d, d["spec"]["selector"]["matchLabels"]) for d in r.of_kind("PodDisruptionBudget")
    ]
    selectors += [(d, d["spec"]["podSelector"]["matchLabels"]) for d in r.of_kind("NetworkPolicy")]
    for doc, selector in selectors:
        hits = [c for labels, c in pods if selector.items() <= labels.items()]
        assert hits, f"{doc['kind']} {doc['metadata']['name']} selects no pod"
        assert {component(doc)} == set(hits), doc["metadata"]["name"]


@pytest.mark.parametrize("name", SETS)
def test_workload_selectors_do_not_overlap(name):
    r = rendered(name)
    selectors = [d["spec"]["selector"]["matchLabels"] for d in r.workloads()]
    for i, a in enumerate(selectors):
        for b in selectors[i + 1 :]:
            assert not (a.items() <= b.items() or b.items() <= a.items()), (a, b)


@pytest.mark.parametrize("name", SETS)
def test_standard_labels_on_every_object(name):
    r = rendered(name)
    for doc in r.docs:
        labels = doc["metadata"].get("labels", {})
        missing = [k for k in STANDARD_LABELS if not labels.get(k)]
        assert not missing, f"{doc['kind']} {doc['metadata']['name']} lacks {missing}"
        assert labels["app.kubernetes.io/instance"] == "kiln"
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
    for workload in r.workloads():
        pod_labels = workload["spec"]["template"]["metadata"]["labels"]
        assert all(pod_labels.get(k) for k in STANDARD_LABELS), workload["metadata"]["name"]


@pytest.mark.parametrize("name", SETS)
def test_selectors_never_hold_the_version(name):
    """A Deployment's selector is immutable: a version in it would break every upgrade."""
    r = rendered(name)
    selectors = [d["spec"]["selector"]["matchLabels"] for d in r.workloads()]
    selectors += [d["spec"]["selector"] for d in r.of_kind("Service")]
    selectors += [d["spec"]["selector"]["matchLabels"] for d in r.of_kind("PodDisruptionBudget")]
    for selector in selectors:
        assert set(SELECTOR_LABELS) <= set(selector)
        assert "app.kubernetes.io/version" not in selector
        assert "helm.sh/chart" not in selector


# -- containers --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SETS)
def test_probes_on_every_container(name):
    r = rendered(name)
    for workload, _, container in r.containers():
        where = f"{workload['metadata']['name']}/{container['name']}"
        assert container.get("livenessProbe"), f"{where} has no liveness probe"
        if component(workload) in ("api", "runtime", "redis"):
            assert container.get("readinessProbe"), f"{where} has no readiness probe"


@pytest.mark.parametrize("name", SETS)
def test_http_probes_hit_the_health_endpoints(name):
    r = rendered(name)
    paths = {
        "api": ("/health/live", "/health/ready", "/health/live"),
        "runtime": ("/v2/health/live", "/v2/health/ready", "/v2/health/ready"),
    }
    for workload, _, container in r.kiln_containers():
        if component(workload) not in paths:
            continue
        live, ready, startup = paths[component(workload)]
        assert container["livenessProbe"]["httpGet"]["path"] == live
        assert container["readinessProbe"]["httpGet"]["path"] == ready
        assert container["startupProbe"]["httpGet"]["path"] == startup
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert container["livenessProbe"]["httpGet"]["port"] in ports


@pytest.mark.parametrize("name", SETS)
def test_resource_requests_on_every_container(name):
    r = rendered(name)
    for workload, _, container in r.containers():
        requests = container.get("resources", {}).get("requests", {})
        where = f"{workload['metadata']['name']}/{container['name']}"
        assert requests.get("cpu") and requests.get("memory"), f"{where} requests {requests}"


@pytest.mark.parametrize("name", SETS)
def test_gpu_workers_request_nvidia_gpus(name):
    r = rendered(name)
    gpu_wanted = r.values["gpuWorkers"]["enabled"]
    gpu = [d for d in worker_deployments(r) if pool_of(d) == "gpu"]
    assert len(gpu) == int(gpu_wanted)
    for workload, pod, container in r.containers():
        limits = container.get("resources", {}).get("limits", {})
        if workload in gpu:
            assert limits.get("nvidia.com/gpu") == 1
            # A GPU node pool is tainted and labelled: the pods must tolerate and select it.
            assert any(t.get("key") == "nvidia.com/gpu" for t in pod.get("tolerations", []))
            assert pod.get("nodeSelector")
            assert container["image"].endswith("-cuda")
        else:
            assert "nvidia.com/gpu" not in limits, workload["metadata"]["name"]


@pytest.mark.parametrize("name", SETS)
def test_workers_outlive_a_running_job_on_shutdown(name):
    """SIGTERM lets Celery finish its job: the grace period covers the compile time limits."""
    r = rendered(name)
    soft = r.values["compile"]["softTimeLimit"]
    hard = r.values["compile"]["hardTimeLimit"]
    workers = worker_deployments(r)
    assert workers
    for workload in workers:
        grace = workload["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace >= soft and grace > hard, workload["metadata"]["name"]


@pytest.mark.parametrize("name", SETS)
def test_worker_command_lines_route_to_their_queues(name):
    r = rendered(name)
    wanted = expected_pools(r.values)
    seen = {}
    for workload, _, container in r.kiln_containers():
        if component(workload) != "worker":
            continue
        pool = pool_of(workload)
        queues, concurrency = wanted[pool]
        assert "command" not in container  # the image's entrypoint (`kiln`) runs
        assert container["args"] == [
            "worker",
            "-Q",
            ",".join(queues),
            "--concurrency",
            str(concurrency),
        ]
        # The liveness probe pings the Celery node `kiln worker` names after the last queue.
        probe = " ".join(container["livenessProbe"]["exec"]["command"])
        assert f'--destination "kiln-{queues[-1]}@$(hostname)"' in probe
        assert "celery -A tuner_workers.tasks inspect ping" in probe
        seen[pool] = queues
    assert seen.keys() == wanted.keys()
    # GPU queues go only to GPU workers, CPU queues only to CPU workers.
    for pool, queues in seen.items():
        prefix = "cuda." if pool == "gpu" else "cpu"
        assert all(q.startswith(prefix) for q in queues), (pool, queues)


def test_worker_pools_take_defaults_and_their_own_overrides():
    r = rendered("full-stack")
    base = fullname()
    generic = r.named("Deployment", f"{base}-worker-generic")
    znver4 = r.named("Deployment", f"{base}-worker-znver4")
    assert generic["spec"]["replicas"] == r.values["cpuWorkers"]["replicaCount"]
    assert "replicas" not in znver4["spec"]  # its own HPA
    assert znver4["spec"]["template"]["spec"]["nodeSelector"] == {"kiln.dev/cpu": "znver4"}
    assert "nodeSelector" not in generic["spec"]["template"]["spec"]
    hpa = r.named("HorizontalPodAutoscaler", f"{base}-worker-znver4")
    assert hpa["spec"]["maxReplicas"] == 12
    assert hpa["spec"]["minReplicas"] == r.values["cpuWorkers"]["autoscaling"]["minReplicas"]


@pytest.mark.parametrize("name", SETS)
def test_api_and_runtime_entrypoints_match_the_image(name):
    from compiler_core.cli import SERVICE_COMMANDS

    assert set(image_entrypoints().values()) == {("kiln",)}
    r = rendered(name)
    ports = {"api": 8000, "runtime": 8001}
    for workload, _, container in r.kiln_containers():
        assert "command" not in container, "the chart must run the image's `kiln` entrypoint"
        assert container["args"][0] in SERVICE_COMMANDS
        kind = component(workload)
        if kind in ports:
            assert container["args"] == [kind, "--host", "0.0.0.0", "--port", str(ports[kind])]
            assert [p["containerPort"] for p in container["ports"]] == [ports[kind]]
            service = r.named("Service", workload["metadata"]["name"])
            assert service["spec"]["ports"][0]["port"] == ports[kind]


# -- configuration and secrets -----------------------------------------------------------------


@pytest.mark.parametrize("name", SETS)
def test_kiln_variables_are_settings_the_processes_read(name):
    """A misspelt KILN_* name would be ignored silently by the settings objects."""
    known = {f"KILN_{f.upper()}" for f in KilnSettings.model_fields}
    known |= {f"KILN_{f.upper()}" for f in RuntimeSettings.model_fields}
    r = rendered(name)
    for _, _, container in r.kiln_containers():
        env = env_of(r, container)
        unknown = {k for k in env if k.startswith("KILN_")} - known
        assert not unknown, unknown


@pytest.mark.parametrize("name", SETS)
def test_each_process_gets_its_settings(name):
    r = rendered(name)
    values = r.values
    store = values["artifactStore"]
    if store["type"] == "s3":
        prefix = store["s3"]["prefix"].strip("/")
        want_store = f"s3://{store['s3']['bucket']}/{prefix}".rstrip("/")
    else:
        want_store = store["pvc"]["mountPath"]
    for workload, pod, container in r.kiln_containers():
        env = env_of(r, container)
        kind = component(workload)
        assert env["KILN_STORE_URL"] == want_store
        assert env["KILN_DATA_DIR"] == "/var/lib/kiln" and env["TMPDIR"] == "/tmp"
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert {"/tmp", "/var/lib/kiln"} <= mounts
        if store["type"] == "pvc":
            assert store["pvc"]["mountPath"] in mounts
            claims = [
                v["persistentVolumeClaim"]["claimName"]
                for v in pod["volumes"]
                if "persistentVolumeClaim" in v
            ]
            assert claims == [store["pvc"]["existingClaim"] or f"{fullname()}-store"]
        if kind in ("api", "worker"):
            assert env.get("KILN_REDIS_URL"), f"{kind} has no Redis"
        if kind == "api":
            assert env["KILN_RUNTIME_URL"] == f"http://{fullname()}-runtime:8001"
            assert env["KILN_MAX_UPLOAD_BYTES"] == str(values["api"]["maxUploadBytes"])
        if kind == "worker":
            assert int(env["KILN_COMPILE_SOFT_TIME_LIMIT"]) == values["compile"]["softTimeLimit"]
            assert int(env["KILN_COMPILE_HARD_TIME_LIMIT"]) == values["compile"]["hardTimeLimit"]
        if kind == "runtime":
            assert env["KILN_RUNTIME_INSTANCES"] == str(values["runtime"]["instances"])
            assert env["KILN_NUM_THREADS"] == str(values["runtime"]["numThreads"])
    if values["redis"]["enabled"]:
        config = r.named("ConfigMap", fullname())["data"]
        assert config["KILN_REDIS_URL"] == f"redis://{fullname()}-redis:6379/0"


SECRET_ENV = ("KILN_API_KEYS", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")


@pytest.mark.parametrize("name", SETS)
def test_no_plain_text_secret_in_any_manifest(name):
    r = rendered(name)
    assert not r.of_kind("Secret"), "the chart takes Secrets by reference only"
    for _, _, container in r.kiln_containers():
        for entry in container.get("env", []):
            if entry["name"] in SECRET_ENV or entry["name"] == "KILN_REDIS_URL":
                assert set(entry) == {"name", "valueFrom"}, entry
                assert "secretKeyRef" in entry["valueFrom"]
    config = r.named("ConfigMap", fullname())["data"]
    assert not set(SECRET_ENV) & set(config)
    for doc in r.docs:
        for key, value in leaves(doc):
            where = f"{doc['kind']} {doc['metadata']['name']}: {key}"
            # No URL with user:password@, no AWS access key id, no private key.
            assert not re.search(r"://[^/\s@]*:[^/\s@]*@", value), where
            assert not re.search(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b", value), where
            assert "PRIVATE KEY" not in value, where
            # Secret-looking fields hold references (a Secret's name), never a literal.
            if SECRETISH.search(key) and key not in SECRET_REFERENCES:
                pytest.fail(f"{where} = {value!r}")


SECRETISH = re.compile(r"password|passwd|token|secret|api_?key|credential", re.I)
# Keys that name a Secret rather than hold one.
SECRET_REFERENCES = {"secretName", "automountServiceAccountToken"}


def leaves(node, key=""):
    """(key, string) for every string in a manifest, env values keyed by their variable."""
    if isinstance(node, dict):
        if set(node) == {"name", "value"}:  # an env entry
            yield str(node["name"]), str(node["value"])
            return
        for k, v in node.items():
            if k == "secretKeyRef":
                continue
            yield from leaves(v, k)
    elif isinstance(node, list):
        for item in node:
            yield from leaves(item, key)
    elif isinstance(node, str):
        yield key, node


def test_secrets_are_referenced_by_name():
    r = rendered("external-redis-s3")
    api = r.named("Deployment", f"{fullname()}-api")
    env = {e["name"]: e for e in api["spec"]["template"]["spec"]["containers"][0]["env"]}
    refs = {
        k: (v["valueFrom"]["secretKeyRef"]["name"], v["valueFrom"]["secretKeyRef"]["key"])
        for k, v in env.items()
    }
    assert refs["KILN_REDIS_URL"] == ("kiln-redis", "url")
    assert refs["KILN_API_KEYS"] == ("kiln-api-keys", "api-keys")
    assert refs["AWS_ACCESS_KEY_ID"] == ("kiln-s3", "AWS_ACCESS_KEY_ID")
    assert refs["AWS_SECRET_ACCESS_KEY"] == ("kiln-s3", "AWS_SECRET_ACCESS_KEY")
    config = r.named("ConfigMap", fullname())["data"]
    assert "KILN_REDIS_URL" not in config
    assert config["KILN_S3_ENDPOINT_URL"] == "https://minio.storage.svc:9000"
    assert config["KILN_S3_REGION"] == "eu-west-1"
    # The runtime reads the store, never Redis.
    runtime = r.named("Deployment", f"{fullname()}-runtime")
    names = {e["name"] for e in runtime["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert "AWS_SECRET_ACCESS_KEY" in names and "KILN_REDIS_URL" not in names


@pytest.mark.parametrize("name", SETS)
def test_pods_carry_the_configmap_checksum(name):
    r = rendered(name)
    text = r.manifests[f"{CHART.name}/templates/configmap.yaml"]
    checksum = hashlib.sha256(text.encode()).hexdigest()
    for workload, _, _ in r.kiln_containers():
        annotations = workload["spec"]["template"]["metadata"]["annotations"]
        assert annotations["checksum/config"] == checksum, workload["metadata"]["name"]


def test_checksum_changes_with_the_settings():
    a = rendered("defaults")
    b = rendered("hpa-off")  # same settings, other replica counts
    c = rendered("external-redis-url-irsa")

    def checksum(r):
        api = r.named("Deployment", f"{fullname()}-api")
        return api["spec"]["template"]["metadata"]["annotations"]["checksum/config"]

    assert checksum(a) == checksum(b) != checksum(c)


# -- autoscaling and disruption ----------------------------------------------------------------


@pytest.mark.parametrize("name", SETS)
def test_replicas_omitted_when_the_hpa_is_on(name):
    r = rendered(name)
    hpas = {h["spec"]["scaleTargetRef"]["name"]: h for h in r.of_kind("HorizontalPodAutoscaler")}
    deployments = {d["metadata"]["name"]: d for d in r.of_kind("Deployment")}
    for target, hpa in hpas.items():
        assert hpa["apiVersion"] == "autoscaling/v2"
        assert hpa["spec"]["scaleTargetRef"]["kind"] == "Deployment"
        assert target in deployments, f"HPA {hpa['metadata']['name']} targets nothing"
        assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    for dname, deployment in deployments.items():
        if dname in hpas:
            assert "replicas" not in deployment["spec"], dname
        else:
            assert deployment["spec"]["replicas"] >= 1, dname


@pytest.mark.parametrize("name", ["hpa-on", "hpa-off", "defaults"])
def test_hpa_switches(name):
    r = rendered(name)
    wanted = 0
    for key in ("api", "runtime"):
        wanted += r.values[key]["autoscaling"]["enabled"]
    gpu = r.values["gpuWorkers"]
    cpu = r.values["cpuWorkers"]
    wanted += len(cpu["pools"]) * cpu["autoscaling"]["enabled"]
    wanted += gpu["enabled"] and gpu["autoscaling"]["enabled"]
    assert len(r.of_kind("HorizontalPodAutoscaler")) == wanted
    assert (wanted > 0) == (name == "hpa-on")


@pytest.mark.parametrize("name", SETS)
def test_every_kiln_deployment_has_a_disruption_budget(name):
    r = rendered(name)
    budgets = [p["spec"]["selector"]["matchLabels"] for p in r.of_kind("PodDisruptionBudget")]
    for deployment in r.of_kind("Deployment"):
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        matching = [b for b in budgets if b.items() <= labels.items()]
        assert len(matching) == 1, deployment["metadata"]["name"]


# -- security ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SETS)
def test_security_contexts(name):
    r = rendered(name)
    for workload, pod, container in r.containers():
        where = f"{workload['metadata']['name']}/{container['name']}"
        assert pod["securityContext"]["runAsNonRoot"] is True, where
        assert pod["securityContext"]["runAsUser"] > 0, where
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, where
        sc = container["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True, where
        assert sc["allowPrivilegeEscalation"] is False, where
        assert sc["capabilities"]["drop"] == ["ALL"], where
        assert not sc["capabilities"].get("add"), where
        # A read-only root needs somewhere to write: /tmp is an emptyDir everywhere.
        volumes = {v["name"]: v for v in pod["volumes"]}
        tmp = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
        assert tmp and "emptyDir" in volumes[tmp[0]["name"]], where


@pytest.mark.parametrize("name", SETS)
def test_no_service_account_token_is_mounted(name):
    r = rendered(name)
    for account in r.of_kind("ServiceAccount"):
        assert account["automountServiceAccountToken"] is False
    for workload in r.workloads():
        pod = workload["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False, workload["metadata"]["name"]
        assert pod["serviceAccountName"] == fullname()


@pytest.mark.parametrize("name", SETS)
def test_only_the_api_and_workers_reach_redis(name):
    r = rendered(name)
    policies = {p["metadata"]["name"]: p for p in r.of_kind("NetworkPolicy")}
    if not r.values["redis"]["enabled"]:
        assert f"{fullname()}-redis" not in policies
        return
    policy = policies[f"{fullname()}-redis"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    (peer,) = rule["from"]
    admitted = peer["podSelector"]["matchLabels"]
    assert set(peer) == {"podSelector"}  # pods of this namespace only
    for workload in r.workloads():
        labels = workload["spec"]["template"]["metadata"]["labels"]
        reaches = admitted.items() <= labels.items()
        assert reaches == (component(workload) in ("api", "worker")), workload["metadata"]["name"]
    assert [p["port"] for p in rule["ports"]] == ["redis"]


@pytest.mark.parametrize("name", SETS)
def test_workers_admit_no_connections(name):
    r = rendered(name)
    policy = r.named("NetworkPolicy", f"{fullname()}-worker")
    assert policy["spec"]["policyTypes"] == ["Ingress"] and policy["spec"]["ingress"] == []


# -- ingress, metrics --------------------------------------------------------------------------


INGRESS_SETS = [n for n in SETS if VALUE_SETS[n].get("ingress", {}).get("enabled")]


@pytest.mark.parametrize("name", INGRESS_SETS)
def test_ingress_accepts_model_uploads(name):
    r = rendered(name)
    (ingress,) = r.of_kind("Ingress")
    size = ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/proxy-body-size"]
    asked = r.values["ingress"]["proxyBodySize"]
    if asked:
        assert size == asked
    else:
        assert int(size) > r.values["api"]["maxUploadBytes"]
    backends = {
        p["backend"]["service"]["name"]
        for rule in ingress["spec"]["rules"]
        for p in rule["http"]["paths"]
    }
    services = {s["metadata"]["name"] for s in r.of_kind("Service")}
    assert backends <= services


@pytest.mark.parametrize("name", SETS)
def test_metrics_are_scraped(name):
    r = rendered(name)
    monitors = r.of_kind("ServiceMonitor")
    assert bool(monitors) == r.values["metrics"]["serviceMonitor"]["enabled"]
    for deployment in r.of_kind("Deployment"):
        if component(deployment) not in ("api", "runtime"):
            continue
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        port = deployment["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == str(port)
        assert annotations["prometheus.io/path"] == "/metrics"
    for monitor in monitors:
        assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
