"""The package layout: no import cycle, small folders, launch scripts that leave sys.path alone.

The import graph is read from the source (an ast walk), so it counts what the interpreter may
never run: imports inside functions and under `if TYPE_CHECKING:` are edges like any other.
Importing `a.b.c` runs the `__init__` of `a` and `a.b` first, so it is an edge to each of those
packages too, except to the importer's own packages (already importing when it runs); an
explicit import of one of them (`from interlens_mcore import X`) is an edge like any other.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("interlens_mcore", "trainers")
MAX_MODULES_PER_FOLDER = 12


def library_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the packages."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a `from ... import` names (relative levels resolved)."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _targets(module: str, is_package: bool, node: ast.AST, known: set[str]) -> set[str]:
    if isinstance(node, ast.Import):
        return {a.name for a in node.names}
    if not isinstance(node, ast.ImportFrom):
        return set()
    base = _absolute(module, is_package, node)
    named = {f"{base}.{a.name}" for a in node.names}
    modules = named & known  # `from pkg import module`
    return modules | ({base} if named - modules else set())


def imports() -> dict[str, set[str]]:
    """module -> every module it imports (its own and others'), anywhere in its file."""
    files = library_files()
    known = set(files)
    out = {}
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))
        out[module] = set().union(*(_targets(module, is_package, n, known) for n in ast.walk(tree)))
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the modules and packages of these packages it imports, anywhere in its file."""
    known = set(library_files())
    graph: dict[str, set[str]] = {}
    for module, targets in imports().items():
        own = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 2)}
        edges = set()
        for target in targets:
            parts = target.split(".")
            chain = {".".join(parts[:i]) for i in range(1, len(parts) + 1)}  # a, a.b, a.b.c
            edges |= {t for t in chain & known if t not in own - {target} and t != module}
        graph[module] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [m0, m1, ..., m0], or None (depth-first search, colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_graph_counts_lazy_type_only_and_package_imports():
    graph = import_graph()
    # a function-level import (trainers/__init__.py's MegatronBackend)
    assert "trainers.backends.megatron" in graph["trainers"]
    # a TYPE_CHECKING import (stop conditions annotate with the trajectory's Message)
    assert "interlens_mcore.types" in graph["interlens_mcore.rollout.stop"]
    # importing interlens_mcore.engines.vllm runs interlens_mcore.engines's __init__ first
    assert "interlens_mcore.engines" in graph["trainers.backends.colocated_vllm"]


def test_every_import_of_the_packages_names_a_module_of_them():
    # TYPE_CHECKING and function-level imports never run in the other tests: a moved module
    # they still name would go unnoticed
    known = set(library_files())
    missing = {
        f"{module} imports {target}"
        for module, targets in imports().items()
        for target in targets
        if target.split(".")[0] in PACKAGES and target not in known
    }
    assert not missing, sorted(missing)


def test_no_import_cycle():
    graph = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_at_most_twelve_modules_in_a_folder():
    # a package's __init__.py is not counted (34 modules sat flat in interlens_mcore/ before
    # the layout, its __init__.py aside)
    counts = {}
    for package in PACKAGES:
        for folder in [ROOT / package, *(p for p in (ROOT / package).rglob("*") if p.is_dir())]:
            n = len([p for p in folder.glob("*.py") if p.name != "__init__.py"])
            if n:
                counts[str(folder.relative_to(ROOT))] = n
    print("\nmodules per folder:", dict(sorted(counts.items(), key=lambda kv: -kv[1])))
    crowded = {folder: n for folder, n in counts.items() if n > MAX_MODULES_PER_FOLDER}
    assert not crowded, f"folders with more than {MAX_MODULES_PER_FOLDER} modules: {crowded}"


def test_launch_scripts_leave_sys_path_alone():
    # the package is installed (pip install -e .); the user's working directory is made
    # importable by interlens_mcore.cli, not here
    scripts = sorted((ROOT / "launch").rglob("*.py"))
    assert scripts
    offenders = [str(p.relative_to(ROOT)) for p in scripts if re.search(r"\bsys\.path\b", p.read_text())]
    assert not offenders, f"launch scripts that edit sys.path: {offenders}"


def test_any_per_thousand_library_lines():
    """Reported, not bounded: `Any` uses (names and attributes) per 1,000 lines of library code."""
    lines = uses = 0
    for path in library_files().values():
        text = path.read_text()
        lines += len(text.splitlines())
        for node in ast.walk(ast.parse(text)):
            named = isinstance(node, ast.Name) and node.id == "Any"
            attribute = isinstance(node, ast.Attribute) and node.attr == "Any"
            uses += named or attribute
    per_1000 = 1000 * uses / lines
    print(f"\nAny: {uses} uses in {lines} library lines = {per_1000:.1f} per 1,000 lines")
    assert lines > 0


def test_importing_the_package_costs_no_torch_and_every_public_name_resolves():
    """`import interlens_mcore` is lazy (PEP 562): tool workers and plug-in loaders that import it
    start without torch, megatron-core or DeepSpeed; each public name still imports on first use.
    A fresh interpreter, because this one has long imported torch."""
    import subprocess
    import sys

    code = (
        "import sys, interlens_mcore as m\n"
        "heavy = [k for k in ('torch', 'megatron', 'deepspeed', 'transformers') if k in sys.modules]\n"
        "print(heavy)\n"
        "table = sorted(n for names in m._EXPORTS.values() for n in names)\n"
        "assert sorted(m.__all__) == table, 'the export table and __all__ differ'\n"
        "missing = [n for n in m.__all__ if getattr(m, n, None) is None]\n"
        "print(missing)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    heavy, missing = out.stdout.splitlines()
    assert heavy == "[]", f"import interlens_mcore imported {heavy}"
    assert missing == "[]", f"public names that do not resolve: {missing}"
