"""A peer's libp2p identity: an Ed25519 key, written where hivemind's daemon reads it.

A peer keeps one libp2p identity for its process's life (``peer.swarm.swarm.Swarm``: a move to
new relays restarts its daemon under the same identity), so it names an identity file. Left to
create that file, hivemind writes an RSA-2048 key (``P2P.generate_identity``), where the daemon on
its own makes an Ed25519 one, as every peer had before identities were kept across moves. Every
libp2p handshake signs with the host key, and a member of a round of N opens up to N − 1
connections: an RSA-2048 signature costs about 10 times an Ed25519 one (0.31 against 0.03 ms
here, `cryptography`'s), its key takes ~30 ms to make, and its peer id is a hash where an
Ed25519 id inlines the key (``12D3KooW…``, not ``Qm…``).

The file is libp2p's ``PrivateKey`` protobuf: key type Ed25519, and the 32-byte seed followed by
the 32-byte public key (libp2p's Ed25519 private key encoding)."""

from __future__ import annotations

import os
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat
from hivemind.proto import crypto_pb2

__all__ = ["write_ed25519_identity"]


def write_ed25519_identity(path: Path) -> None:
    """Write a new Ed25519 libp2p identity to ``path`` (readable by its owner only); an
    existing file is an error (``FileExistsError``): an identity is never overwritten."""
    key = Ed25519PrivateKey.generate()
    seed = key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
    public = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    message = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.Ed25519, data=seed + public)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
    with os.fdopen(descriptor, "wb") as out:
        out.write(message.SerializeToString())
