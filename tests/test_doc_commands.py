"""Every concrete ``elastic-ops …`` command in the README and docs/ parses with the real command
line (subcommands, options and choices as documented); synopsis lines (``[--opt X]``, ``a|b``)
are left out. Keeps the documents in step with the CLI."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from elastic_ops.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
_ENV = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)+")


def documented_commands() -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        for block in re.findall(r"```[a-z]*\n(.*?)```", doc.read_text(), re.S):
            for line in block.splitlines():
                line = line.split(" #", 1)[0].strip()
                line = line.removeprefix("ExecStart=/opt/elastic-ops/bin/").removeprefix(".venv/bin/")
                line = _ENV.sub("", line)
                if not line.startswith("elastic-ops ") or re.search(r"[\[\]|…]|\.\.\.", line):
                    continue
                if any(re.fullmatch(r"[A-Z]+", t) and t != "JOB" for t in line.split()[1:]):
                    continue  # a synopsis: placeholders (P, MIN, DAYS) where values go
                found.append((doc.name, line))
    return found


COMMANDS = documented_commands()


def test_the_documents_have_commands_to_check():
    assert len(COMMANDS) >= 20 and {d for d, _ in COMMANDS} >= {"README.md", "deploy.md", "runtime.md"}


@pytest.mark.parametrize(("doc", "line"), COMMANDS)
def test_a_documented_command_parses(doc, line):
    argv = shlex.split(line)[1:]
    try:
        build_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"{doc}: `{line}` does not parse (exit {exc.code})")
