"""The share of annotated function parameters typed exactly ``Any`` (issue 21's measure).

Counts every annotated parameter (positional, keyword-only, ``*args``, ``**kwargs``) of every
function and method under the given folder, and those annotated ``Any`` or ``typing.Any``
exactly (``dict[str, Any]`` is not counted as ``Any``). The goal: at most 3 %. Usage::

    python -m devtools.any_share [elastic_ops] [--top N]

Prints ``ANY/TOTAL = SHARE%`` and the files with the most, one per line.
"""

from __future__ import annotations

import argparse
import ast
import collections
from pathlib import Path

ANY = ("Any", "typing.Any")


def any_share(root: Path) -> tuple[int, int, collections.Counter[str]]:
    """(parameters typed ``Any``, annotated parameters, ``Any`` per file) under ``root``."""
    per_file: collections.Counter[str] = collections.Counter()
    total = 0
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            a = node.args
            params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *(p for p in (a.vararg, a.kwarg) if p)]
            for p in params:
                if p.annotation is None:
                    continue
                total += 1
                if ast.unparse(p.annotation) in ANY:
                    per_file[str(path)] += 1
    return sum(per_file.values()), total, per_file


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", default="elastic_ops", type=Path)
    parser.add_argument("--top", type=int, default=25, help="files to list (most Any first)")
    args = parser.parse_args(argv)
    anys, total, per_file = any_share(args.root)
    print(f"{anys}/{total} = {100 * anys / max(total, 1):.2f}%")
    for name, count in per_file.most_common(args.top):
        print(count, name)


if __name__ == "__main__":
    main()
