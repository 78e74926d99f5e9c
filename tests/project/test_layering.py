"""Imports point one way: each layer imports only the layers below it, and no module cycles.

Checked statically over every module of the package, with imports inside functions and under
``TYPE_CHECKING`` counted like any other (a lazy import that runs against the layers is still a
wrong-way dependency). docs/ARCHITECTURE.md describes the same table.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support.paths import REPO

ROOT = REPO / "ckstore"

# layer -> the layers it may import (besides itself); bottom first
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "objects": {"errors"},
    "index": {"errors"},
    "format": {"errors"},
    "engine": {"errors", "objects", "index", "format"},
    "history": {"errors", "objects", "index", "format", "engine"},
    "distributed": {"errors", "objects", "index", "format", "engine"},
    "interop": {"errors", "objects", "index", "format", "engine"},
    # remotes move snapshots between repositories (push, pull, the two-tier store): they work on
    # the engine's Repository like history does, and the facade puts them on Store
    "remote": {"errors", "objects", "index", "format", "engine"},
    "facade": {
        "errors",
        "objects",
        "index",
        "format",
        "engine",
        "history",
        "distributed",
        "interop",
        "remote",
    },
    "dcp": {"errors", "objects", "index", "format", "engine", "distributed", "facade"},
    "integrations": {"errors", "objects", "index", "format", "engine", "interop", "facade"},
    "ui": {"errors", "objects", "index", "format", "engine", "history", "facade"},
    "cli": {
        "errors",
        "objects",
        "index",
        "format",
        "engine",
        "history",
        "distributed",
        "interop",
        "remote",
        "facade",
        "ui",
        "dcp",
    },
    "testing": {"errors", "objects"},
}
FACADE = {
    "ckstore",
    "ckstore._heal_verbs",
    "ckstore._history_verbs",
    "ckstore.interval",
    "ckstore._locate",
    "ckstore._open",
    "ckstore.pending",
    "ckstore._ref_verbs",
    "ckstore._remote_verbs",
    "ckstore._takes",
    "ckstore.snapshot",
    "ckstore.store",
    "ckstore.store_ref",
    "ckstore.torchsnapshot",
    "ckstore._usage_verbs",
}
NO_TORCH = {"errors", "objects", "index", "remote"}


def layer_of(module: str) -> str:
    if module in FACADE:
        return "facade"
    if module == "ckstore.__main__":
        return "cli"  # `python -m ckstore` runs the command line
    parts = module.split(".")
    assert parts[0] == "ckstore" and len(parts) > 1, module
    name = parts[1]
    assert name in ALLOWED, (
        f"{module}: a module outside every layer (add it to ALLOWED and ARCHITECTURE.md)"
    )
    return name


def modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        if "migrations" in parts:
            continue  # alembic's env and revisions, loaded by alembic itself
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = modules()


def imports(module: str, path: Path) -> set[str]:
    """Every ckstore module (or package) ``module`` imports, at any depth of its code."""
    is_pkg = path.name == "__init__.py"
    here = module.split(".") if is_pkg else module.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "ckstore")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.split(".")[0] == "ckstore":
                target = node.module
            else:
                continue
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES]
            found.update(subs if len(subs) == len(node.names) else [target, *subs])
    found.discard(module)
    return found


GRAPH = {m: imports(m, p) for m, p in MODULES.items()}


def test_every_module_has_a_layer() -> None:
    for module in MODULES:
        layer_of(module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module: str) -> None:
    mine = layer_of(module)
    for target in sorted(GRAPH[module]):
        theirs = layer_of(target)
        assert theirs == mine or theirs in ALLOWED[mine], (
            f"{module} ({mine}) imports {target} ({theirs}): {mine} may import only "
            f"{sorted(ALLOWED[mine])}"
        )


@pytest.mark.parametrize("module", sorted(m for m in MODULES if layer_of(m) in NO_TORCH))
def test_bottom_layers_never_import_torch(module: str) -> None:
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        assert not any(n.split(".")[0] == "torch" for n in names), (module, names)


def test_no_import_cycles() -> None:
    """Tarjan's strongly connected components over the module graph: each must be one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH.get(v, ()):
            if w not in GRAPH:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


# Inside the engine: two flows over a ground. The ground (repository, opening, config, view,
# interfaces, locations, lease, progress, stateful, devices) imports neither flow; a restore may
# use the take's grid and hashing (verify_live), a take never imports the restore.
ENGINE_FLOWS: dict[str, set[str]] = {"ground": set(), "take": set(), "restore": {"take"}}


def engine_part(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) < 2 or parts[1] != "engine":
        return None
    return parts[2] if len(parts) > 2 and parts[2] in ENGINE_FLOWS else "ground"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if engine_part(m)))
def test_engine_flows_stand_on_the_ground(module: str) -> None:
    mine = engine_part(module)
    assert mine is not None
    for target in sorted(GRAPH[module]):
        theirs = engine_part(target)
        if theirs is None or theirs == mine:
            continue
        assert theirs == "ground" or theirs in ENGINE_FLOWS[mine], (
            f"{module} (engine {mine}) imports {target} (engine {theirs}): the ground imports "
            "neither flow, and a take never imports the restore"
        )


def test_engine_packages_are_empty() -> None:
    """Importing a flow's package runs nothing (torch-free reads stay torch-free)."""
    for pkg in ("engine", "engine/take", "engine/restore"):
        text = (ROOT / pkg / "__init__.py").read_text()
        assert not [n for n in ast.parse(text).body if not isinstance(n, ast.Expr)], pkg


def test_the_checker_sees_lazy_and_relative_imports() -> None:
    """The graph is built right: a lazy import inside a function and ``from . import x`` count."""
    assert "ckstore.snapshot" in GRAPH["ckstore.store"]
    assert "ckstore.distributed.restore" in GRAPH["ckstore.snapshot"]  # imported inside restore()
    assert "ckstore.index._convert" in GRAPH["ckstore.index._commit"]  # from . import _convert


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_imports(module: str, path: Path) -> list[str]:
    """Imports of ``module`` that reach past another module's or package's privacy (the rule
    in docs/ARCHITECTURE.md): a ``_name`` of another module, or a ``_module`` of another package."""
    is_pkg = path.name == "__init__.py"
    here = module.split(".") if is_pkg else module.split(".")[:-1]
    package = ".".join(here)
    modules: list[str] = []  # dotted modules imported
    names: list[tuple[str, str]] = []  # (module, name) imported from it
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules += [a.name for a in node.names if a.name.split(".")[0] == "ckstore"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                target = ".".join(
                    here[: len(here) - (node.level - 1)] + ([node.module] if node.module else [])
                )
            elif (node.module or "").split(".")[0] == "ckstore":
                target = str(node.module)
            else:
                continue
            for a in node.names:
                if f"{target}.{a.name}" in MODULES:
                    modules.append(f"{target}.{a.name}")
                else:
                    modules.append(target)
                    names.append((target, a.name))
    bad = []
    for dotted in modules:
        parts = dotted.split(".")
        for i, part in enumerate(parts[1:], start=1):
            owner = ".".join(parts[:i])
            if _private(part) and owner != package:
                bad.append(f"{dotted}: a module private to {owner}")
    bad += [f"{m}.{n}: a name private to {m}" for m, n in names if _private(n) and m != module]
    return bad


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_import_reaches_past_privacy(module: str) -> None:
    """One privacy rule: ``_name`` is its module's own, ``_module`` its package's own."""
    assert not _private_imports(module, MODULES[module]), _private_imports(module, MODULES[module])


def _module_aliases(module: str, path: Path) -> dict[str, str]:
    """Local names bound to ckstore modules by ``module``'s imports (name -> dotted module)."""
    is_pkg = path.name == "__init__.py"
    here = module.split(".") if is_pkg else module.split(".")[:-1]
    out: dict[str, str] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "ckstore" and a.asname:
                    out[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                target = ".".join(
                    here[: len(here) - (node.level - 1)] + ([node.module] if node.module else [])
                )
            elif (node.module or "").split(".")[0] == "ckstore":
                target = str(node.module)
            else:
                continue
            for a in node.names:
                if f"{target}.{a.name}" in MODULES:
                    out[a.asname or a.name] = f"{target}.{a.name}"
    return out


def _private_attributes(module: str, path: Path) -> list[str]:
    """``mod._name`` where ``mod`` is another ckstore module imported here."""
    aliases = _module_aliases(module, path)
    bad = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and _private(node.attr)
            and aliases[node.value.id] != module
        ):
            bad.append(f"{aliases[node.value.id]}.{node.attr} (line {node.lineno})")
    return bad


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_attribute_reaches_past_privacy(module: str) -> None:
    """``mod._name`` of another module is as private as ``from mod import _name``."""
    assert not _private_attributes(module, MODULES[module]), _private_attributes(
        module, MODULES[module]
    )


# The faces (the command line, the web view, the DCP adapter) call the store's verbs, never the
# layers under it: ``store.repository`` is the plumbing, for tests and maintenance tools only.
FACES = ("cli", "ui", "dcp")


def _repository_reaches(source: str) -> list[int]:
    """Lines of ``source`` that use ``x.repository`` (read, call or assignment)."""
    return sorted(
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute) and node.attr == "repository"
    )


@pytest.mark.parametrize("face", FACES)
def test_faces_use_the_verbs_not_the_repository(face: str) -> None:
    reaches = [
        f"{path.relative_to(ROOT.parent)}:{line}"
        for path in sorted((ROOT / face).rglob("*.py"))
        for line in _repository_reaches(path.read_text())
    ]
    assert not reaches, (
        f"ckstore/{face} reaches under the store through .repository at {reaches}: give Store "
        "or StoredSnapshot the verb it needs (docs/ARCHITECTURE.md, role interfaces)"
    )


def test_the_repository_check_sees_every_reach() -> None:
    probe = "def f(store, snap):\n    x = store.repository.index.url\n    return snap.repository\n"
    assert _repository_reaches(probe) == [2, 3]
    assert _repository_reaches("from ckstore.engine.repository import Repository\n") == []


def _imports_sqlalchemy(source: str) -> bool:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import) and any(
            a.name.split(".")[0] == "sqlalchemy" for a in node.names
        ):
            return True
        if isinstance(node, ast.ImportFrom) and not node.level:
            if (node.module or "").split(".")[0] == "sqlalchemy":
                return True
    return False


def test_sql_lives_in_the_index() -> None:
    """Only ``ckstore/index/`` speaks SQL: no other module imports SQLAlchemy."""
    outside = sorted(
        module
        for module, path in MODULES.items()
        if layer_of(module) != "index" and _imports_sqlalchemy(path.read_text())
    )
    assert not outside, f"SQL outside ckstore/index/ (move it into an index query): {outside}"
    assert _imports_sqlalchemy("def f():\n    from sqlalchemy import select\n")


MAX_LINES = 500


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_over_500_lines(module: str) -> None:
    """Small modules with one job: a module past 500 lines is split (docs/ARCHITECTURE.md)."""
    lines = MODULES[module].read_text().count("\n")
    assert lines <= MAX_LINES, (
        f"{MODULES[module]} has {lines} lines (at most {MAX_LINES}): split it by job"
    )
