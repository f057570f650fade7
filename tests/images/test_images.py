"""The images a volunteer and an operator run (issue #32), built here and a swarm run from them.

``make test-images`` runs this module (a step of its own in ``.ci/run``, after ``make test``:
building the images takes minutes). It builds both images with ``docker/images.sh`` from the
local Debian 12 stand-in base (buildah; no registry is reachable here), then:

- lists every file of every layer of both images: no key, token or secret in any;
- runs ``docker/compose.yaml``'s coordinator and peer services from the images and nothing else,
  each in its own network namespace (``benchmarks.netsim.WanSim``) as compose gives each service
  its own network, under the service's name (``/etc/hosts``), with the service's command after
  the image's entrypoint, as the image's user, with the service's volumes as host folders;
- checks the image's HEALTHCHECK command inside the coordinator's container, 3 rounds averaged by
  both peers into one state, credit granted to both, the peers' processes running as the image's
  non-root user, the peer's keys surviving a restart of its container on the same volume, and
  ``swarmtrain doctor`` inside the peer image.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from benchmarks.netsim import WanSim
from benchmarks.scale import process_tree
from swarmtrain.localswarm import wait_until

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
TAG = "test"
IMAGES = {"swarmtrain-peer": "peer", "swarmtrain-coordinator": "coordinator"}
USER_ID = 10001
"""The images' user (``useradd --uid 10001`` in both Dockerfiles)."""
ROUNDS = 3
JOINING = re.compile(r"^peer (\S+) of account (\S+)( \(new identity\))? joining run", re.MULTILINE)
"""The line a starting peer prints: its node's and its account's public ids."""

needs_images = pytest.mark.skipif(
    os.environ.get("SWARMTRAIN_TEST_IMAGES") != "1",
    reason="builds container images for minutes: `make test-images`, the step .ci/run runs after `make test`, runs it",
)


@pytest.fixture(scope="module")
def built() -> dict[str, Any]:
    """Both images, tagged ``TAG``, built from the stand-in base; ``build/images.json``."""
    assert os.geteuid() == 0, "building and running images here needs root (buildah, network namespaces)"
    env = {**os.environ, "IMAGES_BASE": "standin", "IMAGES_TAG": TAG, "PY": sys.executable}
    untagged_before = _untagged()
    done = subprocess.run(
        ["bash", str(DOCKER / "images.sh")], cwd=REPO, env=env, capture_output=True, text=True, timeout=2400
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    print(done.stdout, flush=True)
    # a build leaves no untagged image behind: each would hold ~0.5 GB of the machine's disk for
    # good, and a machine that builds once per commit runs out of it
    left = _untagged() - untagged_before
    assert not left, f"the build left {len(left)} untagged images behind: {sorted(left)}"
    return json.loads((REPO / "build" / "images.json").read_text())


LAUNCHES = 3
"""How many times a container is launched when buildah itself fails to start it (below)."""


def launcher_failed(output: str) -> bool:
    """Whether ``buildah run`` failed to re-execute itself before starting the container's
    program: it copies its own binary into a memfd and seals it, and the kernel can refuse the
    seal with EBUSY while the memfd's pages are briefly pinned (memory compaction or migration
    on a loaded machine). Nothing of the image ran; a docker or compose user never meets this
    step. Seen once in CI on the coordinator's first start."""
    return "sealing memfd copy" in output


def _untagged() -> set[str]:
    """The ids of the untagged (dangling) images in buildah's store (none before it is installed)."""
    if shutil.which("buildah") is None:
        return set()
    return set(_buildah("images", "-q", "--no-trunc", "--filter", "dangling=true").split())


def _buildah(*args: str, timeout: float = 600) -> str:
    for _ in range(LAUNCHES):
        done = subprocess.run(["buildah", *args], capture_output=True, text=True, timeout=timeout)
        if not (done.returncode != 0 and args[0] == "run" and launcher_failed(done.stderr)):
            break
    assert done.returncode == 0, f"buildah {' '.join(args)}: {done.stderr[-2000:]}"
    return done.stdout


def _config(image: str) -> dict[str, Any]:
    """The image's docker-format config (entrypoint, user, healthcheck, env)."""
    found: dict[str, Any] = json.loads(_buildah("inspect", "--type", "image", image))["Docker"]["config"]
    return found


# ---------------------------------------------------------------------------------------- secrets

SECRET_NAMES = re.compile(
    r"(^|/)(identity\.key|node\.key|[^/]*\.key|id_(rsa|dsa|ecdsa|ed25519)|\.netrc|\.pypirc|\.git-credentials"
    r"|\.npmrc|\.env|credentials(\.json)?|(access|auth|api)[-_]?tokens?(\.[a-z]+)?|coordinator\.db|swarm\.db)$",
    re.IGNORECASE,
)
"""File names that hold keys, tokens or passwords (ours: account and node keys, the coordinator's
database; anyone's: ssh keys, netrc, package index credentials)."""
PRIVATE_KEY = re.compile(rb"-----BEGIN [A-Z ]*PRIVATE KEY-----\r?\n[A-Za-z0-9+/=\r\n:,-]{40}")
"""A PEM private key with its body (not the bare header line a library keeps to parse one)."""
HOMES = ("home/swarm/", "root/")
"""Folders a build could leave a user's keys in."""


def _layers(image: str, into: Path) -> list[Path]:
    """The image's layers as tar files (``buildah push`` to a ``dir:`` copy, uncompressed)."""
    into.mkdir(parents=True)
    _buildah("push", "--disable-compression", image, f"dir:{into}", timeout=900)
    manifest = json.loads((into / "manifest.json").read_text())
    return [into / layer["digest"].split(":", 1)[1] for layer in manifest["layers"]]


def _secrets_in(layer: Path) -> tuple[int, list[str]]:
    """(files in ``layer``, those that look like a key, token or secret: by name, or a private key
    in a file under 1 MB)."""
    found, count = [], 0
    with tarfile.open(layer) as tar:
        for member in tar:
            if not member.isfile():
                continue
            count += 1
            name = member.name.lstrip("./")
            if SECRET_NAMES.search(name):
                found.append(f"{name} (its name)")
                continue
            if member.size < 1_000_000:
                data = tar.extractfile(member)
                if data is not None and PRIVATE_KEY.search(data.read()):
                    found.append(f"{name} (a private key)")
            if name.startswith(HOMES) and not name.endswith((".bashrc", ".profile", ".bash_logout")):
                found.append(f"{name} (a file in a home folder)")
    return count, found


@needs_images
def test_no_key_token_or_secret_in_any_layer(built: dict[str, Any], tmp_path: Path) -> None:
    for image in IMAGES:
        counted = 0
        for layer in _layers(f"{image}:{TAG}", tmp_path / image):
            count, found = _secrets_in(layer)
            counted += count
            assert not found, f"{image}: layer {layer.name[:12]} holds {found[:10]}"
        assert counted > 10_000, f"{image}: only {counted} files listed"  # the whole image was read


def test_the_secret_scan_finds_what_it_looks_for(tmp_path: Path) -> None:
    """The scan of the test above, on a layer that holds what it must find."""
    layer = tmp_path / "layer.tar"
    with tarfile.open(layer, "w") as tar:
        for name, data in (
            ("home/swarm/.swarmtrain/identity.key", b"x"),
            (
                "opt/app/server.pem",
                b"-----BEGIN EC PRIVATE KEY-----\nMHcCAQEEIIrYSSNQFaA2Hwf1duRSxKtLYX5CB04fSeQ6tF1aY/PuoAoGCCqGSM49\n",
            ),
            ("opt/lib/parser.py", b'_START = b"-----BEGIN OPENSSH PRIVATE KEY-----"\n'),
            ("opt/lib/tokenizers.dist-info/tokenizers.json", b"{}"),
            ("root/.netrc", b"machine x login y password z"),
            ("usr/share/doc/readme.txt", b"nothing"),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    count, found = _secrets_in(layer)
    assert count == 6 and len(found) == 3, found
    assert not any(word in f for f in found for word in ("readme", "parser", "tokenizers"))


PACKAGES = ("protocol", "engine", "relay", "peer", "coordinator", "swarmtrain")
HASH_INSTALLED = """
import hashlib, importlib, json, pathlib, sys
found = {}
for name in sys.argv[1:]:
    root = pathlib.Path(importlib.import_module(name).__file__).parent
    for path in sorted(root.rglob("*.py")):
        found[f"{name}/{path.relative_to(root)}"] = hashlib.sha256(path.read_bytes()).hexdigest()
print(json.dumps(found))
"""
"""Run inside an image with the package names as arguments: the SHA-256 of each of their files."""


@needs_images
def test_the_images_hold_this_checkout(built: dict[str, Any]) -> None:
    """Every Python file of the project in each image is this checkout's, byte for byte (a layer
    cache that reused an older install would fail here)."""
    import hashlib

    expected = {
        f"{name}/{path.relative_to(REPO / name)}": hashlib.sha256(path.read_bytes()).hexdigest()
        for name in PACKAGES
        for path in sorted((REPO / name).rglob("*.py"))
    }
    for image in IMAGES:
        container = f"st-images-check-{os.getpid()}"
        subprocess.run(["buildah", "rm", container], capture_output=True, check=False)
        _buildah("from", "--name", container, f"{image}:{TAG}")
        try:
            installed = json.loads(
                _buildah("run", "--isolation", "chroot", container, "--", "python", "-c", HASH_INSTALLED, *PACKAGES)
            )
        finally:
            subprocess.run(["buildah", "rm", container], capture_output=True, check=False)
        differ = sorted(k for k in expected if installed.get(k) != expected[k])
        assert not differ, f"{image}: {len(differ)} files differ from this checkout, e.g. {differ[:5]}"


# ------------------------------------------------------------------------------------ containers


class Service:
    """One compose service run from its image: a buildah working container, started in its own
    network namespace with the service's command and volumes."""

    def __init__(self, sim: WanSim, name: str, spec: dict[str, Any], root: Path, hosts: Path) -> None:
        """``root``: where its logs go, and its named volumes (``root/volumes/NAME``)."""
        self.sim, self.name, self.spec, self.root = sim, name, spec, root
        volumes = root / "volumes"
        self.image = f"{spec['image']}:{TAG}"
        self.config = _config(self.image)
        self.container = f"st-images-{name}-{os.getpid()}"
        subprocess.run(["buildah", "rm", self.container], capture_output=True, check=False)
        _buildah("from", "--name", self.container, self.image)
        self.mounts = ["-v", f"{hosts}:/etc/hosts:ro"]
        for volume in spec.get("volumes", []):
            source, target, *mode = volume.split(":")
            if source.startswith("."):  # a path of the repository, relative to the compose file
                host = (DOCKER / source).resolve()
                assert host.exists(), f"{name}: {source} is not in the repository"
            else:  # a named volume: a folder of its own, owned like a fresh docker volume's copy
                host = volumes / source
                host.mkdir(parents=True, exist_ok=True)
                os.chown(host, USER_ID, USER_ID)
            self.mounts += ["-v", ":".join([str(host), target, *mode])]
            if target in (self.config.get("Volumes") or {}):
                # as docker does, the service's volume replaces the image's anonymous one there
                # (buildah 1.28 mounts both, in a random order: the bind lost about 5 times in 6)
                _buildah("config", "--volume", f"{target}-", self.container)
        self.logs: list[Path] = []
        self.launches = 0
        self.proc: subprocess.Popen[bytes] | None = None

    def argv(self, command: list[str]) -> list[str]:
        """``command`` run in this service's container, in its network namespace. (nsenter
        switches the network namespace only: under ``ip netns exec``, which also unshares the
        mount namespace, buildah 1.28 mounts the image's anonymous VOLUMEs over ``-v`` binds.)"""
        netns = f"--net=/var/run/netns/{self.sim.netns(self.name)}"
        run = ["buildah", "run", "--isolation", "chroot", "--no-hosts", *self.mounts, self.container, "--", *command]
        return ["nsenter", netns, *run]

    def command(self) -> list[str]:
        """The image's entrypoint, then the service's command: what compose runs."""
        return [*self.config["Entrypoint"], *map(str, self.spec.get("command", self.config.get("Cmd") or []))]

    def start(self) -> None:
        self.launches = 1
        self._launch()

    def _launch(self) -> None:
        log = self.sim_log()
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                self.argv(self.command()), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def running(self) -> bool:
        """Whether the service's process runs. One that buildah failed to launch
        (:func:`launcher_failed`: the image's program never started) is launched again, up to
        ``LAUNCHES`` times in all, and counts as running."""
        assert self.proc is not None
        if self.proc.poll() is None:
            return True
        if launcher_failed(self.output()) and self.launches < LAUNCHES:
            self.launches += 1
            self._launch()
            return True
        return False

    def sim_log(self) -> Path:
        log = self.root / f"{self.name}-{len(self.logs)}.log"
        self.logs.append(log)
        return log

    def output(self) -> str:
        return self.logs[-1].read_text(errors="replace") if self.logs else ""

    def exec(self, command: list[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """``command`` in this service's container and network namespace, to completion (launched
        again where buildah failed to launch it: :func:`launcher_failed`)."""
        for _ in range(LAUNCHES):
            done = subprocess.run(self.argv(command), capture_output=True, text=True, timeout=timeout, check=False)
            if not (done.returncode != 0 and launcher_failed(done.stderr)):
                break
        return done

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM to the container's own process (its entrypoint's), as ``docker stop`` sends it;
        SIGKILL to the whole process group after ``timeout``. Its exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            main = self.main_process()
            if main is not None:
                os.kill(main, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        return self.proc.returncode

    def main_process(self) -> int | None:
        """The pid of the container's entrypoint process (the first ``swarmtrain`` of the tree)."""
        uids = self.process_uids()
        return min(uids, key=lambda pid: self._depth(pid)) if uids else None

    @staticmethod
    def _depth(pid: int) -> int:
        depth = 0
        while pid > 1:
            try:
                pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                break
            depth += 1
        return depth

    def process_uids(self) -> dict[int, int]:
        """pid → real uid of every process of this service running ``swarmtrain``."""
        assert self.proc is not None
        tree = process_tree(self.proc.pid)
        uids = {}
        for pid in tree:
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            if b"swarmtrain" in cmdline and b"buildah" not in cmdline.split(b"\0")[0]:
                uids[pid] = int(re.search(r"^Uid:\s+(\d+)", status, re.MULTILINE).group(1))  # type: ignore[union-attr]
        return uids

    def remove(self) -> None:
        subprocess.run(["buildah", "rm", self.container], capture_output=True, check=False, timeout=120)


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


@pytest.fixture
def services(built: dict[str, Any], tmp_path: Path) -> Iterator[dict[str, Service]]:
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    ours = {name: spec for name, spec in compose["services"].items() if spec.get("image") in IMAGES}
    assert set(ours) == {"coordinator", "peer1", "peer2"}, ours
    started: dict[str, Service] = {}
    with WanSim(hosts=list(ours), rate="1gbit", prefix="sti") as sim:
        hosts = tmp_path / "hosts"
        hosts.write_text("127.0.0.1 localhost\n" + "".join(f"{sim.ip(name)} {name}\n" for name in ours))
        try:
            for name, spec in ours.items():
                started[name] = Service(sim, name, spec, tmp_path, hosts)
            yield started
        finally:
            for service in started.values():
                if service.proc is not None:
                    service.stop(timeout=20)
                service.remove()


@needs_images
def test_a_swarm_runs_from_the_images(services: dict[str, Service]) -> None:
    coordinator, peer1, peer2 = services["coordinator"], services["peer1"], services["peer2"]
    coordinator.start()
    base = f"http://{coordinator.sim.ip('coordinator')}:8080/"

    def healthy() -> bool:
        try:
            return bool(_get(base + "healthz")["ok"])
        except OSError:
            assert coordinator.running(), coordinator.output()[-3000:]
            return False

    wait_until(healthy, 180, "the coordinator's /healthz")
    # the image's own HEALTHCHECK, run inside the coordinator's container
    check = coordinator.config["Healthcheck"]["Test"]
    assert check[0] == "CMD", check
    done = coordinator.exec(check[1:], timeout=60)
    assert done.returncode == 0 and json.loads(done.stdout)["ok"], done.stdout + done.stderr

    for peer in (peer1, peer2):
        peer.start()

    def landed() -> bool:
        for peer in (peer1, peer2):
            assert peer.running(), peer.output()[-3000:]
        views = _get(base + "api/v1/status")["rounds"]
        return sum(1 for v in views if v["decided"] and v["peers_averaged"] == 2 and v["states"] == 1) >= ROUNDS

    wait_until(landed, 600, f"{ROUNDS} rounds averaged by both peers")
    for view in _get(base + "api/v1/status")["rounds"]:
        assert view["states"] <= 1, f"round {view['round']} split: {view}"  # one state: equal digests
    rounds = _get(base + "api/v1/rounds")
    assert len([r for r in rounds if r["group_size"] == 2 and r["state_digest"].startswith("blake3:")]) >= ROUNDS

    # the peers run as the image's user, not root
    for peer in (peer1, peer2):
        uids = peer.process_uids()
        assert uids and set(uids.values()) == {USER_ID}, (peer.name, uids)

    # both credited
    ids = {}
    for peer in (peer1, peer2):
        found = JOINING.search(peer.output())
        assert found, peer.output()[-3000:]
        ids[peer.name] = found.groups()[:2]

    def credited() -> bool:
        by_peer = _get(base + "api/v1/credits")["by_peer"]
        return all(by_peer.get(node, {}).get("samples", 0) > 0 for node, _ in ids.values())

    wait_until(credited, 120, "credit granted to both peers")

    # a restart of peer1's container on the same volume keeps its key: the same account
    assert peer1.stop() == 0, peer1.output()[-3000:]
    assert "peer stopped cleanly" in peer1.output()
    first = peer1.output()
    assert "created your account key" in first
    peer1.start()
    wait_until(
        lambda: "joining run" in peer1.output() or not peer1.running(),
        180,
        "peer1 to start again",
    )
    again = JOINING.search(peer1.output())
    # the account key is the volume's (each run signs with a fresh node key it endorses)
    assert again and again.group(2) == ids["peer1"][1] and not again.group(3), peer1.output()[-3000:]
    assert "created your account key" not in peer1.output()

    # the doctor, inside the peer image, against the run's coordinator
    done = peer2.exec(["swarmtrain", "doctor", "--coordinator", "coordinator:7500", "--no-benchmark"], timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "coordinator" in done.stdout
