"""The index layer stays below torch and beside the object layer."""

from __future__ import annotations


def test_index_imports_neither_torch_nor_objects() -> None:
    """Layering: no module of ckstore.index imports torch or the object layer.

    Checked statically, since the top-level ``ckstore`` package may import torch itself.
    """
    import ast
    from pathlib import Path

    import ckstore.index

    root = Path(ckstore.index.__file__).parent
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
                if node.level:  # relative import inside ckstore.index
                    names = [f"ckstore.index.{node.module or ''}"]
                names += [f"{names[0]}.{alias.name}" for alias in node.names]
            for name in names:
                assert not name.startswith(("torch", "ckstore.objects")), (path, name)
                assert name.split(".")[0] != "torch", (path, name)
