"""The product's modules import each other without circles: every import statement counts,
deferred ones inside functions and ``TYPE_CHECKING`` ones included (a deferred import is where
a circle hides; import-linter's layers see only across packages)."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("protocol", "engine", "relay", "peer", "coordinator", "swarmtrain")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> nx.DiGraph:
    files = [p for package in PACKAGES for p in (REPO / package).rglob("*.py") if "_pb2" not in p.name]
    modules = {module_name(p) for p in files}
    graph = nx.DiGraph()
    for path in files:
        source = module_name(path)
        graph.add_node(source)
        package = source if path.name == "__init__.py" else source.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                # ``from package import submodule`` imports the submodule (and runs the package's
                # __init__, which may import its own submodules: not a circle of ours)
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
                ]
            for target in targets:
                # the longest project module the name falls in (a submodule, else its module)
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != source:
                    graph.add_edge(source, target)
    return graph


def test_no_module_imports_itself_through_others() -> None:
    circles = [sorted(c) for c in nx.strongly_connected_components(import_graph()) if len(c) > 1]
    assert not circles, f"import circles: {circles}"


def test_no_test_module_imports_another() -> None:
    """Helpers several tests share live in modules of their own (``tests/specs.py``,
    ``tests/unit/round_rows.py``, ...): a test file imported by others runs its module-level setup
    in each and hides which of its names are a helper."""
    offenders = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[-1].startswith("test_"):
                if node.module.startswith("tests."):
                    offenders.append(f"{path.relative_to(REPO)} imports {node.module}")
    assert not offenders, offenders
