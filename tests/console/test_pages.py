"""The console's pages one by one: a clean first load, sign-in, the problem detail of a bad
upload, and tenant isolation (lists, and a pasted URL of another tenant's objects)."""

from __future__ import annotations

import httpx
import pytest

from tests.console.conftest import MAX_UPLOAD, Console, api_client
from tests.e2e.platform import Platform

# How Chromium logs a 4xx answer (as a SEVERE network entry), before the status.
REFUSED = "Failed to load resource: the server responded with a status of"


@pytest.fixture(scope="module")
def alices_objects(platform: Platform, mlp_path) -> dict:
    """Alice's model, a finished (untuned) compilation and a deployment, made over the API."""
    with api_client(platform, "alice") as client:
        model = client.post(
            "/v1/models",
            content=mlp_path.read_bytes(),
            headers={"Content-Type": "application/octet-stream", "X-Model-Name": "alices-mlp"},
        ).json()
        job = client.post(
            "/v1/compilations",
            json={"model": model["id"], "target": "llvm", "shapes": {"x": [1, 784]}},
        ).json()
        done = platform.wait_job(job["id"], seconds=120)
        assert done["status"] == "done", done
        deployed = client.post(
            "/v1/deployments", json={"artifact": done["artifact"], "name": "alices-mlp"}
        )
        assert deployed.status_code == 201, deployed.text
    return {"model": model, "job": done}


def test_the_first_page_loads_clean(console: Console):
    console.open()
    console.wait_for("#signin-key")
    assert console.driver.current_url.endswith("/ui/")
    assert "Kiln console" in console.driver.title
    console.screenshot("signin")
    assert not console.console_errors()


def test_a_wrong_key_is_refused_with_the_problem(console: Console):
    console.open("/models")
    console.fill("#signin-key", "not-a-key")
    console.click("#signin-submit")
    assert "not valid" in console.text(".problem")
    assert console.find_all("#nav[hidden]"), "still signed out"
    assert not console.console_errors(allow=(f"/v1/models - {REFUSED} 401",))


def test_a_non_onnx_upload_shows_the_problem_detail(console: Console, tmp_path):
    console.sign_in("alice")
    junk = tmp_path / "notes.onnx"
    junk.write_text("these are not the protobuf bytes of a model")
    console.wait_for("#upload-input").send_keys(str(junk))
    problem = console.wait_for("#upload-message .problem")
    assert "Invalid ONNX model" in problem.text
    assert problem.get_attribute("data-status") == "422"
    assert "#/models" in console.driver.current_url  # still on the list, nothing blank
    console.screenshot("bad-upload")
    assert not console.console_errors(allow=(f"/v1/models - {REFUSED} 422",))


def test_a_dropped_file_is_uploaded(console: Console):
    console.sign_in("alice")
    zone = console.wait_for("#dropzone")
    # What a drop from the desktop delivers: a DataTransfer holding one File.
    console.driver.execute_script(
        """
        const data = new DataTransfer();
        data.items.add(new File(["not a model"], "dropped.onnx"));
        arguments[0].dispatchEvent(new DragEvent("drop", {dataTransfer: data, bubbles: true}));
        """,
        zone,
    )
    problem = console.wait_for("#upload-message .problem")
    assert "Invalid ONNX model" in problem.text
    assert not console.console_errors(allow=(f"/v1/models - {REFUSED} 422",))


def test_an_oversize_upload_shows_the_problem_detail(console: Console, tmp_path):
    console.sign_in("alice")
    big = tmp_path / "big.onnx"
    big.write_bytes(b"\0" * (MAX_UPLOAD + (1 << 20)))
    console.wait_for("#upload-input").send_keys(str(big))
    problem = console.wait_for("#upload-message .problem", 60)
    assert problem.get_attribute("data-status") == "413"
    assert "Content Too Large" in problem.text and "larger than" in problem.text, problem.text
    assert not console.console_errors(allow=(f"/v1/models - {REFUSED} 413",))


def test_a_second_tenant_sees_none_of_the_firsts_objects(
    console: Console, platform: Platform, alices_objects
):
    with api_client(platform, "bob") as bob:
        assert bob.get("/v1/models").json() == {"models": []}

    console.sign_in("alice")
    console.wait_for(f'#models tr[data-model="{alices_objects["model"]["id"]}"]')
    console.sign_out()

    console.sign_in("bob")
    for route, table in (
        ("/models", "#models"),
        ("/compilations", "#compilations"),
        ("/deployments", "#deployments"),
    ):
        console.open(route)
        console.wait_for("#main h1")
        console.wait_for("#main .empty")
        assert not console.find_all(table), route
        assert alices_objects["model"]["id"] not in console.text("#main")
    assert not console.console_errors()


@pytest.mark.parametrize(
    "route",
    [
        "/compilations/{job}",
        "/models/{model}",
        "/artifacts/{artifact}",
        "/deployments/alices-mlp",
    ],
)
def test_a_pasted_url_of_another_tenants_object_is_not_found(
    console: Console, alices_objects, route
):
    path = route.format(
        job=alices_objects["job"]["id"],
        model=alices_objects["model"]["id"],
        artifact=alices_objects["job"]["artifact"],
    )
    console.sign_in("bob")
    console.open(path)
    problem = console.wait_for('#main .problem[data-status="404"]')
    assert problem.text.startswith("Not found")
    if "compilations" in route:
        console.screenshot("not-found")
    assert not console.console_errors(allow=("status of 404",))

    # The owner opens the same URL. An artifact's page asks for the artifact and its kernels:
    # the second 404 may come back after the problem is shown, so Bob's page is left (its
    # requests end there) and its 404s drained before Alice's page is checked.
    console.sign_out()
    assert not console.console_errors(allow=("status of 404",))
    console.sign_in("alice")
    console.open(path)
    console.wait_for("#main h1")
    console.wait_until(lambda: "Loading" not in console.text("#main"), what="the page")
    assert not console.find_all("#main .problem"), console.text("#main")
    assert not console.console_errors()


def test_the_tuning_log_page_reads_an_empty_log(console: Console):
    console.sign_in("bob")
    console.open("/tuning")
    assert "0 records" in console.text("#tuning-summary")
    assert not console.console_errors()


def test_the_console_routes_refuse_without_a_key(platform: Platform):
    for path in ("/v1/tuning", "/v1/deployments/x/stats"):
        response = httpx.get(platform.api + path)
        assert response.status_code == 401
        assert response.headers["content-type"].startswith("application/problem+json")
