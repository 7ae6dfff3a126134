"""How the packages (the runtime, tools/, tests/) import each other: no circles (imports inside
functions count), and the sweep's driver, config, tracker and report load without torch or
transformers (they only plan, check and record; the actors load the models)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("workers", "orchestrator", "tools", "tests")  # the runtime, the offline tools, the tests


def modules(root: Path) -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the project modules it imports, anywhere in its source (functions included)."""
    names = modules(root)
    graph = {}
    for name, path in names.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES:
                for alias in node.names:  # "from workers.decoding import ar" imports the module workers.decoding.ar
                    child = f"{node.module}.{alias.name}"
                    targets.add(child if child in names else node.module)
            elif isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names if alias.name.split(".")[0] in PACKAGES}
        graph[name] = {t for t in targets if t in names and t != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle, as one path around it (depth-first; a module on the current path seen again)."""
    found, state = [], {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                found.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return found


def test_no_import_circles_counting_imports_inside_functions():
    assert circles(import_graph(ROOT)) == []


def test_the_circle_check_sees_a_circle_through_a_function(tmp_path):
    (tmp_path / "workers").mkdir()
    (tmp_path / "orchestrator").mkdir()
    (tmp_path / "workers" / "a.py").write_text("from workers.b import x\n")
    (tmp_path / "workers" / "b.py").write_text("def x():\n    from workers import a\n")
    assert circles(import_graph(tmp_path)) == [["workers.a", "workers.b", "workers.a"]]


@pytest.mark.slow  # a fresh interpreter
def test_the_driver_side_loads_without_torch_or_transformers():
    code = ("import sys\nimport orchestrator.sweep, orchestrator.driver, orchestrator.report, orchestrator.config\n"
            "import orchestrator.tracking, orchestrator.study, orchestrator.pool, orchestrator.tp_group\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
