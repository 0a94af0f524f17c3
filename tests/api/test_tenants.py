"""Tenants are walled off: another tenant's model, compilation, artifact and deployment answer
404 at every route, exactly like a missing one, and never show up in a listing."""

from __future__ import annotations

import pytest

from tests.api.conftest import (
    IN,
    KEYS,
    assert_problem,
    make_client,
    mlp_model,
    upload,
    wait_for_job,
)

DEPLOYMENT = "tenant-a-mlp"


@pytest.fixture(scope="module")
def owned(stack):
    """Tenant a's model, finished compilation, artifact and deployment."""
    with make_client(stack.api_url, KEYS["a"]) as client:
        model = upload(client, mlp_model(scale=-1.0)).json()
        body = {"model": model["id"], "target": "llvm", "shapes": {"x": [1, IN]}}
        job = wait_for_job(client, client.post("/v1/compilations", json=body).json()["id"])
        assert job["status"] == "done", job
        deployment = client.post(
            "/v1/deployments", json={"artifact": job["artifact"], "name": DEPLOYMENT}
        )
        assert deployment.status_code == 201, deployment.text
        yield {"model": model, "job": job, "artifact": job["artifact"]}
        client.delete(f"/v1/deployments/{DEPLOYMENT}")


def routes(owned: dict) -> list[tuple[str, str, dict | None]]:
    model, job, artifact = owned["model"]["id"], owned["job"]["id"], owned["artifact"]
    return [
        ("GET", f"/v1/models/{model}", None),
        ("POST", "/v1/compilations", {"model": model, "target": "llvm"}),
        ("GET", f"/v1/compilations/{job}", None),
        ("DELETE", f"/v1/compilations/{job}", None),
        ("GET", f"/v1/compilations/{job}/events", None),
        ("GET", f"/v1/artifacts/{artifact}", None),
        ("GET", f"/v1/artifacts/{artifact}/manifest", None),
        ("POST", "/v1/deployments", {"artifact": artifact, "name": "b-steals"}),
        ("GET", f"/v1/deployments/{DEPLOYMENT}", None),
        ("DELETE", f"/v1/deployments/{DEPLOYMENT}", None),
    ]


def test_another_tenants_resources_are_404_at_every_route(client_a, client_b, owned):
    for method, path, body in routes(owned):
        response = client_b.request(method, path, json=body)
        problem = assert_problem(response, 404)
        # The same answer as for an id that does not exist at all.
        assert problem["title"] == "Not Found", (method, path, problem)
    # And nothing of tenant a's changed.
    assert client_a.get(f"/v1/compilations/{owned['job']['id']}").json() == owned["job"]
    assert client_a.get(f"/v1/deployments/{DEPLOYMENT}").status_code == 200
    assert client_b.get("/v1/deployments/b-steals").status_code == 404


def test_listings_show_nothing_of_another_tenant(client_a, client_b, owned):
    assert owned["model"]["id"] in ids(client_a.get("/v1/models").json()["models"])
    assert owned["job"]["id"] in ids(client_a.get("/v1/compilations").json()["compilations"])
    assert DEPLOYMENT in names(client_a.get("/v1/deployments").json()["deployments"])

    assert owned["model"]["id"] not in ids(client_b.get("/v1/models").json()["models"])
    assert owned["job"]["id"] not in ids(client_b.get("/v1/compilations").json()["compilations"])
    assert DEPLOYMENT not in names(client_b.get("/v1/deployments").json()["deployments"])


def test_a_deployment_name_taken_by_another_tenant_is_409(client_b, owned):
    # Tenant b compiles its own model, then tries tenant a's deployment name.
    model = upload(client_b, mlp_model(scale=-2.0)).json()
    body = {"model": model["id"], "target": "llvm", "shapes": {"x": [1, IN]}}
    job = wait_for_job(client_b, client_b.post("/v1/compilations", json=body).json()["id"])
    assert job["status"] == "done", job
    response = client_b.post(
        "/v1/deployments", json={"artifact": job["artifact"], "name": DEPLOYMENT}
    )
    assert_problem(response, 409, DEPLOYMENT, "taken")
    # b's artifact is still b's alone.
    assert client_b.get(f"/v1/artifacts/{job['artifact']}").status_code == 200


def test_uploading_the_same_bytes_gives_each_tenant_its_own_record(client_a, client_b, owned):
    again = upload(client_b, mlp_model(scale=-1.0))
    assert again.status_code == 201
    assert again.json()["digest"] == owned["model"]["digest"]
    assert again.json()["id"] in ids(client_b.get("/v1/models").json()["models"])
    # b's record does not open tenant a's compilation or artifact to b.
    assert client_b.get(f"/v1/compilations/{owned['job']['id']}").status_code == 404


def ids(records: list[dict]) -> list[str]:
    return [r["id"] for r in records]


def names(records: list[dict]) -> list[str]:
    return [r["name"] for r in records]
