"""The volunteers' relays a joining peer is told of, and where a volunteer's relay listens."""

from __future__ import annotations

import ipaddress
import random
from collections.abc import Callable

from relay.server import MAX_RELAYS_LISTED


def volunteer_relays(offers: list[tuple[str, str]], account_of: Callable[[str], str]) -> list[str]:
    """Up to ``MAX_RELAYS_LISTED`` of ``offers`` ((peer, "HOST:PORT") of the relays online, the
    asker's own left out), in a random order (the relayed peers spread over them), at most one
    per host and one per account (``account_of(peer)``): keys are free to mint, so one party's
    relays would otherwise fill the list (30 keys from 2 hosts made 150 of 200 answers list
    only theirs), and a relay sees who it relays."""
    offers = list(offers)
    random.shuffle(offers)
    hosts: set[str] = set()
    accounts: set[str] = set()
    listed: list[str] = []
    for peer, relay in offers:
        host, account = relay.rsplit(":", 1)[0], account_of(peer)
        if host in hosts or account in accounts:
            continue
        hosts.add(host)
        accounts.add(account)
        listed.append(relay)
        if len(listed) == MAX_RELAYS_LISTED:
            break
    return listed


def relay_endpoint(source: str, port: int) -> str:
    """``HOST:PORT`` of a relay a peer offers on ``port`` of the host its request came from;
    "" when it offers none or the source is not an IP address (a unix socket, a test)."""
    try:
        address = ipaddress.ip_address(source)
    except ValueError:
        return ""
    if not port:
        return ""
    return f"[{address}]:{port}" if address.version == 6 else f"{address}:{port}"
