"""``swarmtrain status --coordinator HOST:PORT [--json]``: the swarm's health in the terminal."""

from __future__ import annotations

import argparse
import json
from typing import Any

from peer.net.announce import coordinator_address
from swarmtrain.commands import rpc

SHOWN_ROUNDS = 5
"""Rounds the table shows (``--json`` carries every round the coordinator sent)."""


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "status", help="show a run's swarm health from its coordinator", description="Show a run's swarm health."
    )
    parser.add_argument(
        "--coordinator",
        required=True,
        type=coordinator_address,
        metavar="HOST:PORT",
        help="the coordinator's gRPC address",
    )
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
        for view in data["rounds"]:
            view["round"] = int(view["round"])
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
    print_rounds(status.rounds[:SHOWN_ROUNDS])
    for peer in status.peers:
        print(
            f"  {PublicKey(bytes(peer.public_key)).id}  {peer.state:<11} {peer.samples_per_second:8.1f} samples/s  "
            f"{peer.network_path or ('reachable' if peer.reachable else 'client mode')}"
            + (f", hole-punched to {peer.punched_peers}" if peer.punched_peers else "")
            + f"  v{peer.software_version}"
            + (f"  {peer.local_ranks} local ranks" if peer.local_ranks > 1 else "")
        )
    return 0


def print_rounds(rounds: Any) -> None:
    """One line per round, highest first: groups, distinct states, peers averaged, reports; a
    round with more than one state is marked (the swarm split)."""
    if not rounds:
        return
    print("round      groups  states  averaged  reports")
    for view in rounds:
        marks = ("  SPLIT" if view.states > 1 else "") + ("" if view.decided else "  (reports coming)")
        print(
            f"{view.round:<10} {view.groups:>6}  {view.states:>6}  {view.peers_averaged:>8}  {view.reports:>7}{marks}"
        )
