"""Headless Chromium for the report pages' tests: Debian's chromium and chromedriver driven by Selenium, offline,
with a fresh profile; `browser()` skips the test with the reason where either cannot be had."""

from __future__ import annotations

import json
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
)


def _find(*names: str) -> str | None:
    return next((found for name in names if (found := shutil.which(name))), None)


@contextmanager
def browser(width: int = 1400, height: int = 1000):
    """A Selenium Chrome driver on the system chromium (browser console and performance logs on)."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install .[test])")
    from selenium.webdriver.chrome.service import Service

    binary = _find("chromium", "chromium-browser")
    driver_path = _find("chromedriver")
    if binary is None or driver_path is None:
        pytest.skip("no chromium and chromedriver on PATH (Debian: apt-get install chromium chromium-driver)")
    profile = tempfile.mkdtemp(prefix="chromium-profile-")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    try:
        driver = webdriver.Chrome(service=Service(driver_path), options=options)
    except Exception as error:  # a chromium that cannot start here (no shared memory, a mismatched driver)
        shutil.rmtree(profile, ignore_errors=True)
        pytest.skip(f"chromium could not start: {str(error).splitlines()[0]}")
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def open_page(driver, path: Path) -> list[str]:
    """Load a file and return the URL of every request made by it or from it (the CDP network log; the browser's
    own new-tab page, loaded before, is another document)."""
    url = path.resolve().as_uri()
    driver.get(url)
    requests = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message.get("method") == "Network.requestWillBeSent" and message["params"].get("documentURL") == url:
            requests.append(message["params"]["request"]["url"])
    return requests


def console_errors(driver) -> list[dict]:
    return [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
