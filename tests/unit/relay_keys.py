"""What the relay tests share: keys for their stand-in tokens (the relay wants proof of the key a
token names, ``relay.wire.Challenge``, so each stand-in token ``b"ok-a"``, ... names a
key of its own, generated once per test session), free loopback ports and a relay that admits
stand-in tokens."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from protocol.identity import Identity
from relay.server import Relay

_KEYS: dict[bytes, Identity] = {}


def identity(token: bytes) -> Identity:
    """The key stand-in token ``token`` names."""
    if token not in _KEYS:
        _KEYS[token] = Identity.generate()
    return _KEYS[token]


def key_of(token: bytes) -> str:
    """The public id a test relay's admission returns for ``token``."""
    return identity(token).public_key.id


def signer(token: bytes) -> Callable[[bytes], bytes]:
    """Signs with the key ``token`` names (what the peer holding it proves the relay)."""
    return identity(token).sign


def admit_stand_in(token: bytes) -> str:
    """A test relay's admission: stand-in tokens ``b"ok-..."`` admit the key they name."""
    if not token.startswith(b"ok-"):
        raise ValueError("not a valid access token of this run")
    return key_of(token)


@contextmanager
def stand_in_relay(ports: Sequence[int]) -> Iterator[Relay]:
    """A relay on loopback granting ``ports``, admitting stand-in tokens; stopped on exit."""
    served = Relay(host="127.0.0.1", control_port=0, ports=ports, admit=admit_stand_in)
    served.control_port = served.start()
    try:
        yield served
    finally:
        served.stop()
