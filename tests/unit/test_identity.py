from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from protocol.errors import IdentityError, KeyFilePermissionError
from protocol.identity import Identity, PublicKey, default_key_path, load_or_create


def test_sign_verify_roundtrip() -> None:
    me = Identity.generate()
    sig = me.sign(b"hello")
    assert me.public_key.verify(sig, b"hello")
    assert not me.public_key.verify(sig, b"hellO")
    assert not Identity.generate().public_key.verify(sig, b"hello")
    assert not me.public_key.verify(sig[:-1], b"hello")


def test_public_id_roundtrip_and_rejections() -> None:
    key = Identity.generate().public_key
    assert key.id.startswith("ed25519:") and PublicKey.from_id(key.id) == key
    for bad in ["", "rsa:abc", "ed25519:", "ed25519:AAAA", "ed25519:" + "!" * 43, key.id + "A"]:
        with pytest.raises(IdentityError):
            PublicKey.from_id(bad)
    with pytest.raises(IdentityError):
        PublicKey(b"short")


def test_save_creates_0600_and_load_roundtrips(tmp_path: Path) -> None:
    path = tmp_path / "nested" / "id.key"
    me = Identity.generate()
    me.save(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert Identity.load(path).public_key == me.public_key
    assert not list(path.parent.glob(".*.tmp"))


def test_save_refuses_to_overwrite_unless_forced(tmp_path: Path) -> None:
    path = tmp_path / "id.key"
    first = Identity.generate()
    first.save(path)
    with pytest.raises(IdentityError, match="already exists"):
        Identity.generate().save(path)
    assert Identity.load(path).public_key == first.public_key
    second = Identity.generate()
    second.save(path, overwrite=True)
    assert Identity.load(path).public_key == second.public_key
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_save_ignores_permissive_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        Identity.generate().save(tmp_path / "id.key")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "id.key").stat().st_mode) == 0o600


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660, 0o601])
def test_load_refuses_group_or_world_accessible(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "id.key"
    Identity.generate().save(path)
    path.chmod(mode)
    with pytest.raises(KeyFilePermissionError, match="chmod 600"):
        Identity.load(path)


def test_load_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(IdentityError, match="no key file"):
        Identity.load(tmp_path / "missing.key")
    garbage = tmp_path / "garbage.key"
    garbage.write_bytes(b"not a key")
    garbage.chmod(0o600)
    with pytest.raises(IdentityError, match="not a PEM private key"):
        Identity.load(garbage)
    with pytest.raises(IdentityError, match="not a regular file"):
        Identity.load(tmp_path)


def test_load_refuses_other_key_types(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    pem = ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    path = tmp_path / "ec.key"
    path.write_bytes(pem)
    path.chmod(0o600)
    with pytest.raises(IdentityError, match="expected an Ed25519 key"):
        Identity.load(path)


def test_default_path_and_load_or_create(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWARMTRAIN_HOME", str(tmp_path / "home"))
    assert default_key_path() == tmp_path / "home" / "identity.key"
    first, created = load_or_create(default_key_path())
    again, created_again = load_or_create(default_key_path())
    assert created and not created_again and first.public_key == again.public_key
