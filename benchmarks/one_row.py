"""Write a one-row benchmark result to ``benchmarks/results/``: ``NAME.json`` (the figures)
and ``NAME.md`` (a title, the command that made it, and the figures as a one-row table)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def write_one_row(name: str, *, title: str, command: str, result: dict[str, Any]) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        f"# {title}",
        "",
        f"Command: `{command}`",
        "",
        "| " + " | ".join(result) + " |",
        "|" + "---|" * len(result),
        "| " + " | ".join(str(v) for v in result.values()) + " |",
    ]
    (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")
