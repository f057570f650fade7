"""Whether a process still runs, by pid: the one check both roles and the launcher use for a
lock or a claim whose owner may have died (a checkpoint's writer, a test's port claim)."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one of another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
