"""A real browser for the dashboard's tests: headless Chromium driven by Selenium, from the
machine's packages (Debian's ``chromium`` and ``chromium-driver``: ``/usr/bin/chromium`` and
``/usr/bin/chromedriver``).

Selenium never downloads anything here: the driver's path is given, so Selenium Manager is not
run; without either binary the tests skip with :data:`SKIP_REASON`. Fixture: ``browser``
(:class:`Browser`, one Chromium per test module).

>>> Browser.join("http://127.0.0.1:5/delayq", "/jobs?q=a")
'http://127.0.0.1:5/delayq/jobs?q=a'
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
SKIP_REASON = "no chromium/chromedriver: apt-get install chromium chromium-driver"
#: The window every page is seen (and screenshotted) in.
WINDOW = (1400, 1000)
#: ``DELAYQ_SCREENSHOTS=docs/img``: the tests' screenshots are copied there (else only kept in tmp).
SCREENSHOTS_ENV = "DELAYQ_SCREENSHOTS"


def start_chromium() -> Any:
    """A headless Chromium (a Selenium ``WebDriver``) of :data:`WINDOW`, its console logged."""
    if not (CHROMIUM.is_file() and os.access(CHROMIUM, os.X_OK)) or not (
        CHROMEDRIVER.is_file() and os.access(CHROMEDRIVER, os.X_OK)
    ):
        pytest.skip(SKIP_REASON)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in ("--headless=new", f"--window-size={WINDOW[0]},{WINDOW[1]}", "--disable-gpu",
                     "--disable-dev-shm-usage", "--no-first-run", "--disable-extensions",
                     "--hide-scrollbars", "--force-device-scale-factor=1", "--lang=en-US"):  # fmt: skip
        options.add_argument(argument)
    if os.geteuid() == 0:
        options.add_argument("--no-sandbox")  # Chromium refuses to run as root with its sandbox
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    driver.set_window_size(*WINDOW)
    driver.set_page_load_timeout(60)
    return driver


class Browser:
    """A Chromium and what the tests ask of it: open a dashboard path, find elements, read the
    console's errors, wait for a condition, take a screenshot."""

    def __init__(self, driver: Any, shots: Path) -> None:
        self.driver = driver
        self.base = ""
        self.shots = shots

    @staticmethod
    def join(base: str, path: str) -> str:
        return base.rstrip("/") + path

    def open(self, path: str, base: str | None = None) -> None:
        """Load ``path`` of the dashboard at ``base`` (default: the last one opened)."""
        if base is not None:
            self.base = base
        self.driver.get(self.join(self.base, path))

    def find(self, css: str) -> Any:
        from selenium.webdriver.common.by import By

        return self.driver.find_element(By.CSS_SELECTOR, css)

    def find_all(self, css: str) -> list[Any]:
        from selenium.webdriver.common.by import By

        return list(self.driver.find_elements(By.CSS_SELECTOR, css))

    def text(self, css: str) -> str:
        return str(self.find(css).text)

    def path(self) -> str:
        """The current URL less the dashboard's base."""
        url = str(self.driver.current_url)
        return url[len(self.base.rstrip("/")) :] if url.startswith(self.base) else url

    def wait(self, condition: Callable[[], Any], timeout: float = 30.0, what: str = "") -> Any:
        """Poll ``condition`` until it is true; fail with ``what`` and the page's text after
        ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = condition()
            except Exception:  # an element missing or replaced while the page loads
                value = None
            if value:
                return value
            if time.monotonic() > deadline:
                body = self.find("body").text[:2000]
                pytest.fail(
                    f"timed out ({timeout} s) waiting for {what or condition}: at {self.path()}\n{body}"
                )
            time.sleep(0.1)

    def click_and_load(self, css: str, timeout: float = 60.0) -> float:
        """Click ``css`` and wait for the page it leads to: the old page gone (its ``<html>``
        stale), the new one loaded. Returns the seconds that took."""
        from selenium.common.exceptions import StaleElementReferenceException

        old = self.find("html")
        started = time.monotonic()
        self.find(css).click()

        def gone() -> bool:
            try:
                return not old.is_enabled()  # a live <html> is enabled
            except StaleElementReferenceException:
                return True

        self.wait(gone, timeout, f"a new page after clicking {css}")
        self.wait(lambda: self.driver.execute_script("return document.readyState") == "complete", timeout,
                  "the new page to load")  # fmt: skip
        return time.monotonic() - started

    def console_errors(self) -> list[str]:
        """The console's SEVERE messages since the last call (empty when the driver keeps none)."""
        try:
            entries = self.driver.get_log("browser")
        except Exception:  # a driver without the legacy log endpoint
            return []
        return [str(e.get("message")) for e in entries if e.get("level") == "SEVERE"]

    def accept_confirms(self) -> None:
        """Answer every ``window.confirm`` of the page with OK (the buttons with data-confirm)."""
        self.driver.execute_script("window.confirm = function () { return true; };")

    def screenshot(self, name: str) -> Path:
        """The window as ``<name>.png`` in the test's folder, copied into ``$DELAYQ_SCREENSHOTS``
        (``docs/img``) when that is set."""
        self.shots.mkdir(parents=True, exist_ok=True)
        shot = self.shots / f"{name}.png"
        assert self.driver.save_screenshot(str(shot)), f"no screenshot of {self.path()}"
        target = os.environ.get(SCREENSHOTS_ENV)
        if target:
            Path(target).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(shot, Path(target) / shot.name)
        return shot


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    """One headless Chromium for a test module (skips without chromium and chromedriver)."""
    driver = start_chromium()
    try:
        yield Browser(driver, tmp_path_factory.mktemp("screenshots"))
    finally:
        driver.quit()
