"""helm/kiln/values.schema.json: the defaults pass, wrong types and unknown keys are refused with
a message that names the key, before anything reaches a cluster."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import helm_python as helm
import jsonschema
import pytest
import yaml

from tests.helm.rendering import CHART, VALUE_SETS

SCHEMA = json.loads((CHART / "values.schema.json").read_text())
DEFAULTS = yaml.safe_load((CHART / "values.yaml").read_text())
BIN = Path(sys.executable).parent

# (values, words the error must contain): wrong types, unknown keys, impossible settings.
BAD_VALUES = {
    "replicaCount-string": ({"api": {"replicaCount": "two"}}, ["replicaCount", "integer"]),
    "top-level-unknown-key": ({"replicaCount": "two"}, ["replicaCount"]),
    "switch-as-string": ({"gpuWorkers": {"enabled": "yes"}}, ["enabled", "boolean"]),
    "misspelt-key": ({"runtime": {"replicas": 3}}, ["replicas"]),
    "store-type": ({"artifactStore": {"type": "gcs"}}, ["type"]),
    "s3-without-bucket": ({"artifactStore": {"type": "s3"}}, ["bucket"]),
    "redis-url-with-password": (
        {"redis": {"enabled": False, "url": "redis://:hunter2@redis:6379/0"}},
        ["url"],
    ),
    "gpu-queue-on-cpu-pool": (
        {"cpuWorkers": {"pools": [{"name": "x", "queues": ["cuda.sm_90"]}]}},
        ["queues"],
    ),
    "pool-without-queues": ({"cpuWorkers": {"pools": [{"name": "x", "queues": []}]}}, ["queues"]),
    "pool-named-gpu": ({"cpuWorkers": {"pools": [{"name": "gpu", "queues": ["cpu"]}]}}, ["name"]),
    # null deletes a default in Helm: a container without requests.
    "resources-without-requests": ({"api": {"resources": {"requests": None}}}, ["requests"]),
    "gpu-arch": ({"gpuWorkers": {"arch": "hopper"}}, ["arch"]),
    "hpa-percent": (
        {"api": {"autoscaling": {"targetCPUUtilizationPercentage": 250}}},
        ["targetCPUUtilizationPercentage"],
    ),
}


def merged(values: dict) -> dict:
    """values.yaml overlaid with `values` as Helm coalesces them: dicts merge, null deletes."""

    def overlay(base, top):
        if isinstance(base, dict) and isinstance(top, dict):
            out = {k: overlay(base[k], v) if k in base else v for k, v in top.items()}
            out |= {k: v for k, v in base.items() if k not in top}
            return {k: v for k, v in out.items() if v is not None}
        return top

    return overlay(DEFAULTS, values)


def test_schema_is_valid_draft_7():
    jsonschema.Draft7Validator.check_schema(SCHEMA)
    assert SCHEMA["additionalProperties"] is False  # unknown top-level keys are refused


def test_defaults_follow_the_schema():
    jsonschema.Draft7Validator(SCHEMA).validate(DEFAULTS)
    # And the schema describes every default key (nothing is accepted only by accident).
    assert set(DEFAULTS) <= set(SCHEMA["properties"])


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_value_sets_follow_the_schema(name):
    jsonschema.Draft7Validator(SCHEMA).validate(merged(VALUE_SETS[name]))


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_helm_refuses_bad_values_with_a_clear_message(case):
    values, words = BAD_VALUES[case]
    with helm.Chart.load(str(CHART)) as chart, pytest.raises(helm.HelmValuesError) as err:
        chart.render(values, name="kiln", namespace="kiln")
    message = str(err.value)
    for word in words:
        assert word in message, message
    # The same values fail the schema alone (what editors and CI use).
    errors = list(jsonschema.Draft7Validator(SCHEMA).iter_errors(merged(values)))
    assert errors


def test_wrong_type_in_a_values_file_is_reported_by_check_jsonschema(tmp_path):
    bad = tmp_path / "values-prod.yaml"
    bad.write_text("api:\n  replicaCount: two\n")
    result = subprocess.run(
        [
            BIN / "check-jsonschema",
            "--schemafile",
            str(CHART / "values.schema.json"),
            "--no-cache",
            str(bad),
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "api.replicaCount" in result.stdout, result.stdout
    assert "'two' is not of type 'integer'" in result.stdout, result.stdout


def test_values_file_with_wrong_type_fails_helm_lint(tmp_path):
    report = helm.lint(str(CHART), {"api": {"replicaCount": "two"}}, strict=True)
    text = json.dumps(report)
    assert report["errors"] or any(m["severity"] >= 3 for m in report["messages"])
    assert "replicaCount" in text


@pytest.mark.parametrize(
    "values, words",
    [
        ({"redis": {"enabled": True, "existingSecret": "kiln-redis"}}, ["not both"]),
        ({"redis": {"enabled": False}}, ["redis.existingSecret"]),
        ({"compile": {"softTimeLimit": 600, "hardTimeLimit": 600}}, ["hardTimeLimit"]),
    ],
)
def test_inconsistent_values_fail_rendering(values, words):
    with helm.Chart.load(str(CHART)) as chart, pytest.raises(helm.HelmError) as err:
        chart.render(values, name="kiln", namespace="kiln")
    for word in words:
        assert word in str(err.value)
