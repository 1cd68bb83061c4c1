"""Headless Chromium for the playground's browser tests and screenshots: Debian's ``chromium`` and
``chromium-driver`` packages driven by Selenium (``./dev browser`` installs all three)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
from typing import Iterator

import pytest

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")
DRIVER_NAMES = ("chromedriver", "chromium-driver")


def find_chromium() -> tuple[str, str] | None:
    """``(browser, driver)`` executables, or None. ``PAGEDSERVE_CHROMIUM`` / ``PAGEDSERVE_CHROMEDRIVER``
    override the search on ``PATH``."""
    def first(variable: str, names: tuple[str, ...]) -> str | None:
        chosen = os.environ.get(variable)
        return shutil.which(chosen) if chosen else next(filter(None, map(shutil.which, names)), None)

    browser = first("PAGEDSERVE_CHROMIUM", CHROMIUM_NAMES)
    driver = first("PAGEDSERVE_CHROMEDRIVER", DRIVER_NAMES)
    return (browser, driver) if browser and driver else None


def skip_without_chromium() -> tuple[str, str]:
    found = find_chromium()
    if found is None:
        pytest.skip("no headless Chromium: install Debian's chromium and chromium-driver (`./dev browser` does, "
                    "with selenium), or set PAGEDSERVE_CHROMIUM and PAGEDSERVE_CHROMEDRIVER")
    if importlib.util.find_spec("selenium") is None:
        pytest.skip("selenium is not installed (`./dev browser` or `pip install -e '.[test]'`)")
    return found


@contextlib.contextmanager
def chromium(width: int = 1440, height: int = 900, scale: float = 1.0) -> Iterator["object"]:
    """A headless Chromium session (a Selenium WebDriver), closed on exit."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    found = find_chromium()
    if found is None:
        raise RuntimeError("no Chromium: see skip_without_chromium")
    browser, driver_path = found
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-extensions", f"--window-size={width},{height}", f"--force-device-scale-factor={scale}"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(driver_path))
    try:
        yield driver
    finally:
        driver.quit()


def wait_js(driver, script: str, timeout_s: float = 60.0, *args):
    """Poll ``script`` (a JS function body returning a value) until it is truthy; returns it."""
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout_s, poll_frequency=0.05).until(lambda d: d.execute_script(script, *args))


def console_errors(driver) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]
