"""The web console in a real browser: Debian's headless Chromium driven by Selenium, against
`kiln serve` on free loopback ports with two tenants.

Screenshots of every page land in build/console-screenshots/ (ignored by git).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import shared_model
from tests.e2e.platform import Platform, kiln_serve

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
KEYS = {"alice": "console-key-alice", "bob": "console-key-bob"}
MAX_UPLOAD = 10_000_000  # above the MLP (7.5 MB), so that an oversize upload is cheap to make
SCREENSHOTS = Path(__file__).resolve().parents[2] / "build" / "console-screenshots"
WAIT = 20.0


@pytest.fixture(scope="module")
def platform(tmp_path_factory) -> Iterator[Platform]:
    keys = ",".join(f"{tenant}:{key}" for tenant, key in KEYS.items())
    env = {"KILN_API_KEYS": keys, "KILN_MAX_UPLOAD_BYTES": str(MAX_UPLOAD)}
    with kiln_serve(tmp_path_factory.mktemp("console"), KEYS["alice"], extra_env=env) as served:
        yield served


@pytest.fixture(scope="module")
def mlp_path() -> Path:
    return shared_model("mlp")


def api_client(platform: Platform, tenant: str) -> httpx.Client:
    return httpx.Client(base_url=platform.api, headers={"X-API-Key": KEYS[tenant]}, timeout=60)


class Console:
    """One browser tab on the console, with the waits and checks the tests share."""

    def __init__(self, driver, base: str):
        self.driver, self.base = driver, base

    def open(self, route: str = "") -> None:
        url = f"{self.base}/ui/#{route}" if route else f"{self.base}/ui"
        # Going to the URL already shown changes nothing (not even a hashchange): reload.
        if self.driver.current_url == url:
            self.driver.refresh()
        else:
            self.driver.get(url)

    def sign_in(self, tenant: str) -> None:
        self.open("/models")
        self.fill("#signin-key", KEYS[tenant])
        self.click("#signin-submit")
        self.wait_for("#nav:not([hidden])")

    def sign_out(self) -> None:
        self.driver.execute_script("sessionStorage.clear()")
        self.driver.refresh()

    def find(self, css: str):
        from selenium.webdriver.common.by import By

        return self.driver.find_element(By.CSS_SELECTOR, css)

    def find_all(self, css: str) -> list:
        from selenium.webdriver.common.by import By

        return self.driver.find_elements(By.CSS_SELECTOR, css)

    def fill(self, css: str, text: str) -> None:
        element = self.wait_for(css)
        element.clear()
        element.send_keys(text)

    def click(self, css: str) -> None:
        self.wait_for(css).click()

    def wait_for(self, css: str, seconds: float = WAIT):
        return self.wait_until(lambda: (self.find_all(css) or [None])[0], seconds, css)

    def wait_until(self, predicate, seconds: float = WAIT, what: str = "condition"):
        from selenium.common.exceptions import StaleElementReferenceException

        deadline = time.monotonic() + seconds
        while True:
            with contextlib.suppress(StaleElementReferenceException):
                value = predicate()
                if value:
                    return value
            if time.monotonic() > deadline:
                self.screenshot("timeout")
                main = self.find_all("#main")
                text = main[0].text[:1500] if main else ""
                raise AssertionError(f"waited {seconds} s for {what}; page:\n{text}")
            time.sleep(0.1)

    def text(self, css: str) -> str:
        return self.wait_for(css).text

    def screenshot(self, name: str) -> Path:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        path = SCREENSHOTS / f"{name}.png"
        self.driver.save_screenshot(str(path))
        return path

    def console_errors(self, allow: tuple[str, ...] = ()) -> list[str]:
        """SEVERE browser log entries since the last call. Chromium logs every 4xx answer as a
        SEVERE network entry, so the ones a test provokes on purpose are named in `allow`
        (a substring of the entry, e.g. the route and status)."""
        entries = self.driver.get_log("browser")
        return [
            e["message"]
            for e in entries
            if e["level"] == "SEVERE" and not any(word in e["message"] for word in allow)
        ]


@pytest.fixture(scope="module")
def driver():
    if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
        pytest.fail(f"the console tests need {CHROMIUM} and {CHROMEDRIVER} (Debian packages)")
    from selenium import webdriver

    options = webdriver.ChromeOptions()
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--no-first-run",
        "--disable-dev-shm-usage",
        "--window-size=1400,1000",
    ):
        options.add_argument(argument)
    options.binary_location = CHROMIUM
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = webdriver.ChromeService(CHROMEDRIVER)
    browser = webdriver.Chrome(options=options, service=service)
    try:
        yield browser
    finally:
        browser.quit()


@pytest.fixture
def console(driver, platform) -> Iterator[Console]:
    tab = Console(driver, platform.api)
    tab.open()
    tab.sign_out()
    driver.get_log("browser")  # start each test with an empty log
    yield tab
    tab.sign_out()
