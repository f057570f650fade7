"""A heartbeat process's UDP socket: heartbeats as datagrams (``protocol.heartbeat_datagram``) on
the heartbeat port's number, answered by ``Front.datagram`` on one thread of their own.

One thread is enough: a datagram costs the check and the answer (~0.2 ms, the Ed25519 check most
of it), against ~0.5 ms for the same beat through gRPC's Python server, and the interpreter's
lock lets one thread at a time do either.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable

from protocol.heartbeat_datagram import MAX_DATAGRAM_BYTES

logger = logging.getLogger(__name__)

__all__ = ["open_socket", "serve"]

WAKE_S = 0.5
"""How often the reader looks whether it should stop."""
RECEIVE_BUFFER = 1 << 20
"""Asked of the kernel for the datagrams waiting while the thread is busy; it grants at most
``net.core.rmem_max`` (Linux's default 208 KiB: a few hundred heartbeats, a fraction of a
second at 10,000 peers). More would only hold beats their peers have given up on: a beat
unanswered within a second is signed afresh and sent over gRPC."""


def open_socket(host: str, port: int, *, reuse_port: bool) -> socket.socket:
    """A UDP socket bound to ``host``:``port`` (raises ``OSError``); ``reuse_port``: shared with
    the other heartbeat processes (the kernel spreads sources among them)."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_DGRAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)
        except OSError:  # capped by net.core.rmem_max: the kernel's largest is taken instead
            pass
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    sock.settimeout(WAKE_S)
    return sock


def serve(sock: socket.socket, answer: Callable[[bytes, str], bytes | None], stopped: threading.Event) -> None:
    """Answer every datagram on ``sock`` with ``answer(data, source host)`` (None: no answer)
    until ``stopped`` is set."""
    while not stopped.is_set():
        try:
            data, source = sock.recvfrom(MAX_DATAGRAM_BYTES + 1)
        except TimeoutError:
            continue
        except OSError as exc:  # closed under it
            if not stopped.is_set():
                logger.warning("heartbeat datagrams stopped: %s", exc)
            return
        try:
            reply = answer(data, str(source[0]))
        except Exception:  # one datagram's trouble must not end the reader (the process looks alive)
            logger.exception("answering a heartbeat datagram from %s failed", source[0])
            continue
        if reply is not None:
            try:
                sock.sendto(reply, source)
            except OSError as exc:  # the source is unreachable (an ICMP error queued): its loss
                logger.debug("could not answer %s: %s", source, exc)
