"""The documentation builds as a site (``mkdocs build --strict``: every page in the nav, every
relative link and anchor resolving), and the README stays short and points into it."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REQUIRE_SERVICES

REPO = Path(__file__).resolve().parents[1]


def _require_mkdocs() -> None:
    if importlib.util.find_spec("mkdocs") is not None:
        return
    msg = "needs mkdocs (`make setup` installs it with the dev dependencies)"
    if REQUIRE_SERVICES:  # CI installs the dev dependencies: a skip there would hide a broken site
        pytest.fail(f"ELASTIC_OPS_REQUIRE_SERVICES=1 and {msg}")
    pytest.skip(msg)


def test_the_site_builds_strictly(tmp_path):
    _require_mkdocs()
    site = tmp_path / "site"
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    for page in ("index.html", "tutorial/index.html", "howto/troubleshooting/index.html",
                 "reference/spec/index.html", "explanation/elasticity/index.html", "benchmarks/index.html"):
        assert (site / page).is_file(), page


def test_every_page_is_in_the_nav():
    nav = (REPO / "mkdocs.yml").read_text()
    pages = {p.relative_to(REPO / "docs").as_posix() for p in (REPO / "docs").rglob("*.md")}
    missing = sorted(p for p in pages if not re.search(rf":\s*{re.escape(p)}\s*$", nav, re.M))
    assert not missing, f"pages not in mkdocs.yml's nav: {missing}"


def test_the_readme_is_short_and_links_into_the_docs():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 80, "the README should fit on two screens"
    links = re.findall(r"\]\((docs/[^)#]+)", readme)
    assert "docs/benchmarks.md" in links and "docs/tutorial.md" in links
    for link in links:
        assert (REPO / link).is_file(), link


def test_no_fenced_block_is_indented():
    """Python-Markdown (MkDocs) does not render a fenced block nested in a list item: it shows up as
    inline text. Keep fences at the margin, between list items if need be."""
    nested = [f"{p.relative_to(REPO)}:{n}" for p in [REPO / "README.md", *(REPO / "docs").rglob("*.md")]
              for n, line in enumerate(p.read_text().splitlines(), 1) if re.match(r"\s+```", line)]
    assert not nested, nested
