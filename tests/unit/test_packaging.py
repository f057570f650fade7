"""What `pip install .` ships (pyproject's explicit package list) is every package of the
source tree: a package missing there works in the editable install the tests use, and
breaks in the docker images and for volunteers who install with pip."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOP = ("protocol", "engine", "relay", "peer", "coordinator", "swarmtrain")


def test_every_package_in_the_tree_is_shipped() -> None:
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for top in TOP
        for init in (ROOT / top).rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    assert found == listed, {"not shipped": sorted(found - listed), "listed, absent": sorted(listed - found)}


def test_the_wheel_holds_every_source_and_data_file(tmp_path: Path) -> None:
    """Build the wheel as `pip install .` would, from a clean copy of the tracked files (a
    stale ``build/`` would hide a missing package), and compare it with them."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    source = tmp_path / "src"
    for name in tracked:
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(source),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("swarmtrain-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    needed = {
        f
        for f in tracked
        if f.split("/")[0] in TOP and f.endswith((".py", ".html", ".proto", ".pyi", ".toml", "py.typed"))
    }
    assert needed <= shipped, sorted(needed - shipped)
