"""Processes that share one output (the README's background peers) never interleave lines,
even unbuffered (PYTHONUNBUFFERED, which the README's test and many containers set)."""

from __future__ import annotations

import os
import subprocess
import sys

WRITER = """
import sys
from swarmtrain.cli import _whole_lines
{setup}
for k in range(3000):
    print("coordinator: credited %d samples (0 FLOPs), 480 pending" % k)
"""


def _broken_lines(setup: str) -> int:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    read, write = os.pipe()
    writers = [
        subprocess.Popen([sys.executable, "-c", WRITER.format(setup=setup)], stdout=write, env=env) for _ in range(4)
    ]
    os.close(write)
    with os.fdopen(read) as out:
        lines = out.read().splitlines()
    for writer in writers:
        assert writer.wait(timeout=60) == 0
    return sum(not (line.startswith("coordinator: credited ") and line.endswith(" pending")) for line in lines)


def test_every_line_is_one_write() -> None:
    assert _broken_lines("_whole_lines()") == 0


def test_output_is_line_buffered_not_written_through() -> None:
    # unbuffered prints write a line and its newline apart (measured here: 8,211 broken lines of
    # 16,000 from 8 such writers); a line-buffered stream writes each line once
    code = (
        "import sys; from swarmtrain.cli import _whole_lines; _whole_lines(); "
        "print(sys.stdout.line_buffering, sys.stdout.write_through, sys.stderr.line_buffering)"
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    shown = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert shown.stdout.split() == ["True", "False", "True"]
