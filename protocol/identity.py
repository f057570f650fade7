"""Ed25519 identities: keys, public ids, key files, signing and verification.

A peer, an account and a coordinator each have one key. The public id printed to users is
``ed25519:`` followed by the raw 32-byte public key in unpadded URL-safe base64. Private
keys live in PKCS#8 PEM files created with mode 0600; a key file that group or others can
access is refused (as ssh does), because anyone who reads it can earn or spend in its name.
"""

from __future__ import annotations

import base64
import binascii
import functools
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from protocol.errors import IdentityError, KeyFilePermissionError

PUBLIC_ID_PREFIX = "ed25519:"
PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64


@dataclass(frozen=True)
class PublicKey:
    """An Ed25519 public key; equality and hashing by its raw bytes."""

    raw: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.raw, bytes) or len(self.raw) != PUBLIC_KEY_BYTES:
            raise IdentityError(f"an Ed25519 public key is {PUBLIC_KEY_BYTES} bytes, got {len(self.raw)!r}")

    @classmethod
    def from_id(cls, public_id: str) -> PublicKey:
        """Parse ``ed25519:<base64url>``; raises ``IdentityError`` naming what is wrong."""
        if not isinstance(public_id, str) or not public_id.startswith(PUBLIC_ID_PREFIX):
            raise IdentityError(f"public id must start with {PUBLIC_ID_PREFIX!r}: {public_id!r}")
        encoded = public_id[len(PUBLIC_ID_PREFIX) :]
        try:
            raw = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))
        except (binascii.Error, ValueError) as exc:
            raise IdentityError(f"public id is not valid base64url: {public_id!r}") from exc
        if len(raw) != PUBLIC_KEY_BYTES or cls(raw).id != public_id:
            raise IdentityError(f"public id does not encode a {PUBLIC_KEY_BYTES}-byte key: {public_id!r}")
        return cls(raw)

    @functools.cached_property
    def id(self) -> str:
        """The printable public id (computed once: a heartbeat asks for it a dozen times)."""
        return PUBLIC_ID_PREFIX + base64.urlsafe_b64encode(self.raw).decode("ascii").rstrip("=")

    def verify(self, signature: bytes, data: bytes) -> bool:
        """True iff ``signature`` is this key's signature of ``data``."""
        if len(signature) != SIGNATURE_BYTES:
            return False
        try:
            Ed25519PublicKey.from_public_bytes(self.raw).verify(signature, data)
        except (InvalidSignature, ValueError):
            return False
        return True

    def __str__(self) -> str:
        return self.id


class Identity:
    """An Ed25519 private key and the operations that need it."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._key = private_key
        raw = private_key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        self.public_key = PublicKey(raw)

    @classmethod
    def generate(cls) -> Identity:
        """A fresh random identity."""
        return cls(Ed25519PrivateKey.generate())

    def sign(self, data: bytes) -> bytes:
        """Ed25519 signature of ``data`` (64 bytes)."""
        return self._key.sign(data)

    def to_pem(self) -> bytes:
        """PKCS#8 PEM, unencrypted (the file's mode protects it)."""
        return self._key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    @classmethod
    def from_pem(cls, data: bytes, *, source: str = "<key>") -> Identity:
        """Parse a PKCS#8 PEM Ed25519 private key."""
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError) as exc:
            raise IdentityError(f"{source}: not a PEM private key ({exc})") from exc
        if not isinstance(key, Ed25519PrivateKey):
            raise IdentityError(f"{source}: expected an Ed25519 key, found {type(key).__name__}")
        return cls(key)

    def save(self, path: Path, *, overwrite: bool = False) -> None:
        """Write the key to ``path`` with mode 0600, atomically; never replaces a file unless asked."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        if path.exists() and not overwrite:
            raise IdentityError(f"{path}: a key file already exists (refusing to overwrite it)")
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.fchmod(fd, 0o600)  # the umask may have removed bits, never added: be explicit
            os.write(fd, self.to_pem())
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            if overwrite:
                os.replace(tmp, path)
            else:
                os.link(tmp, path)  # fails if someone created `path` meanwhile
        except FileExistsError as exc:
            raise IdentityError(f"{path}: a key file already exists (refusing to overwrite it)") from exc
        finally:
            if tmp.exists():
                tmp.unlink()

    @classmethod
    def load(cls, path: Path) -> Identity:
        """Read a key file; refuses one that group or others may access."""
        path = Path(path)
        try:
            st = path.stat()
        except FileNotFoundError as exc:
            raise IdentityError(f"{path}: no key file (create one with `swarmtrain keygen --out {path}`)") from exc
        if not stat.S_ISREG(st.st_mode):
            raise IdentityError(f"{path}: not a regular file")
        if st.st_mode & 0o077:
            raise KeyFilePermissionError(
                f"{path}: key file is accessible by group or others (mode {stat.S_IMODE(st.st_mode):04o}); "
                f"run `chmod 600 {path}`"
            )
        return cls.from_pem(path.read_bytes(), source=str(path))


def default_key_path() -> Path:
    """``$SWARMTRAIN_HOME/identity.key``, else under ``$XDG_CONFIG_HOME`` or ``~/.config``."""
    home = os.environ.get("SWARMTRAIN_HOME")
    if home:
        return Path(home) / "identity.key"
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config) / "swarmtrain" / "identity.key"


def load_or_create(path: Path) -> tuple[Identity, bool]:
    """Load the identity at ``path``, creating it first if absent; returns (identity, created)."""
    path = Path(path)
    if path.exists():
        return Identity.load(path), False
    identity = Identity.generate()
    identity.save(path)
    return identity, True
