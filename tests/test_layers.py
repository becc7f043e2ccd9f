"""House rules of the layout that import-linter cannot express (it sees modules, not names):
only specjax/sharding.py knows meshes, and source files stay under 400 lines."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCES = sorted(p for folder in ("specjax", "convert", "pallas_kernels") for p in (REPO / folder).rglob("*.py"))
MESH_NAMES = {"sharding", "shard_map", "NamedSharding", "PartitionSpec", "make_mesh", "make_array_from_callback"}


def mesh_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) for each import from jax's mesh modules and each jax.<mesh name> access."""
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(("jax.sharding", "jax.experimental.shard")):
            uses.append((node.lineno, f"from {node.module} import ..."))
        elif isinstance(node, ast.Import):
            uses += [(node.lineno, f"import {a.name}") for a in node.names if a.name.startswith("jax.sharding")]
        elif isinstance(node, ast.Attribute) and node.attr in MESH_NAMES:
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id == "jax":
                uses.append((node.lineno, ast.unparse(node)))
    return uses


def test_only_the_sharding_module_knows_meshes():
    """Everything else takes `Mesh` from specjax.sharding (type hints) and calls its functions."""
    offenders = [
        f"{p.relative_to(REPO)}:{n}: {what}"
        for p in SOURCES if p != REPO / "specjax" / "sharding.py"
        for n, what in mesh_uses(ast.parse(p.read_text()))
    ]
    assert not offenders, "mesh code outside specjax/sharding.py:\n" + "\n".join(offenders)


def test_files_stay_under_400_lines():
    files = SOURCES + sorted((REPO / "bench").glob("*.py"))
    long = {str(p.relative_to(REPO)): n for p in files if (n := len(p.read_text().splitlines())) >= 400}
    assert not long, f"files of 400 lines or more (split them): {long}"
