"""``swarmtrain admin``: an operator edits a running coordinator's allowlist and bans.

Every request is signed with an operator key (by default the coordinator's own
``coordinator-state/coordinator.key``; others are named with ``swarmtrain coordinator
--operator``) and takes effect at once: a banned or disallowed peer's next heartbeat and
report are refused, and it cannot join again.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from peer.net.announce import coordinator_address
from protocol.errors import ConfigError
from swarmtrain.commands import rpc

ACTIONS = ("list", "allow", "disallow", "ban", "unban")


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "admin",
        help="edit a running coordinator's allowlist and bans",
        description="Edit a running coordinator's allowlist and bans (signed with an operator key).",
    )
    parser.add_argument("action", choices=ACTIONS, help="list | allow KEY | disallow KEY | ban KEY | unban KEY")
    parser.add_argument("key", nargs="?", default="", help="public id (ed25519:...) of an account or a peer")
    parser.add_argument(
        "--coordinator",
        default="127.0.0.1:7500",
        type=coordinator_address,
        metavar="HOST:PORT",
        help="the coordinator's gRPC address (default: 127.0.0.1:7500)",
    )
    parser.add_argument(
        "--key-file",
        type=Path,
        default=Path("coordinator-state/coordinator.key"),
        help="operator key (default: coordinator-state/coordinator.key)",
    )
    parser.add_argument("--reason", default="", help="why (shown with a ban)")
    parser.add_argument("--json", action="store_true", help="print the allowlist and bans as JSON")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the coordinator")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from protocol.identity import Identity, PublicKey

    if args.action == "list" and args.key:
        raise ConfigError("list takes no key")
    if args.action != "list":
        if not args.key:
            raise ConfigError(f"{args.action} needs the public id of an account or a peer")
        try:
            PublicKey.from_id(args.key)
        except Exception as exc:
            raise ConfigError(f"{args.key!r} is not a public id ({exc})") from exc
    identity = Identity.load(args.key_file)
    response = _send(args, identity)
    if args.json:
        print(json.dumps(_as_dict(response), indent=2, sort_keys=True))
        return 0
    if response.message:
        print(response.message)
    print(f"admission: {response.admission_mode}")
    print(f"allowlist ({len(response.allowlist)}):")
    for key in response.allowlist:
        print(f"  {key}")
    print(f"bans ({len(response.bans)}):")
    for ban in response.bans:
        print(f"  {ban.key}  {time.strftime('%Y-%m-%d %H:%M', time.gmtime(ban.banned_at))} UTC  {ban.reason}")
    return 0


def _send(args: argparse.Namespace, identity: Any) -> Any:

    from protocol import coordinator_pb2 as pb
    from protocol import kinds
    from protocol.messages import sign_message

    action = getattr(pb, f"ADMIN_ACTION_{args.action.upper()}")
    body = pb.AdminBody(action=action, key=args.key, reason=args.reason)
    signed = sign_message(identity, kinds.ADMIN, body.SerializeToString(), now=time.time()).to_proto()
    return rpc.call(args.coordinator, "Admin", pb.AdminRequest(signed=signed), timeout=args.timeout)


def _as_dict(response: Any) -> dict[str, Any]:
    return {
        "message": response.message,
        "admission_mode": response.admission_mode,
        "allowlist": list(response.allowlist),
        "bans": [{"key": b.key, "reason": b.reason, "banned_at": b.banned_at} for b in response.bans],
    }
