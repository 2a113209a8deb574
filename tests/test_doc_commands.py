"""Every concrete ``elastic-ops …`` command in the README and docs/ (every page, subfolders too)
parses with the real command line (subcommands, options and choices as documented); synopsis
lines (``[--opt X]``, ``a|b``) are left out. Keeps the documents in step with the CLI."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from elastic_ops.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
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
                found.append((doc.relative_to(REPO).as_posix(), line))
    return found


COMMANDS = documented_commands()


def test_the_documents_have_commands_to_check():
    pages = {d for d, _ in COMMANDS}
    assert len(COMMANDS) >= 20 and pages >= {"README.md", "docs/tutorial.md", "docs/howto/pool.md",
                                             "docs/howto/agents.md", "docs/deploy.md", "docs/runtime.md"}


@pytest.mark.parametrize(("doc", "line"), COMMANDS)
def test_a_documented_command_parses(doc, line):
    argv = shlex.split(line)[1:]
    try:
        build_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"{doc}: `{line}` does not parse (exit {exc.code})")


# The other commands the documents give: `make TARGET`, and `python -m benchmarks.X …` / `devtools.X`
# (each benchmark's figure names the command that measures it, docs/benchmarks.md).
_MODULE_CMD = re.compile(r"`(?:\.venv/bin/)?python -m ((?:benchmarks|devtools)\.\w+)([^`]*)`")


def _texts() -> list[tuple[str, str]]:
    return [(doc.relative_to(REPO).as_posix(), doc.read_text()) for doc in DOCS]


def test_every_documented_make_target_exists():
    targets = set(re.findall(r"^([a-z][\w-]*):", (REPO / "Makefile").read_text(), re.M))
    named = {(d, t) for d, text in _texts()
             for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
             for t in re.findall(r"^make ([a-z][\w-]*)", block, re.M)}
    named |= {(d, t) for d, text in _texts() for t in re.findall(r"`make ([a-z][\w-]*)`", text)}
    assert {t for _, t in named} >= {"demo", "test", "setup"}
    assert not [(d, t) for d, t in named if t not in targets]


def test_every_documented_script_exists():
    script = re.compile(r"^(?:[A-Z_]+=\S*\s+)*(?:bash )?((?:\.ci|benchmarks|devtools|docker)/[\w./-]+)", re.M)
    scripts = {(d, m) for d, text in _texts() for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
               for m in script.findall(block)}
    assert {m for _, m in scripts} >= {".ci/run", "benchmarks/device_check.sh"}
    assert not [(d, m) for d, m in scripts if not (REPO / m).is_file()]


MODULE_COMMANDS = sorted({(d, m, a.strip()) for d, text in _texts() for m, a in _MODULE_CMD.findall(text)
                          if not re.search(r"[\[\]|…]", a)})


class _Parsed(Exception):
    pass


@pytest.mark.parametrize(("doc", "module", "args"), MODULE_COMMANDS)
def test_a_documented_benchmark_or_devtools_command_parses(doc, module, args, monkeypatch):
    import argparse
    import importlib
    import inspect
    import sys

    assert (REPO / (module.replace(".", "/") + ".py")).is_file(), f"{doc}: no module {module}"
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, argv=None, namespace=None):
        original(self, argv, namespace)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    argv = shlex.split(args)
    main = importlib.import_module(module).main
    monkeypatch.setattr(sys, "argv", [module, *argv])
    try:
        main(argv) if inspect.signature(main).parameters else main()
    except _Parsed:
        return
    except SystemExit as exc:
        pytest.fail(f"{doc}: `python -m {module} {args}` does not parse (exit {exc.code})")
    pytest.fail(f"{doc}: `python -m {module}` parsed no arguments with argparse")
