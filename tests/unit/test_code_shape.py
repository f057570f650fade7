"""The product's shape, held: no class over ``MAX_CLASS_LINES`` lines (counted by ``ast``, its
decorators and docstring included). A class that grows past it has taken a second concern: cut
it into parts (``peer/round/`` is the pattern: one loop, parts sharing one record)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("protocol", "engine", "relay", "peer", "coordinator", "swarmtrain", "benchmarks")
MAX_CLASS_LINES = 400
GENERATED = {"protocol/coordinator_pb2_grpc.py", "protocol/coordinator_pb2.py"}


def classes() -> list[tuple[int, str]]:
    """(lines, "path:Class") of every class in the product, longest first."""
    found = []
    for package in PRODUCT:
        for path in (REPO / package).rglob("*.py"):
            name = str(path.relative_to(REPO))
            if name in GENERATED:
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ClassDef):
                    assert node.end_lineno is not None
                    found.append((node.end_lineno - node.lineno + 1, f"{name}:{node.name}"))
    return sorted(found, reverse=True)


def test_no_class_is_over_the_limit() -> None:
    found = classes()
    assert len(found) > 100  # the walk saw the product
    assert not [c for c in found if c[0] > MAX_CLASS_LINES], found[:5]
