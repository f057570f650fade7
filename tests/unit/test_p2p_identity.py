"""The libp2p identity file a peer names: an Ed25519 key in libp2p's encoding, never an
overwrite (``engine.p2p_identity``)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from hivemind.proto import crypto_pb2

from engine.p2p_identity import write_ed25519_identity


def test_the_identity_is_an_ed25519_key_in_libp2p_s_encoding_for_its_owner_only(tmp_path: Path) -> None:
    path = tmp_path / "p2p.key"
    write_ed25519_identity(path)
    message = crypto_pb2.PrivateKey()
    message.ParseFromString(path.read_bytes())
    assert message.key_type == crypto_pb2.KeyType.Ed25519
    assert len(message.data) == 64
    seed, public = message.data[:32], message.data[32:]
    derived = Ed25519PrivateKey.from_private_bytes(seed).public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    assert derived == public
    assert stat.S_IMODE(path.stat().st_mode) == 0o400


def test_an_existing_identity_is_never_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "p2p.key"
    write_ed25519_identity(path)
    kept = path.read_bytes()
    with pytest.raises(FileExistsError):
        write_ed25519_identity(path)
    assert path.read_bytes() == kept


def test_two_identities_differ(tmp_path: Path) -> None:
    write_ed25519_identity(tmp_path / "a")
    write_ed25519_identity(tmp_path / "b")
    assert (tmp_path / "a").read_bytes() != (tmp_path / "b").read_bytes()
