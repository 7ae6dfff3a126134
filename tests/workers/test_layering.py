"""Imports inside workers/ run one way: shell -> decoding -> models -> seam (README, Layout), and the
runtime (workers/, orchestrator/) never imports the offline tools (tools/) or the tests' helpers (tests/).

Read from the source with ``ast`` (imports inside functions count too), so a new upward import
fails here before it becomes a circle; tests/test_imports.py checks that there are no circles at all.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKERS = ROOT / "workers"
RUNTIME = ("workers", "orchestrator")
NOT_RUNTIME = ("tools", "tests")  # offline tools and test helpers: the runtime imports neither
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


def top_level_imports(path: Path) -> set[str]:
    """The top-level packages ``path`` imports anywhere (functions included); relative imports count
    as their own package's."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            found.add(node.module.split(".")[0] if node.level == 0 and node.module else ".")
        elif isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
    return found


RUNTIME_MODULES = sorted(p for package in RUNTIME for p in (ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("path", RUNTIME_MODULES, ids=[str(p.relative_to(ROOT)) for p in RUNTIME_MODULES])
def test_the_runtime_imports_no_tools_or_tests(path):
    assert not top_level_imports(path) & set(NOT_RUNTIME), f"{path.relative_to(ROOT)} imports tools/ or tests/"


def test_the_check_sees_a_runtime_import_of_a_tool(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from tools.tiny import TinyShape\n    import tests.helpers.reference\n")
    assert top_level_imports(bad) & set(NOT_RUNTIME) == {"tools", "tests"}
