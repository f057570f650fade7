"""A peer's node key: one account may run many peers, each a distinct member of the swarm.

The key a volunteer keeps (``--key``, default ``~/.config/swarmtrain/identity.key``) is their
**account** key. Every running peer signs with its own **node** key (its digest records, its
averaging metadata, its coordinator requests), which the account key endorses (a signed
message of kind ``kinds.ACCOUNT_ENDORSEMENT`` whose body is the node's raw public key; the
coordinator credits the node and knows the account that earns for it). So two peers started
with the same account key (two GPUs, the README's three peers on one machine) never share an
identity, a data shard or a digest record.

A node key is fresh per process, unless the peer has a ``--checkpoint-dir``: then it lives in
``CHECKPOINT_DIR/node.key`` so that a restarted peer resumes as the same member. A checkpoint
directory belongs to one running peer at a time: it is locked (``flock``) while the peer runs,
and a second peer given the same directory exits at once saying so.
"""

from __future__ import annotations

import fcntl
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from protocol import kinds
from protocol.errors import ConfigError
from protocol.identity import Identity, load_or_create
from protocol.messages import SignedMessage, sign_message

NODE_KEY_FILE = "node.key"
LOCK_FILE = ".peer.lock"


@dataclass(frozen=True)
class NodeIdentity:
    """The keys a running peer uses: ``node`` signs, ``account`` earns."""

    node: Identity
    account: Identity
    endorsement: SignedMessage
    """The account's signature over the node's public key."""

    @property
    def seed(self) -> int:
        """A per-node number (the default data shard seed): distinct for distinct nodes."""
        return int.from_bytes(self.node.public_key.raw[:4], "big")


def endorse(account: Identity, node: Identity, *, now: float) -> SignedMessage:
    """The account's endorsement of ``node`` (what the coordinator checks at admission)."""
    return sign_message(account, kinds.ACCOUNT_ENDORSEMENT, node.public_key.raw, now=now)


def node_identity(account: Identity, checkpoint_dir: Path | None) -> tuple[NodeIdentity, IO[str] | None]:
    """This process's node identity, and the open lock file of ``checkpoint_dir`` (keep it
    open while the peer runs). Raises ``ConfigError`` if another running peer holds the
    directory."""
    lock = None
    if checkpoint_dir is None:
        node = Identity.generate()
    else:
        lock = lock_checkpoint_dir(checkpoint_dir)
        node, _ = load_or_create(checkpoint_dir / NODE_KEY_FILE)
    return NodeIdentity(node, account, endorse(account, node, now=time.time())), lock


def lock_checkpoint_dir(checkpoint_dir: Path) -> IO[str]:
    """Take the directory's lock for the life of this process; ``ConfigError`` if held."""
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    handle = (checkpoint_dir / LOCK_FILE).open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise ConfigError(
            f"--checkpoint-dir {checkpoint_dir} is in use by a running peer (pid {holder}); "
            "give each peer its own --checkpoint-dir"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    return handle
