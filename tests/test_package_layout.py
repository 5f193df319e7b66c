"""The package's shape: no import cycles between modules, and the torch-free layers stay so."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("rlt_engine", "rlt_cli")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports at module level (lazy imports inside
    functions and TYPE_CHECKING blocks are not edges: they cannot form a load-time cycle)."""
    files = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        edges: set[str] = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            edges.update(t for t in targets if t in files and t != name)
        graph[name] = edges
    return graph


def test_no_import_cycles() -> None:
    graph = _import_graph()
    assert "rlt_engine.checkpoints.hub" in graph and "rlt_engine.oracle.reference" in graph
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = [*path[path.index(nxt) :], nxt] if nxt in path else [node, nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


@pytest.mark.parametrize(
    "module",
    [
        "rlt_engine.config",
        "rlt_engine.core.scheduler",
        "rlt_engine.checkpoints.aliases",
        "rlt_engine.checkpoints.resolve",
        "rlt_engine.checkpoints.verify",
        "rlt_engine.engine_info",
    ],
)
def test_torch_free(module: str) -> None:
    """The scheduler, configs and checkpoint lookup load without torch (instant CLI paths)."""
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_no_test_folder_is_a_package() -> None:
    """tests/ goes on sys.path (conftest, pytest's rootdir insertion), so a test folder with an
    __init__.py is an importable top-level package that hides any installed one of its name:
    tests/kernels/ once hid huggingface's `kernels`, which transformers imports when it is
    installed (transformers >= 5.25 depends on it), and the reference-model tests failed."""
    packages = sorted(
        str(p.parent.relative_to(ROOT))
        for p in (ROOT / "tests").rglob("__init__.py")
        if "fixtures" not in p.parts
    )
    assert packages == [], f"test folders must not be packages: {packages}"
