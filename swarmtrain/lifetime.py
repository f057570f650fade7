"""Processes forked by a swarmtrain command die with it, even when it is killed with SIGKILL.

hivemind runs the DHT and the averager in forked processes (and those start ``p2pd``, which
exits when its parent does). When the command is shut down cleanly it stops them; when it is
killed (``kill -9``, the OOM killer) they would live on, holding ports and memory. On Linux
each child forked from the command's main thread asks the kernel for SIGKILL when its parent
dies (``PR_SET_PDEATHSIG``). Forks from other threads are left alone: the kernel sends that
signal when the *thread* that forked exits, which would kill a healthy child.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import sys
import threading

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_installed = False
_forking: dict[str, int | bool] = {}


def tie_children_to_this_process() -> bool:
    """Install the fork hooks once; False where the platform has no parent-death signal."""
    global _installed
    if _installed:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError) as exc:
        logger.debug("no prctl (%s): children are not tied to this process", exc)
        return False

    def before() -> None:
        _forking["pid"] = os.getpid()
        _forking["main_thread"] = threading.current_thread() is threading.main_thread()

    def after_in_child() -> None:
        if not _forking.get("main_thread"):
            return
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != _forking.get("pid"):
            os._exit(1)  # the parent died before the request took effect

    os.register_at_fork(before=before, after_in_child=after_in_child)
    _installed = True
    return True
