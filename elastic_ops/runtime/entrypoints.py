"""Finding a Trainable's module without running it, and the import path a task hands to the
process that runs its chunk. Imports neither torch nor the user's code: tasks and agents use it."""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from elastic_ops.errors import EntrypointError


def find_trainable_module(entrypoint: str, extra_path: Sequence[str] = ()) -> None:
    """Check that the module of ``package.module:Class`` can be found, running none of its
    code nor its packages' (what a long-lived process checks: an import would run the user's
    import-time code there and keep that module, stale, for every later chunk). The top-level
    name is asked of ``sys.meta_path``'s finders, as ``import`` asks them (installed, editable
    and zipped packages); the names below it are looked up in their package's folders, as the
    path finder would. That the class exists is checked where the workers import it.
    ``extra_path``: folders searched after ``sys.path`` (the task's, which the workers add)."""
    if not isinstance(entrypoint, str) or ":" not in entrypoint:
        raise EntrypointError("entrypoint", entrypoint, "must be 'package.module:TrainableClass'")
    module_name = entrypoint.partition(":")[0]
    parts = module_name.split(".")
    locations: list[str] | None = None
    for k, part in enumerate(parts):
        name = ".".join(parts[: k + 1])
        if name in sys.modules:
            found = list(getattr(sys.modules[name], "__path__", None) or []) if k + 1 < len(parts) else []
            kind = "package" if found or k + 1 == len(parts) else "module"
        elif locations is None:
            kind, found = _top_level(name, extra_path)
        else:
            kind, found = _below(part, locations)
        if kind is None or (k + 1 < len(parts) and kind == "module"):
            why = "is not importable" if kind is None else "is not a package"
            raise EntrypointError("entrypoint", entrypoint,
                                  f"module {module_name!r} cannot be found ({name!r} {why})")
        locations = found


def _top_level(name: str, extra_path: Sequence[str] = ()) -> tuple[str | None, list[str]]:
    finders = [lambda f=finder: f.find_spec(name, None) for finder in sys.meta_path]
    if extra_path:
        finders.append(lambda: importlib.machinery.PathFinder.find_spec(name, list(extra_path)))
    for find in finders:
        try:
            spec = find()
        except (AttributeError, ImportError, ValueError):  # a legacy finder, or one that refuses
            continue
        if spec is not None:
            where = spec.submodule_search_locations
            return ("package", list(where)) if where is not None else ("module", [])
    return None, []


def extend_import_path(paths: Sequence[str]) -> None:
    """Append the folders of ``paths`` this process's ``sys.path`` lacks (a worker of an agent:
    the task's DAG, plugins and ``PYTHONPATH`` folders). Appended, not prepended: what this
    process already imports from keeps precedence."""
    for p in paths:
        if p not in sys.path:
            sys.path.append(p)


def task_import_path() -> list[str]:
    """The folders this process imports user code from (the DAG and plugins folders, and
    ``PYTHONPATH``, as Airflow puts them on a task's ``sys.path``): ``sys.path`` less the
    interpreter's own library and site-packages folders, which an agent has of its own."""
    import site
    import sysconfig

    own = {os.path.realpath(p) for p in (*site.getsitepackages(), site.getusersitepackages(),
                                          *(sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib",
                                                                               "purelib", "platlib")))}
    out: list[str] = []
    for p in sys.path:
        if not p or not os.path.isabs(p) or not os.path.isdir(p) or p in out:
            continue  # "" is the task's working directory: not the agent's
        real = os.path.realpath(p)
        if not any(real == o or real.startswith(o + os.sep) for o in own):
            out.append(p)
    return out


def this_process() -> str:
    """How a message names the process it comes from: program, pid and host."""
    import socket

    prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
    return f"{prog} (pid {os.getpid()} on host {socket.gethostname()})"


def _below(part: str, locations: Sequence[str]) -> tuple[str | None, list[str]]:
    """Where ``part`` is in the folders of its package: a package (a folder with ``__init__``),
    a module file, or the portions of a namespace package (folders without one)."""
    portions = []
    for loc in locations:
        base = os.path.join(loc, part)
        if os.path.isdir(base) and any(os.path.isfile(os.path.join(base, "__init__" + x)) for x in _SUFFIXES):
            return "package", [base]
        if any(os.path.isfile(base + x) for x in _SUFFIXES):
            return "module", []
        if os.path.isdir(base):
            portions.append(base)
    return ("package", portions) if portions else (None, [])


_SUFFIXES = tuple(importlib.machinery.all_suffixes())


# --- a Trainable's declared parameters ------------------------------------------------------


def declared_params(cls: type) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """``(accepted, required)``: the ``params`` a Trainable class declares, or ``None`` where it
    declares none (a ``**params`` catch-all: anything goes, unchecked). Declared either by a
    class attribute ``PARAMS`` (parameter names, or a mapping keyed by them, all optional) or by
    explicit keyword arguments of ``__init__`` (those without a default are required). The
    nearest class in the MRO that sets either decides: a subclass whose own ``__init__`` takes
    ``**params`` (to pop a parameter of its own before its base's) declares nothing, though its
    base has ``PARAMS``."""
    import inspect

    for klass in cls.__mro__:
        if "PARAMS" in vars(klass) and vars(klass)["PARAMS"] is not None:
            return tuple(str(n) for n in vars(klass)["PARAMS"]), ()
        if "__init__" in vars(klass):
            break
    else:
        return None
    try:
        sig = inspect.signature(vars(klass)["__init__"])
    except (TypeError, ValueError):  # a C-level __init__: nothing to read
        return None
    args = list(sig.parameters.values())[1:]  # self
    if any(a.kind is inspect.Parameter.VAR_KEYWORD for a in args):
        return None
    by_name = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    named = [a for a in args if a.kind in by_name]
    return tuple(a.name for a in named), tuple(a.name for a in named if a.default is inspect.Parameter.empty)


def check_params(cls: type, params: Mapping[str, Any]) -> None:
    """Refuse ``params`` the Trainable ``cls`` does not take (before any worker starts), naming
    the parameter, the ones it accepts and the closest one. Unchecked if it declares none."""
    import difflib

    from elastic_ops.errors import UNSET, SpecError

    declared = declared_params(cls)
    if declared is None:
        return
    accepted, required = declared
    for key in params:
        if key not in accepted:
            close = difflib.get_close_matches(str(key), accepted, n=1)
            raise SpecError(
                f"params.{key}", params[key],
                f"{cls.__name__} takes no parameter {key!r}; it accepts: {', '.join(accepted) or 'none'}",
                hint=f"did you mean {close[0]!r}?" if close else None,
            )
    for key in required:
        if key not in params:
            raise SpecError(f"params.{key}", UNSET, f"{cls.__name__}.__init__ requires it (no default)")


def check_params_if_imported(entrypoint: str, params: Mapping[str, Any]) -> None:
    """:func:`check_params` where the Trainable's module is already imported in this process (a
    DAG that imports its model, the task that parsed that DAG); nothing is imported for it: a
    spec is built where importing the user's code (and torch) is not wanted."""
    module_name, _, attr = entrypoint.partition(":")
    module, base = sys.modules.get(module_name), sys.modules.get("elastic_ops.runtime.trainable")
    cls = getattr(module, attr, None) if module is not None else None
    if base is not None and isinstance(cls, type) and issubclass(cls, base.Trainable):
        check_params(cls, params)
