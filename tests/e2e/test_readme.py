"""The README's blocks, exactly as written, in a fresh copy of the repository.

Every fenced ``sh`` block of the README runs (a test below fails on one that is not marked
with ``<!-- readme-test ... -->`` on the line before its fence), in order, in one bash session
with ``set -euo pipefail``, as the README's roles would type them on their own machines: each
block marked ``role=NAME`` runs with a home directory of that role's own (``HOME``: its own
account key), and ``HOST:PORT`` (the address the operator hands out) stands for the
coordinator's ``127.0.0.1:7500``, ``HOST:`` for ``127.0.0.1:``. A block marked ``until=N`` is a
volunteer's peer: it runs in the background (its own terminal), and before the next block the
session waits until it has printed N round lines, then stops it as the volunteer's Ctrl-C does
(SIGINT to the block's process group: the peer finishes the round in flight, its helper
processes ignore it) and waits for the group to be gone. The blocks use the
coordinator's fixed ports (7500 gRPC, 8080 HTTP), so they run in a network namespace of their
own (``unshare --net``, only loopback, up) and a PID namespace of their own: killing the
``unshare`` process this test started (by its pid; ``--kill-child``) kills every process the
blocks started, whatever they forked. Where namespaces are not permitted the blocks run in a
process group this test leads, and only if those ports are free here.

The copy holds the working tree's files (``git ls-files -co --exclude-standard``, mtimes
kept), so the README being edited is the one that runs, and the dashboard's charting library
that ``make web`` built here. Its ``.venv`` is a directory of its
own whose ``bin``, ``lib`` and ``pyvenv.cfg`` link to this environment's, with a fresh ``make`` stamp: ``make demo``
finds the environment installed and never runs pip (checked with ``make -q`` first), so the
shared environment is never re-installed from the copy.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MARK = re.compile(r"^<!-- readme-test((?: [a-z]+=[\w-]+)*) -->$")
PORTS = (7500, 8080)
"""The coordinator's default gRPC and HTTP ports, which the README's blocks use."""
DEADLINE_S = 420.0
"""The blocks take 100-200 s on 2 busy cores (``make demo`` about a minute of it)."""
ROUND_WAIT_S = 240
"""How long a volunteer's block may take to print its rounds (the doctor's benchmark, joining)."""
BLOCK_LINE = "### readme block {}"
OUTPUT_LINE = "### readme block {} output"
ADDRESSES = (("HOST:PORT", "127.0.0.1:7500"), ("HOST:", "127.0.0.1:"))
README_LINES = 250
"""A newcomer reads the README in five minutes."""

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(DEADLINE_S + 40)]


@dataclass(frozen=True)
class Block:
    code: str
    role: str | None = None
    until: int | None = None
    """Rounds a volunteer's peer runs before it is stopped (None: the block runs to its end)."""


def readme_blocks(readme: str) -> list[Block]:
    """Every ``sh`` block, in order, with its marker's options; AssertionError for an unmarked one."""
    lines = readme.splitlines()
    blocks = []
    for i, line in enumerate(lines):
        if line.strip() != "```sh":
            continue
        marker = MARK.match(lines[i - 1].strip()) if i else None
        assert marker, f"README line {i + 1}: a ```sh block without {MARK.pattern!r} before it runs nowhere"
        options = dict(option.split("=", 1) for option in marker.group(1).split())
        assert set(options) <= {"role", "until"}, f"README line {i}: unknown options {options}"
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        until = int(options["until"]) if "until" in options else None
        blocks.append(Block("\n".join(lines[i + 1 : end]), options.get("role"), until))
    return blocks


def session_script(blocks: list[Block], homes: Path, scratch: Path) -> str:
    """One bash session running ``blocks`` as the module docstring says."""
    out = ["set -euo pipefail", "EVERYONE=$HOME", "pending=()"]
    for i, block in enumerate(blocks):
        code = block.code
        for placeholder, address in ADDRESSES:
            code = code.replace(placeholder, address)
        home = f"{homes}/{block.role}" if block.role else "$EVERYONE"
        if block.until is None:
            out += ['for p in "${pending[@]}"; do stop_after_rounds $p; done', "pending=()"]
            out += [f"echo '{BLOCK_LINE.format(i)}'", f"mkdir -p {home}", f"export HOME={home}", code]
            continue
        path = scratch / f"block{i}.sh"
        path.write_text(code + "\n")
        out += [
            f"echo '{BLOCK_LINE.format(i)}'",
            f"mkdir -p {home}",
            f"HOME={home} setsid bash -euo pipefail {path} > {scratch}/block{i}.log 2>&1 &",
            f"pending+=({i}:$!:{block.until})",
        ]
    out += ['for p in "${pending[@]}"; do stop_after_rounds $p; done']
    helper = f"""stop_after_rounds() {{  # BLOCK:PID:ROUNDS
  local block=${{1%%:*}} rest=${{1#*:}}; local pid=${{rest%%:*}} rounds=${{rest#*:}}
  local log={scratch}/block$block.log deadline=$((SECONDS + {ROUND_WAIT_S}))
  until [ "$(grep -c '^round ' $log || true)" -ge "$rounds" ]; do
    if [ $SECONDS -ge $deadline ] || ! kill -0 -- -$pid 2>/dev/null; then
      echo "block $block printed fewer than $rounds rounds:"; cat $log; return 1
    fi
    sleep 1
  done
  kill -INT -- -$pid  # a terminal's Ctrl-C: SIGINT to the foreground process group
  deadline=$((SECONDS + 120))
  while kill -0 -- -$pid 2>/dev/null; do
    [ $SECONDS -lt $deadline ] || {{ echo "block $block did not stop within 120 s"; cat $log; return 1; }}
    sleep 0.5
  done
  echo "### readme block $block output"; cat $log
}}"""
    return "\n".join([helper, *out]) + "\n"


def fresh_copy(dest: Path) -> None:
    """The repository's tracked and untracked (not ignored) files as they are now, mtimes kept,
    with this environment's ``bin`` as its ``.venv/bin`` and an up-to-date ``make`` stamp."""
    listing = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listing.split("\0")):
        source = REPO / name
        if not source.exists() and not source.is_symlink():
            continue  # tracked, deleted in the working tree
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target, follow_symlinks=False)
    # the dashboard's charting library, as `make web` left it here (ignored by git, newer than
    # web/package-lock.json): `make demo` in the copy finds it built and runs no npm
    vendor = REPO / "coordinator" / "http" / "static" / "vendor"
    if vendor.is_dir():
        shutil.copytree(vendor, dest / vendor.relative_to(REPO))
    venv = dest / ".venv"
    venv.mkdir()
    for name in ("bin", "lib", "lib64", "pyvenv.cfg"):  # `python` there is this environment's too
        if (Path(sys.prefix) / name).exists():
            (venv / name).symlink_to(Path(sys.prefix) / name)
    (venv / ".installed").touch()  # newer than every copied file: make installs nothing


def namespaces_permitted() -> bool:
    try:
        probe = subprocess.run([*namespace_prefix(), "sh", "-c", "ip link set lo up"], capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return probe.returncode == 0


def namespace_prefix() -> list[str]:
    return ["unshare", "--net", "--pid", "--fork", "--mount-proc", "--kill-child", "--"]


def port_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def run_script(script: Path, cwd: Path, env: dict[str, str], log: Path) -> int:
    """Run ``script`` with bash in its own namespaces (or process group); kill all it started."""
    if namespaces_permitted():
        argv = [*namespace_prefix(), "bash", "-c", 'ip link set lo up && bash "$0"', str(script)]
    else:
        busy = [port for port in PORTS if not port_free(port)]
        if busy:
            pytest.skip(f"no network namespaces here (unshare) and ports {busy} are in use")
        argv = ["bash", str(script)]
    with log.open("w") as out:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the README's blocks ran past {DEADLINE_S:.0f} s:\n{tail(log)}")
        finally:
            # the process group this test leads: unshare (whose death kills its namespace) or bash
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=30)


def tail(log: Path, lines: int = 120) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def section(output: str, index: int) -> str:
    """What printed while block ``index`` ran (background processes may print into it too)."""
    start = output.index(BLOCK_LINE.format(index))
    end = output.find(BLOCK_LINE.format(index + 1), start)
    return output[start : end if end >= 0 else None]


def test_the_readme_walk_through_runs_as_written_in_a_fresh_copy(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if not (Path(sys.prefix) / "bin" / "swarmtrain").exists() or shutil.which("make") is None:
        pytest.skip("needs make and swarmtrain installed in the environment running the tests")
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout: nothing to copy the repository's files from")
    copy = tmp_path / "swarmtrain"
    fresh_copy(copy)
    home = tmp_path / "home"  # the user's home: keygen writes ~/.config/swarmtrain/identity.key
    home.mkdir()
    # the demo's work directory (mkdtemp) and torch's shared-memory manager socket go here:
    # short, since a Unix socket's path must fit in 108 bytes (pytest's tmp_path under xdist
    # does not), and removed afterwards
    scratch = Path(tempfile.mkdtemp(prefix="readme-", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(scratch, ignore_errors=True))
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in {"SWARMTRAIN_HOME", "XDG_CONFIG_HOME", "SWARMTRAIN_PARENT_PID", "VIRTUAL_ENV"}
        and key not in {"MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES"}  # `make test` runs this test
    }
    env |= {
        "HOME": str(home),
        "PATH": f"{copy / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        "TMPDIR": str(scratch),
        "OMP_NUM_THREADS": "1",  # two peers share this machine's cores
        "PYTHONUNBUFFERED": "1",
    }
    stamp = subprocess.run(["make", "-q", ".venv/.installed"], cwd=copy, env=env, capture_output=True, text=True)
    assert stamp.returncode == 0, f"make would re-install the environment from the copy:\n{stamp.stdout}"

    readme = (copy / "README.md").read_text()
    assert len(readme.splitlines()) < README_LINES
    blocks = readme_blocks(readme)
    text = "\n".join(block.code for block in blocks)
    for needed in ["make demo", "swarmtrain coordinator", "swarmtrain doctor", "swarmtrain peer", "swarmtrain status"]:
        assert needed in text, f"no README block runs {needed!r}"
    roles = {block.role for block in blocks}
    assert {"operator", "gpu-volunteer", "home-volunteer", "watcher"} <= roles, roles
    script = tmp_path / "readme.sh"
    script.write_text(session_script(blocks, tmp_path / "homes", scratch))

    log = tmp_path / "readme.log"
    code = run_script(script, copy, env, log)
    output = log.read_text(errors="replace")
    assert code == 0, f"a README block failed (exit {code}):\n{tail(log)}"

    demo = section(output, 0)
    assert "demo summary" in demo and "demo succeeded" in demo, demo[-3000:]
    assert re.search(r"digests agree:\s+yes", demo), demo[-3000:]

    operator = section(output, 1)
    assert "examples/demo.toml: ok sha256:" in operator, operator
    assert "one peer of demo (examples/demo.toml) needs:" in operator and "GB per day" in operator, operator
    # the coordinator runs in the background: its lines may come after `status` answered
    assert "grpc: 127.0.0.1:7500" in output and "http: http://127.0.0.1:8080/" in output, output[:6000]
    assert "peers join with: swarmtrain peer --coordinator 127.0.0.1:7500 --coordinator-key ed25519:" in output

    volunteers = [i for i, block in enumerate(blocks) if block.until is not None]
    assert len(volunteers) == 2
    gpu, home = (output_of(output, i) for i in volunteers)
    assert "ok    reachable from outside: direct: the coordinator reached this machine" in gpu, gpu
    assert "ok    expected contribution:" in gpu and "\nall checks passed" in gpu, gpu
    key = tmp_path / "homes" / "home-volunteer" / ".config" / "swarmtrain" / "identity.key"
    assert key.exists() and stat.S_IMODE(key.stat().st_mode) == 0o600
    assert f"key written to {key}" in home, home
    # two volunteers on two accounts: the keygen one, and one whose key the peer created
    accounts = []
    for volunteer in (gpu, home):
        assert re.search(r"^network: direct", volunteer, re.M), volunteer
        assert len(re.findall(r"^round +\d+ \| loss", volunteer, re.M)) >= 4, volunteer
        assert "peer stopped cleanly" in volunteer, volunteer[-3000:]
        accounts += re.findall(
            r"^peer ed25519:\S+ of account (ed25519:\S+)( \(new identity\))? joining", volunteer, re.M
        )
    assert len(accounts) == 2 and len({a for a, _ in accounts}) == 2, accounts
    assert sorted(bool(new) for _, new in accounts) == [False, True], accounts
    # each leaves with the coordinator's account of its work: credited, or still pending
    credits = re.findall(r"^coordinator: credited ([\d,]+) samples \(.*?\)(?:, ([\d,]+) pending)?$", output, re.M)
    counted = [sum(int(n.replace(",", "") or 0) for n in figures) for figures in credits]
    assert len(counted) == 2 and all(n > 0 for n in counted), output[-4000:]

    watcher = section(output, next(i for i, block in enumerate(blocks) if block.role == "watcher"))
    assert re.search(r"^round [1-9]\d* ", watcher, re.M), watcher  # after the volunteers left
    assert len(re.findall(r"^  ed25519:\S+ ", watcher, re.M)) == 2, watcher

    export = section(output, len(blocks) - 1)
    assert (copy / "my-model" / "model.safetensors").exists(), export
    assert re.search(r"^def main\(", export, re.M), export  # the model's continuation of the prompt
    assert output.rstrip().endswith("coordinator stopped"), output[-2000:]


def output_of(output: str, index: int) -> str:
    """What a background block printed (the session prints it once the block has stopped)."""
    start = output.index(OUTPUT_LINE.format(index))
    end = output.find("### readme block", start + 10)
    return output[start : end if end >= 0 else None]
