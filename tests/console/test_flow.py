"""The whole flow through the console's pages, as a user clicks it: sign in, upload the MLP,
compile it with a small tuning budget while the progress and the curves update, read the
artifact, deploy it, and try an inference whose top class matches ONNX Runtime's."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from tests.console.conftest import SCREENSHOTS, Console

TRIALS = 32  # a batch for each of the MLP's four tasks (the latency estimate needs all), quick
JOB_SECONDS = 240


def test_upload_compile_tune_deploy_and_infer(console: Console, mlp_path, tmp_path):
    console.sign_in("alice")
    assert console.driver.title.endswith("Kiln console")

    # Models: upload with the file picker; the model's page opens with its signature.
    console.wait_for("#upload-input").send_keys(str(mlp_path))
    console.wait_until(lambda: "#/models/m-" in console.driver.current_url, what="model page")
    console.wait_for("#op-histogram")
    page = console.text("#main")
    assert "Gemm" in page and "784" in page
    console.screenshot("model")

    # Compile: shapes x=1,784 and a small trial budget.
    console.fill("#shape-x", "1,784")
    from selenium.webdriver.support.ui import Select

    Select(console.find("#tuning-mode")).select_by_value("trials")
    console.fill("#tuning-value", str(TRIALS))
    console.click("#compile-submit")
    console.wait_until(lambda: "#/compilations/c-" in console.driver.current_url, what="job page")

    # Watch it: the stage moves, the tasks' curves and the latency estimate gain points.
    seen_points, seen_stages = set(), set()

    def finished():
        # One lookup, not "is it there? then find it": the page re-renders the stage list
        # while it polls, so the element can go between two lookups.
        current = console.find_all("#job-stages li.current")
        seen_stages.add(current[0].text if current else "")
        seen_points.add(points("#curves canvas"))
        return console.find_all(
            '#job-status [data-status="done"], #job-status [data-status="failed"]'
        )

    def points(css: str) -> int:
        return sum(int(c.get_attribute("data-points") or 0) for c in console.find_all(css))

    console.wait_until(finished, JOB_SECONDS, "the compilation to end")
    assert not console.find_all("#job-error"), console.text("#job-error")
    console.wait_for("#job-artifact")
    final_points = points("#curves canvas")
    assert final_points >= 2, "a curve point per measured batch"
    # An estimate per batch once every task has been measured once (none before).
    assert 1 <= points("#curve-latency") <= final_points
    assert len(seen_points | {final_points}) >= 2, "the curve grew while the page watched"
    assert "tuning" in seen_stages or "building" in seen_stages, seen_stages
    assert console.find("#job-latency").text.endswith("ms")
    console.screenshot("compilation")
    console.driver.set_window_size(800, 1000)
    console.driver.execute_script("window.scrollTo(0, 0)")
    console.screenshot("compilation-800")
    console.driver.set_window_size(1400, 1000)

    # The artifact: kernels tuned or default, the verification error, a deploy form.
    console.click("#job-artifact")
    console.wait_for("#kernels tbody tr")
    schedules = {r.get_attribute("data-schedule") for r in console.find_all("#kernels tbody tr")}
    assert "tuned" in schedules, schedules
    assert "e-" in console.text("#verification-error")
    assert "workspace" in console.text("#artifact-memory")
    assert "%" in console.text("#kernels"), "a tuned kernel's share of the model's time"
    console.screenshot("artifact")

    # Deploy, then try an inference with an uploaded .npy, compared with ONNX Runtime.
    console.fill("#deploy-name", "mlp")
    console.click("#deploy-submit")
    console.wait_until(lambda: "#/deployments/mlp" in console.driver.current_url, what="deploy")
    console.wait_for('#deployment-stats [data-status="READY"]', 60)
    x = np.random.default_rng(7).standard_normal((1, 784)).astype(np.float32)
    npy = tmp_path / "x.npy"
    np.save(npy, x)
    console.find("#npy-x").send_keys(str(npy))
    console.click("#infer-submit")
    shown = int(console.text("#top-class"))
    session = ort.InferenceSession(str(mlp_path), providers=["CPUExecutionProvider"])
    (expected,) = session.run(None, {"x": x})
    assert shown == int(np.argmax(expected[0]))

    # Random inputs work too, and the runtime's counters show both requests.
    console.find("#npy-x").clear()
    console.click("#infer-submit")
    console.wait_until(lambda: console.find_all("#top-class"), what="a second answer")
    console.wait_until(lambda: int(console.text("#stat-requests")) >= 2, 15, "2 requests counted")
    console.screenshot("deployment")

    # The lists and the tuning log.
    console.open("/deployments")
    console.wait_for('#deployments tr[data-deployment="mlp"] [data-status="READY"]')
    console.screenshot("deployments")
    console.open("/compilations")
    console.wait_for("#compilations tbody tr")
    console.screenshot("compilations")
    console.open("/models")
    console.wait_for("#models tbody tr")
    console.screenshot("models")
    console.open("/tuning")
    rows = console.wait_for("#tuning tbody tr")
    trials = sum(
        int(r.find_elements("css selector", "td.num")[0].text)
        for r in console.find_all("#tuning tbody tr")
    )
    assert rows and trials >= TRIALS, trials
    console.screenshot("tuning")

    errors = console.console_errors()
    assert not errors, errors
    assert (SCREENSHOTS / "compilation.png").exists()
