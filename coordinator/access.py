"""Who may take part in the run: its admission mode, the live allowlist and bans (the store's,
read once and again after every change this process makes), the account each node key earns
for, and the peers whose tokens the swarm must stop counting (``revoked``). Safe beside the
core's other calls for reads (each cache is replaced whole); changes come through the core's
lock (``Coordinator.admin``, ``Coordinator.ban``)."""

from __future__ import annotations

from collections.abc import Callable

from coordinator.store import Store
from protocol import coordinator_pb2 as pb
from protocol.errors import MalformedMessageError
from protocol.identity import PublicKey
from protocol.spec import RunSpec


class Access:
    """The run's access rules over ``store``; ``accounts``: the account each key that joined
    through this process said it earns for."""

    def __init__(self, spec: RunSpec, store: Store) -> None:
        self.spec, self.store = spec, store
        self.accounts: dict[str, str] = {}
        self._bans: dict[str, str] | None = None
        """The store's bans: each heartbeat and report checks them."""
        self._allowlist: set[str] | None = None
        self._revoked: set[str] | None = None
        """``revoked``, until a ban or an allowlist change."""

    def changed(self) -> None:
        """The store's bans or allowlist changed: read them afresh."""
        self._bans = self._allowlist = self._revoked = None

    def banned(self) -> dict[str, str]:
        bans = self._bans
        if bans is None:
            bans = self._bans = self.store.banned()
        return bans

    def allowed(self) -> set[str]:
        allowed = self._allowlist
        if allowed is None:
            allowed = self._allowlist = self.store.allowlist()
        return allowed

    def permits(self, peer: PublicKey) -> bool:
        """Neither the peer nor its account is banned, and in allowlist mode its account is on
        the list (whether it joined is the health tracker's to say)."""
        banned = self.banned()
        account = self.accounts.get(peer.id, peer.id)
        if peer.id in banned or account in banned:
            return False
        return self.spec.admission.mode != "allowlist" or account in self.allowed()

    def account_of(self, key: str) -> str:
        """The account ``key`` earns for (its join said), else its own key."""
        if key in self.accounts:
            return self.accounts[key]
        row = self.store.peer(key)
        return (row.account_key if row is not None else None) or key

    def revoked(self) -> set[str]:
        """Keys of the peers whose tokens must stop counting in averaging: banned peers, peers
        of banned accounts and, in allowlist mode, peers of accounts not on the list. Computed
        again only after a ban or allowlist change (a join is admitted only if it would not be
        in it; the ticker asks every second, and a scan of every peer ever seen took 7% of the
        coordinator's time with 2,000 peers)."""
        revoked = self._revoked
        if revoked is None:
            revoked = self._revoked = self._compute_revoked()
        return set(revoked)

    def _compute_revoked(self) -> set[str]:
        banned = set(self.store.banned())
        allowlist = self.store.allowlist() if self.spec.admission.mode == "allowlist" else None
        accounts = {row.key: row.account_key or row.key for row in self.store.peers()}
        accounts.update(self.accounts)
        revoked = set(banned)
        for peer, account in accounts.items():
            if peer in banned or account in banned or (allowlist is not None and account not in allowlist):
                revoked.add(peer)
        return revoked

    def peers_of(self, key: str) -> set[str]:
        """The keys that are ``key`` or earn for account ``key``."""
        keys = {row.key for row in self.store.peers() if key in (row.key, row.account_key)}
        return keys | {peer for peer, account in self.accounts.items() if key in (peer, account)}

    def apply(self, body: pb.AdminBody, *, now: float, drop: Callable[[str], int]) -> str:
        """An operator's change (allow, disallow, ban, unban; a listing changes nothing), what it
        did in one line ("" for a listing); ``drop(key)`` forgets the peers that are ``key`` or
        earn for it and says how many. The caches are read afresh afterwards (a heartbeat
        running beside the change may have read them before it)."""
        action = body.action
        if action != pb.ADMIN_ACTION_LIST:
            try:
                PublicKey.from_id(body.key)
            except Exception as exc:
                raise MalformedMessageError(f"admin: {body.key!r} is not a public id ({exc})") from exc
        self.changed()
        if action == pb.ADMIN_ACTION_ALLOW:
            self.store.allow(body.key)
            message = f"allowed account {body.key}"
        elif action == pb.ADMIN_ACTION_DISALLOW:
            self.store.disallow(body.key)
            self.changed()
            dropped = drop(body.key) if self.spec.admission.mode == "allowlist" else 0
            message = f"removed account {body.key} from the allowlist; {dropped} peer(s) dropped"
        elif action == pb.ADMIN_ACTION_BAN:
            reason = body.reason.strip() or "banned by an operator"
            self.store.ban(body.key, reason, now)
            self.changed()
            message = f"banned {body.key} ({reason}); {drop(body.key)} peer(s) dropped"
        elif action == pb.ADMIN_ACTION_UNBAN:
            self.store.unban(body.key)
            message = f"lifted the ban on {body.key}"
        elif action == pb.ADMIN_ACTION_LIST:
            message = ""
        else:
            raise MalformedMessageError(f"admin: unknown action {action}")
        self.changed()
        return message
