"""The temporary directory must leave room for torch's shared-memory socket.

hivemind switches torch to the ``file_system`` sharing strategy, so the first tensor a peer or
the coordinator shares starts ``torch_shm_manager``, which listens on the Unix socket
``<tmp>/torch-shm-dir-XXXXXX/manager.sock``. A Unix socket path holds at most 107 bytes; under
a longer temporary directory the manager dies ("Invalid argument") and takes the process with a
traceback from deep inside hivemind. ``check_tmpdir`` says so in one line before anything starts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from protocol.errors import ConfigError

SOCKET_PATH_MAX = 107
"""sizeof(sockaddr_un.sun_path) on Linux (108) less the terminating NUL."""
SOCKET_SUFFIX = len("/torch-shm-dir-XXXXXX/manager.sock")
TMP_VARIABLES = ("TMPDIR", "TMP", "TEMP", "TEMPDIR")
"""The variables torch's C++ side (``c10::TempDir``) reads, in its order; else ``/tmp``."""


def torch_tmpdir(environ: Mapping[str, str] | None = None) -> tuple[str, str | None]:
    """The directory torch makes its socket directory in, and the variable that named it."""
    env = os.environ if environ is None else environ
    for name in TMP_VARIABLES:
        value = env.get(name)
        if value:
            return value, name
    return "/tmp", None


def check_tmpdir(environ: Mapping[str, str] | None = None) -> None:
    """Raise ``ConfigError`` when torch's shared-memory socket would not fit under the
    temporary directory (see the module docstring)."""
    directory, variable = torch_tmpdir(environ)
    longest = SOCKET_PATH_MAX - SOCKET_SUFFIX
    if len(os.fsencode(directory)) > longest:
        raise ConfigError(
            f"{variable} is {len(os.fsencode(directory))} bytes long ({directory[:40]}...): torch's shared-memory "
            f"socket under it would exceed the 107-byte limit of a Unix socket path; set {variable} to a "
            f"directory of at most {longest} bytes (e.g. {variable}=/tmp)"
        )
