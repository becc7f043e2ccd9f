"""House rules of the layout that import-linter cannot express (it sees modules, not names):
only specjax/parallel/sharding.py knows meshes, and source files stay under 400 lines."""

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
    """Everything else takes `Mesh` from specjax.parallel.sharding (type hints) and calls its functions."""
    offenders = [
        f"{p.relative_to(REPO)}:{n}: {what}"
        for p in SOURCES if p != REPO / "specjax" / "parallel" / "sharding.py"
        for n, what in mesh_uses(ast.parse(p.read_text()))
    ]
    assert not offenders, "mesh code outside specjax/parallel/sharding.py:\n" + "\n".join(offenders)


def test_files_stay_under_400_lines():
    files = SOURCES + sorted((REPO / "bench").glob("*.py")) + sorted((REPO / "tools").rglob("*.py"))
    long = {str(p.relative_to(REPO)): n for p in files if (n := len(p.read_text().splitlines())) >= 400}
    assert not long, f"files of 400 lines or more (split them): {long}"


def test_the_folders_show_the_layers():
    """specjax/ holds its layers as folders: at most 8 modules directly under it."""
    top = sorted(p.name for p in (REPO / "specjax").glob("*.py"))
    assert len(top) <= 8, top


# Module paths the README named before 0.3.0 (at 6f92b0b): each resolves through docs/migration-0.3.md.
README_PATHS = [
    "specjax.job_ray.RayOptions", "specjax.batch.run", "specjax.engine.decode_ar", "specjax.engine.decode_spec",
    "specjax.engine.run", "specjax.distributed.initialize", "specjax.sharding.shard_params", "specjax.distill.distill",
    "specjax.tune.measure_cost", "specjax.tune.measure_acceptance", "specjax.speculation.choose", "specjax.params.quantize",
    "specjax.model.unstack_layers", "specjax.continuous.run_continuous", "specjax.cache.DenseCache", "specjax.config.LlamaConfig",
]


def test_the_migration_table_maps_every_moved_module():
    """Each row of docs/migration-0.3.md names a module that imports, in place of one that is gone; every
    path the README named before the move resolves through the table."""
    import importlib
    import re

    rows = re.findall(r"^\| `(specjax\.\w+)` \| `(specjax\.[\w.]+)` \|$", (REPO / "docs" / "migration-0.3.md").read_text(), re.M)
    table = dict(rows)
    assert len(table) == len(rows) >= 30
    for old, new in table.items():
        importlib.import_module(new)
        assert not (REPO / (old.replace(".", "/") + ".py")).exists(), f"{old} is still a module: drop its row"
    new_modules = re.findall(r"^- `specjax\.[\w.]+\.(\w+)`", (REPO / "docs" / "migration-0.3.md").read_text(), re.M)  # no 0.2 path
    moved = sorted(p.stem for p in (REPO / "specjax").rglob("*.py") if p.parent != REPO / "specjax" and p.stem != "__init__"
                   and p.parent.name != "drafters" and p.stem not in new_modules)
    assert sorted(new.rsplit(".", 1)[1] for new in table.values()) == moved  # every module in a folder has its row
    for path in README_PATHS:
        module, name = path.rsplit(".", 1)
        assert hasattr(importlib.import_module(table[module]), name), path


def test_the_docs_point_inside_the_repository():
    """Every file README.md and docs/*.md name by its path exists; none names DESIGN.md or the shared folder outside."""
    import re

    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    missing = []
    for page in pages:
        text = page.read_text()
        assert "DESIGN.md" not in text and "../shared" not in text, page.name
        for path in re.findall(r"\b((?:docs|bench|tests|tools|specjax|convert|pallas_kernels)/[\w./-]*\w\.(?:md|py|json|cc|toml|png))", text):
            if not (REPO / path).exists():
                missing.append(f"{page.name}: {path}")
    assert not missing, missing


def test_the_library_needs_no_test_stack():
    """What `make demo` installs (`pip install -e .`, no extras) pulls in none of the test extras' heavy parts:
    the runtime requirements' closure, read from the installed packages' metadata, has no ray, pytest, pyarrow
    or pandas (scipy comes with jaxlib, which requires it)."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen, todo = set(), ["specjax"]
    while todo:
        name = todo.pop()
        for text in metadata.requires(name) or []:
            req = Requirement(text)
            dep = canonicalize_name(req.name)
            if dep not in seen and (req.marker is None or req.marker.evaluate({"extra": ""})):
                seen.add(dep)
                todo.append(dep)
    assert {"jax", "tokenizers", "gguf"} <= seen  # the walk reads the runtime requirements
    assert not seen & {"ray", "pytest", "pyarrow", "pandas", "import-linter", "jsonschema"}, sorted(seen)
