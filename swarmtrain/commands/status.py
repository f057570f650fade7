"""``swarmtrain status --coordinator HOST:PORT [--json]``: the swarm's health in the terminal."""

from __future__ import annotations

import argparse
import json
from typing import Any

from swarmtrain.commands import rpc


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "status", help="show a run's swarm health from its coordinator", description="Show a run's swarm health."
    )
    parser.add_argument("--coordinator", required=True, metavar="HOST:PORT", help="the coordinator's gRPC address")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the coordinator")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from google.protobuf.json_format import MessageToDict

    from protocol import coordinator_pb2 as pb
    from protocol.identity import PublicKey

    status = rpc.call(args.coordinator, "GetStatus", pb.StatusRequest(), timeout=args.timeout)
    if args.json:
        data = MessageToDict(status, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
        data["current_round"] = int(data.get("current_round", 0))  # proto3 JSON writes int64 as a string
        has_checkpoint = status.HasField("last_checkpoint_round")
        data["last_checkpoint_round"] = status.last_checkpoint_round if has_checkpoint else None
        print(json.dumps(data, indent=2, sort_keys=True))
        return 0
    print(f"run {status.run_name} ({status.spec_digest})")
    print(f"round {status.current_round}  state {status.current_state_digest or '-'}")
    print(
        f"peers online {status.peers_online}  swarm {status.samples_per_second:.1f} samples/s  "
        f"{status.rounds_per_hour:.1f} rounds/h"
    )
    if status.HasField("validation_loss"):
        print(f"validation loss {status.validation_loss:.4f} (round {status.validation_round})")
    if status.HasField("data"):
        data = status.data
        print(
            f"data {data.tokens_trained:,} tokens trained, epoch {data.epoch:.3f}, "
            f"{data.slots_held} of {data.slots} data streams held"
        )
    if status.archive:
        newest = status.last_checkpoint_round if status.HasField("last_checkpoint_round") else "none yet"
        print(f"archive {status.archive}; newest archived round: {newest}")
    for peer in status.peers:
        print(
            f"  {PublicKey(bytes(peer.public_key)).id}  {peer.state:<11} {peer.samples_per_second:8.1f} samples/s  "
            f"{'reachable' if peer.reachable else 'client mode'}  v{peer.software_version}"
            + (f"  {peer.local_ranks} local ranks" if peer.local_ranks > 1 else "")
        )
    return 0
