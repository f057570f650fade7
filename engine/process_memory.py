"""How much freed memory a process keeps: glibc's malloc arenas.

glibc gives each thread that allocates concurrently an arena of its own, up to 8 per core, and
an arena keeps what is freed in it for reuse. The averager's process decodes every part into a
fresh buffer on whichever of its threads takes it, so each arena ends up holding its own share
of a round's freed part buffers between rounds: measured on loopback (2 averagers, 20M values,
fp16, PSS after 5 rounds), each averager process held 3.0-3.1 model sizes with the default
arenas, 2.7-2.8 with 2 and 2.6 with 1, at the same all-reduce time (0.35, 0.35 and 0.32 s).
Returning every large buffer to the system at once instead (``M_MMAP_THRESHOLD`` at 128 KiB)
left 2.0, but each part's pages were then faulted in afresh: the all-reduce took 2.6x as long.
A round's peak is its live buffers, which the cap does not change: two 85M peers' peak PSS was
11.5 model sizes against 11.2 without it (``benchmarks/results/scale-arenas-fp16-2026-11-30.md``,
one run each); what falls is what a peer holds while it trains between rounds.

What a round frees stays with the process too: at 200M parameters (fp16, 2 peers on loopback,
per-process PSS sampled through 4 rounds) the trainer held 0.12 GB above its tensors and runtime
after its inner steps (each step's gradient temporaries, freed into the heap), and the averager
0.15-0.19 GB above its idle size after each all-reduce (its parts and frames), both still held
while the round landed: the peer's peak. ``release_free_memory`` (glibc's ``malloc_trim``) gives
the free pages of every arena back to the system; the peer calls it where a phase's garbage has
just been freed (the trainer once a round is launched, the averager once an all-reduce ended),
and the pages are faulted in again when the next phase needs them: two averagers on loopback,
50M values, fp16, took 0.58 s a round with it against 0.575 without (alternating runs).

``limit_malloc_arenas`` caps the arenas of this process and of the processes it forks later
(they inherit the setting), so the peer calls it before it starts any thread. It changes
nothing where the C library is not glibc, or where ``MALLOC_ARENA_MAX`` is set (the operator's
choice stands).
"""

from __future__ import annotations

import ctypes
import logging
import os

__all__ = ["MALLOC_ARENAS", "limit_malloc_arenas", "release_free_memory"]

logger = logging.getLogger(__name__)

MALLOC_ARENAS = 2
"""Arenas a process keeps at most: the measurement above; 1 would serialize every thread's
allocations on one lock."""
_M_ARENA_MAX = -8
"""glibc's ``mallopt`` parameter number for the arena cap (``malloc.h``)."""


def limit_malloc_arenas(arenas: int = MALLOC_ARENAS) -> bool:
    """Cap this process's malloc arenas at ``arenas`` (glibc's ``mallopt``); whether it did."""
    if arenas < 1:
        raise ValueError(f"arenas must be at least 1, got {arenas}")
    if os.environ.get("MALLOC_ARENA_MAX"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False  # not glibc (macOS has no mallopt)
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    done = bool(mallopt(_M_ARENA_MAX, arenas))
    logger.debug("malloc arenas capped at %d: %s", arenas, done)
    return done


def release_free_memory() -> bool:
    """Give the free pages of this process's malloc arenas back to the system (glibc's
    ``malloc_trim(0)``); whether any were (False where the C library is not glibc)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return bool(trim(0))
