"""Objects named on the command line as `MODULE:NAME`, MODULE importable or a path to a .py file."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
import types
from pathlib import Path
from typing import Any


def working_directory_importable() -> None:
    """Put the working directory first on sys.path, as `python -m` does, unless it is there.

    The launch scripts call this (through `cli.args.parse`): a `MODULE:NAME` on their command
    line (--task, --reward, --tools, --multi-turn-scheduler) may name a module next to where
    the user runs them, while Python puts only the script's own folder on the path.
    """
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


def load_object(spec: str, *, what: str) -> Any:
    """`MODULE:NAME` -> the object; ValueError naming `what` (the flag) and the problem otherwise."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} {spec!r}: expected MODULE:NAME (a module or a .py file, then a name in it)")
    module = load_module(module_name, what=what)
    try:
        return getattr(module, attr)
    except AttributeError:
        public = sorted(n for n in vars(module) if not n.startswith("_"))
        raise ValueError(
            f"{what} {spec!r}: {module_name} has no {attr!r} (it has: {', '.join(public)})"
        ) from None


def load_module(name: str, *, what: str):
    """An importable module, or a .py file by path, loaded as part of a package (`file_package`).

    A file is executed once: naming it again (a plugin that is also a task and a reward module,
    the launcher's check and its build) returns the module already loaded from it, so whatever
    it registers is registered once.
    """
    if name.endswith(".py") or "/" in name:
        return _load_file(Path(name), what=what, spec_text=name)
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        raise ValueError(f"{what}: cannot import {name!r} ({exc}); is it on PYTHONPATH?") from None


def file_package(folder: Path) -> str:
    """The package a plugin file's folder is imported as: a name unique to the folder, the same
    in every process (ranks load their plugins themselves), so `from .helper import X` in a
    plugin file finds the file's neighbour `helper.py`."""
    digest = hashlib.sha1(str(folder.resolve()).encode()).hexdigest()[:12]
    package = f"interlens_plugins_{digest}"
    if package not in sys.modules:
        module = types.ModuleType(package)
        module.__path__ = [str(folder.resolve())]  # a package: its submodules are the folder's files
        module.__package__ = package
        sys.modules[package] = module
    return package


def _load_file(path: Path, *, what: str, spec_text: str):
    if not path.is_file():
        raise ValueError(f"{what} {spec_text!r}: no such file")
    full = f"{file_package(path.parent)}.{path.stem}"
    loaded = sys.modules.get(full)
    if loaded is None:
        spec = importlib.util.spec_from_file_location(full, path.resolve())
        if spec is None or spec.loader is None:
            raise ValueError(f"{what} {spec_text!r}: not a Python file that can be imported")
        loaded = importlib.util.module_from_spec(spec)
        sys.modules[full] = loaded
        try:
            spec.loader.exec_module(loaded)
        except BaseException:
            del sys.modules[full]
            raise
    # also under its stem, so MODULE:NAME names it as the file's stem (`my_plugin:MathTips`)
    sys.modules.setdefault(path.stem, loaded)
    return loaded
