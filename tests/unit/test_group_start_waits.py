"""``rpc_group_start`` as an admitted but hostile peer uses it: calls for groups that do not
exist, each of which a member looking for a group would hold open for ``FETCH_S`` waiting for it.
One peer may hold ``MAX_WAITS_PER_ASKER`` of those waits at once; its other calls are refused at
once, and an honest member's call for a real group still waits and gets its group."""

from __future__ import annotations

import asyncio
import os

from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2

from engine.group_start import MAX_WAITS_PER_ASKER, GroupStartMixin


class Member(GroupStartMixin):
    """The serving side alone, as a member that is looking for a group."""

    def __init__(self, peer: PeerID) -> None:
        self.peer_id = peer
        self.is_looking_for_group = True


def test_one_peer_asking_for_made_up_groups_holds_few_waits_and_an_honest_member_gets_its_group() -> None:
    async def scenario() -> None:
        me, attacker, honest = PeerID(b"member"), PeerID(b"attacker"), PeerID(b"honest")
        member = Member(me)
        made_up = [asyncio.ensure_future(member.serve_start(os.urandom(32), attacker)) for _ in range(64)]
        group = os.urandom(32)
        asked = asyncio.ensure_future(member.serve_start(group, honest))
        done, waiting = await asyncio.wait(made_up, timeout=0.5)
        assert len(waiting) == MAX_WAITS_PER_ASKER, f"the attacker holds {len(waiting)} waits"
        assert {task.result().code for task in done} == {averaging_pb2.NOT_LOOKING_FOR_GROUP}
        assert not asked.done()  # the honest call still waits for its group
        member._keep_start(group, [me, honest], [b"a", b"b"])
        answer = await asyncio.wait_for(asked, 1.0)
        assert answer.code == averaging_pb2.BEGIN_ALLREDUCE and answer.group_id == group
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        assert member.__dict__["_start_waiters"] == 0 and not member.__dict__["_start_waiters_by"]
        # its waits given back, the same peer may wait again (a child asking its parent next round)
        again = asyncio.ensure_future(member.serve_start(os.urandom(32), attacker))
        await asyncio.sleep(0.1)
        assert not again.done()
        again.cancel()
        await asyncio.gather(again, return_exceptions=True)

    asyncio.run(scenario())
