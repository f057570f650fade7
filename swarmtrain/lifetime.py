"""Processes forked by a swarmtrain command die with it, even when it is killed with SIGKILL.

And a command started by ``swarmtrain.localswarm`` (the demo's peers and coordinator) leaves
when the process that started it dies: it is told the parent's pid in ``PARENT_ENV``.

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
from typing import Any

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
PARENT_ENV = "SWARMTRAIN_PARENT_PID"
_installed = False
_forking: dict[str, int | bool] = {}


def _prctl() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError) as exc:
        logger.debug("no prctl (%s)", exc)
        return None


def leave_with_parent() -> bool:
    """If ``PARENT_ENV`` names our parent, ask for SIGTERM when it dies (a graceful leave);
    if it is gone already, leave now. False when not asked or not possible."""
    expected = os.environ.pop(PARENT_ENV, "")
    if not expected.isdigit():
        return False
    prctl = _prctl()
    if prctl is None:
        return False
    prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != int(expected):
        os.kill(os.getpid(), signal.SIGTERM)
    return True


def tie_children_to_this_process() -> bool:
    """Install the fork hooks once; False where the platform has no parent-death signal."""
    global _installed
    if _installed:
        return True
    prctl = _prctl()
    if prctl is None:
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
