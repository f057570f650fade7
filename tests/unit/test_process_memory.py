"""``engine.process_memory``: the malloc arena cap a peer sets before its threads start, and the
free pages it gives back once a phase's garbage is freed."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from engine.process_memory import limit_malloc_arenas

ARENAS_AFTER_THREADS = """
import ctypes, sys, tempfile, threading
from engine.process_memory import limit_malloc_arenas

if sys.argv[1] != "default":
    print("capped", limit_malloc_arenas(int(sys.argv[1])))
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.fopen.restype = ctypes.c_void_p
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.fclose.argtypes = [ctypes.c_void_p]
held = []
barrier = threading.Barrier(8)

def allocate():
    barrier.wait()  # all at once: each thread's first malloc looks for an arena of its own
    held.append(libc.malloc(1 << 16))

threads = [threading.Thread(target=allocate) for _ in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
with tempfile.NamedTemporaryFile(suffix=".xml") as report:
    stream = libc.fopen(report.name.encode(), b"w")
    libc.malloc_info(0, stream)
    libc.fclose(stream)
    print("arenas", open(report.name).read().count("<heap nr="))
"""


def arenas_after_threads(cap: str) -> dict[str, str]:
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    done = subprocess.run(
        [sys.executable, "-c", ARENAS_AFTER_THREADS, cap], cwd=root, env={**env, "PYTHONPATH": str(root)},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return dict(line.split(" ", 1) for line in done.stdout.splitlines())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's arenas")
def test_a_capped_process_keeps_its_threads_in_that_many_arenas() -> None:
    """Eight threads allocating at once get arenas of their own, unless capped."""
    assert int(arenas_after_threads("default")["arenas"]) > 2
    capped = arenas_after_threads("2")
    assert capped["capped"] == "True"
    assert int(capped["arenas"]) <= 2


def test_an_operators_malloc_arena_max_stands(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert limit_malloc_arenas() is False


def test_a_cap_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        limit_malloc_arenas(0)


FREED_BUT_KEPT = """
import ctypes, os, threading
from engine.process_memory import release_free_memory

libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
page = os.sysconf("SC_PAGE_SIZE")

def rss() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * page

def churn(kept: list) -> None:  # 256 MB of 64 KiB chunks (below the mmap threshold: the heap's)
    chunks = [libc.malloc(1 << 16) for _ in range(4096)]
    for chunk in chunks:
        libc.memset(chunk, 1, 1 << 16)
    for i, chunk in enumerate(chunks):
        if i % 64 == 63:
            kept.append(chunk)  # a live chunk every 4 MiB: no free stretch reaches the heap's top
        else:
            libc.free(chunk)

kept: list = []
worker = threading.Thread(target=churn, args=(kept,))  # an executor thread's arena, as in the averager
worker.start()
worker.join()
churn(kept)  # and the main arena, as in the trainer
before = rss()
print("released", release_free_memory())
print("freed_mb", (before - rss()) / 2**20)
"""


@pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's; musl and macOS have none (nothing is released)"
)
def test_freed_memory_that_glibc_keeps_goes_back_to_the_system() -> None:
    """512 MB freed in holes between live chunks, in a thread's arena and in the main one: glibc
    keeps it (nothing free reaches a heap's top) until ``release_free_memory``."""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", FREED_BUT_KEPT], cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    report = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert report["released"] == "True"
    assert float(report["freed_mb"]) > 400, report
