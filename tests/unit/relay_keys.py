"""Keys for the relay tests' stand-in tokens: the relay wants proof of the key a token names
(``protocol.relay_wire.Challenge``), so each stand-in token (``b"ok-a"``, ...) names a key of its
own, generated once per test session."""

from __future__ import annotations

from collections.abc import Callable

from protocol.identity import Identity

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
