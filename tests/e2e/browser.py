"""A real browser for the UI tests: Debian's ``chromium`` (apt-get install chromium
chromium-driver), driven by Playwright for Python through ``executable_path`` (Playwright's own
browser download is not used). Without it the test is skipped, or fails when
``ELASTIC_OPS_REQUIRE_SERVICES=1`` (CI, whose ``.ci/run`` installs it)."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REQUIRE_SERVICES

# headless Chromium as root in a container, and nothing reaching out of the machine
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
REPO = Path(__file__).resolve().parents[2]


def artifacts_dir() -> Path:
    """Where screenshots go: ``$ELASTIC_OPS_TEST_ARTIFACTS/ui`` (default ``test-artifacts/ui``)."""
    root = Path(os.environ.get("ELASTIC_OPS_TEST_ARTIFACTS") or REPO / "test-artifacts")
    path = root / "ui"
    path.mkdir(parents=True, exist_ok=True)
    return path


def chromium_path() -> str:
    """The apt-installed chromium, or skip (CI: fail) saying how to get it."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    try:
        import playwright  # noqa: F401
    except ImportError:
        path = None
    if path:
        return path
    msg = ("needs Chromium and Playwright (apt-get install chromium chromium-driver; "
           "pip install -c constraints.txt -e '.[dev]'; see docs/howto/tests.md)")
    if REQUIRE_SERVICES:
        pytest.fail(f"ELASTIC_OPS_REQUIRE_SERVICES=1 and {msg}")
    pytest.skip(msg)


@contextlib.contextmanager
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    executable = chromium_path()
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


def log_in(context: Any, url: str, user: str, password: str) -> Any:
    """A page of ``context`` logged in through Airflow's login page (opening ``url`` sends there
    first), back on ``url``."""
    page = context.new_page()
    page.set_default_timeout(60_000)
    page.goto(url)
    page.wait_for_url("**/login**")
    page.fill("input[name=username]", user)
    page.fill("input[name=password]", password)
    page.locator("button[type=submit]").click()
    page.wait_for_url(lambda u: "/login" not in u)
    if page.url.rstrip("/") != url.rstrip("/"):  # a login page that goes home, not back
        page.goto(url)
    return page
