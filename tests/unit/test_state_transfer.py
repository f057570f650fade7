"""Which member a newcomer asks for what (``engine.state_transfer``): the one that served its
state is asked first for the rounds' updates it rolls forward by."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from engine.state_transfer import StateTransferMixin
from engine.update_transfer import UpdateTransferMixin
from tests.unit.update_answers import _Answer


class _Newcomer(StateTransferMixin, UpdateTransferMixin):
    """The two mixins over a listing of members: ``gone`` refuses to serve, ``member`` serves."""

    def __init__(self, members: list[str]) -> None:
        self.members = members
        self.peer_id = "me"
        self._matchmaking = SimpleNamespace(group_key_manager=SimpleNamespace(prefix="run"))
        listing = SimpleNamespace(value=dict.fromkeys(members))

        async def get(key: str, **kwargs: Any) -> Any:
            return listing

        self.dht = SimpleNamespace(get=get)

    async def _admitted(self, peer: Any, stale_ok: bool = False) -> bool:
        return True

    async def _download_state_from(self, peer: Any, accept: Any, timeout: float, newer_than: Any = None) -> Any:
        if str(peer) != self.members[-1]:
            raise ConnectionError("failed to dial")
        return (7, None, None)


def test_the_member_that_served_the_state_is_asked_first_for_the_updates(monkeypatch: Any) -> None:
    import engine.state_transfer
    import engine.update_transfer

    monkeypatch.setattr(engine.state_transfer, "PeerID", str)
    monkeypatch.setattr(engine.update_transfer, "PeerID", str)
    members = [f"gone{i}" for i in range(7)] + ["member"]
    newcomer = _Newcomer(members)
    answer = _Answer()
    asyncio.run(newcomer._load_verified_state(None, 5.0, answer))  # type: ignore[arg-type]
    assert answer.result == (7, None, None)
    for _ in range(5):  # whatever the shuffle, the server comes first
        assert asyncio.run(newcomer._update_servers())[0] == "member"
