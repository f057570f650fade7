"""``swarmtrain doctor``: check that this machine can run a peer, and say what is wrong.

Checks, each printed as one line: Python version, the installed versions of the libraries
swarmtrain builds on, the accelerator, the identity key file, the generated protocol stubs,
and a real two-node hivemind DHT on loopback (which exercises the bundled p2pd daemon).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from protocol.errors import SwarmtrainError
from protocol.identity import Identity, default_key_path

Check = Callable[[], str]


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "doctor",
        help="check this machine: libraries, accelerator, identity, a loopback DHT",
        description="Check that this machine can run a swarmtrain peer.",
    )
    parser.add_argument("--key", type=Path, default=None, help=f"identity key file (default: {default_key_path()})")
    parser.add_argument("--skip-network", action="store_true", help="do not start a loopback DHT")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    checks: list[tuple[str, Check]] = [
        ("python", _python),
        ("packages", _packages),
        ("protocol stubs", _stubs),
        ("accelerator", _accelerator),
        ("identity", lambda: _identity(args.key or default_key_path())),
    ]
    if not args.skip_network:
        checks.append(("loopback DHT", _dht))
    failures = 0
    for name, check in checks:
        try:
            detail = check()
            print(f"ok    {name}: {detail}")
        except Exception as exc:  # noqa: BLE001 - doctor reports every failure, never crashes
            failures += 1
            print(f"FAIL  {name}: {exc}")
    print("all checks passed" if not failures else f"{failures} check(s) failed")
    return 0 if not failures else 1


def _python() -> str:
    if sys.version_info < (3, 11):  # noqa: UP036 - an installed copy run by an older interpreter says so
        raise SwarmtrainError(f"Python >= 3.11 needed, this is {sys.version.split()[0]}")
    return sys.version.split()[0]


def _packages() -> str:
    names = ["torch", "hivemind", "grpcio", "protobuf", "pydantic", "cryptography"]
    return ", ".join(f"{n} {importlib.metadata.version(n)}" for n in names)


def _stubs() -> str:
    from protocol import coordinator_pb2, coordinator_pb2_grpc  # noqa: F401

    return "coordinator API importable"


def _accelerator() -> str:
    import torch

    if torch.cuda.is_available():
        names = {torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())}
        bf16 = "bf16" if torch.cuda.is_bf16_supported() else "no bf16"
        return f"{torch.cuda.device_count()} x CUDA ({', '.join(sorted(names))}; {bf16})"
    return "no CUDA device: CPU only (fp32)"


def _identity(path: Path) -> str:
    if not path.exists():
        return f"no key at {path} yet (a peer creates one on first start, or run `swarmtrain keygen`)"
    return f"{Identity.load(path).public_key.id} ({path})"


def _dht() -> str:
    from hivemind import DHT
    from hivemind.utils.timed_storage import get_dht_time

    started = time.monotonic()
    first = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        second = DHT(start=True, initial_peers=first.get_visible_maddrs(), host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        try:
            first.store("swarmtrain-doctor", "ok", get_dht_time() + 30)
            found = second.get("swarmtrain-doctor", latest=True)
            if found is None or found.value != "ok":
                raise SwarmtrainError("two local DHT nodes could not exchange a record")
        finally:
            second.shutdown()
    finally:
        first.shutdown()
    return f"two nodes exchanged a record in {time.monotonic() - started:.1f} s"
