"""The package's house rules, checked on its source: sizes, docstrings, and import direction.

No module docstring over 40 lines: notes live next to the code they explain,
figures in ``docs/``. (0.8.1's 450-line cap per module is gone: it split the
house by size, not by object, and FSDP2's own files run to 1,100 lines.) The runtime import graph among
the package's modules (imports at module level, outside ``TYPE_CHECKING``)
has no cycle, and ``_registry`` imports nothing of the package: it is data
the swap fills in, never a caller back into it.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "fsdp_shim"
MODULES = sorted(PACKAGE.rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


NAMES = {_module_name(path) for path in MODULES}
PACKAGES = {_module_name(path) for path in MODULES if path.name == "__init__.py"}


def _runtime_imports(path: Path) -> set[str]:
    """Package modules ``path`` imports at module level, outside ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in tree.body:  # module level only: imports inside functions are deferred on purpose
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for sub in ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else [node]:
            if isinstance(sub, ast.ImportFrom) and sub.module and sub.module.startswith("fsdp_shim"):
                if sub.module in PACKAGES:
                    found.update(f"{sub.module}.{alias.name}" if f"{sub.module}.{alias.name}" in NAMES
                                 else sub.module for alias in sub.names)
                else:
                    found.add(sub.module)
            elif isinstance(sub, ast.Import):
                found.update(a.name for a in sub.names if a.name.startswith("fsdp_shim."))
    found.discard(_module_name(path))
    return found


def test_no_module_docstring_is_over_40_lines():
    lengths = {path.name: len((ast.get_docstring(ast.parse(path.read_text()), clean=False) or "").splitlines())
               for path in MODULES}
    assert {name: n for name, n in lengths.items() if n > 40} == {}


def test_the_import_graph_has_no_cycle():
    graph = {_module_name(path): _runtime_imports(path) for path in MODULES}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == []


def test_the_registry_calls_nothing_of_the_package():
    assert _runtime_imports(PACKAGE / "_registry.py") == set()
