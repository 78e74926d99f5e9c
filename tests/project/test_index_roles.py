"""The layers above the engine type the index by role, never as the whole ``Index``.

``history/`` and ``remote/`` reach the index through a repository (``repo.index``). Each use
must go through a name typed with one of the role Protocols of ``ckstore/engine/interfaces.py``
(``index: GcIndex = repo.index``) or be handed on to a parameter (``Lease(repo.index, ...)``),
so mypy proves that each consumer calls only what its role declares. Checked statically: a
call straight on ``repo.index`` or an unannotated ``index = repo.index`` would let any method
of ``Index`` through unseen.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support.paths import REPO

ROOT = REPO / "ckstore"
NOT_YET: set[Path] = set()
"""Modules whose index queries are still their own SQL (issue 30 moves them into ``index/``)."""
CONSUMERS = sorted(
    p for layer in ("history", "remote") for p in (ROOT / layer).rglob("*.py") if p not in NOT_YET
)


def roles() -> set[str]:
    """The Protocol classes of ``engine/interfaces.py`` whose name ends in ``Index``."""
    tree = ast.parse((ROOT / "engine" / "interfaces.py").read_text())
    return {
        node.name
        for node in tree.body
        if isinstance(node, ast.ClassDef)
        and node.name.endswith("Index")
        and any(isinstance(b, ast.Name) and b.id == "Protocol" for b in node.bases)
    }


ROLES = roles()


def _is_index(node: ast.AST) -> bool:
    """``something.index``: the index of a repository (or a record's field of that name)."""
    return isinstance(node, ast.Attribute) and node.attr == "index"


def untyped_uses(path: Path) -> list[str]:
    """Every use of ``X.index`` in ``path`` that is not typed with a role, or handed on."""
    tree = ast.parse(path.read_text())
    allowed: set[int] = set()
    bad: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign) and node.value is not None and _is_index(node.value):
            annotation = node.annotation
            if isinstance(annotation, ast.Name) and annotation.id in ROLES:
                allowed.add(id(node.value))
            else:
                bad.append(f"line {node.lineno}: typed {ast.unparse(annotation)}, not a role")
                allowed.add(id(node.value))
        elif isinstance(node, ast.Call):
            allowed.update(id(a) for a in node.args if _is_index(a))
            allowed.update(id(k.value) for k in node.keywords if _is_index(k.value))
            if _is_index(node.func):
                allowed.add(id(node.func))  # a method named index, as list.index(...)
    for node in ast.walk(tree):
        if _is_index(node) and id(node) not in allowed:
            bad.append(f"line {node.lineno}: {ast.unparse(node)} used untyped")
    return bad


def imports_of_index(path: Path) -> list[str]:
    """Imports of the whole ``Index`` class in ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("index"):
            out += [f"line {node.lineno}" for a in node.names if a.name == "Index"]
    return out


def test_the_roles_are_found() -> None:
    assert {"WriteIndex", "GcIndex", "CheckIndex", "TierIndex"} <= ROLES


@pytest.mark.parametrize("path", CONSUMERS, ids=lambda p: str(p.relative_to(ROOT)))
def test_consumers_type_the_index_by_role(path: Path) -> None:
    assert not untyped_uses(path), untyped_uses(path)
    assert not imports_of_index(path), f"{path} imports Index: type it with a role instead"


def test_what_is_not_yet_typed_is_still_untyped() -> None:
    """An exemption goes once its module is typed by role."""
    assert all(untyped_uses(path) for path in NOT_YET), "type it by role, then drop it here"


def test_the_checker_sees_an_untyped_use(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "def f(repo, names):\n"
        "    good: GcIndex = repo.index\n"
        "    Lease(repo.index, 1)\n"
        "    names.index('a')\n"
        "    wrong: Index = repo.index\n"
        "    loose = repo.index\n"
        "    repo.index.prune_chunks(0)\n"
    )
    assert [line.split(":")[0] for line in untyped_uses(sample)] == [
        "line 5",
        "line 6",
        "line 7",
    ]
