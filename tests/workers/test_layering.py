"""Imports inside workers/ run one way: shell -> decoding -> models -> seam (README, Layout).

Read from the source with ``ast`` (imports inside functions count too), so a new upward import
fails here before it becomes a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

WORKERS = Path(__file__).resolve().parents[2] / "workers"
LAYERS = {"seam": 0, "errors": 0, "models": 1, "decoding": 2}  # everything else in workers/ is the shell (3)


def layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS.get(parts[1], 3) if len(parts) > 1 else 3


def workers_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("workers"):
            if node.module == "workers":  # from workers import ar -> workers.ar
                found += [f"workers.{alias.name}" for alias in node.names]
            else:
                found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.startswith("workers.")]
    return found


MODULES = sorted(p for p in WORKERS.rglob("*.py") if p.name != "__init__.py")


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(WORKERS)) for p in MODULES])
def test_imports_point_down_only(path):
    module = "workers." + ".".join(path.relative_to(WORKERS).with_suffix("").parts)
    upward = [name for name in workers_imports(path) if layer(name) > layer(module)]
    assert not upward, f"{module} imports upward: {upward}"


def test_the_check_sees_an_upward_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from workers.decoding.tree import build_tree\n")
    assert [n for n in workers_imports(bad) if layer(n) > layer("workers.models.bad")] == ["workers.decoding.tree"]
