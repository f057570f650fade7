"""The README's local walk-through, exactly as written, in a fresh copy of the repository.

Every fenced ``sh`` block the README marks with ``<!-- readme-test -->`` on the line before
its fence runs, in order, in one bash session with ``set -euo pipefail`` (as a user types
them into one terminal): ``make demo``, then keygen, a coordinator, two peers, ``swarmtrain
status`` and ``swarmtrain admin`` on loopback. The blocks use the coordinator's fixed ports
(7500 gRPC, 8080 HTTP), so they run in a network namespace of their own (``unshare --net``,
only loopback, up) and a PID namespace of their own: killing the ``unshare`` process this
test started (by its pid; ``--kill-child``) kills every process the blocks started, whatever
they forked. Where namespaces are not permitted the blocks run in a process group this test
leads, and only if those ports are free here.

The copy holds the working tree's files (``git ls-files -co --exclude-standard``, mtimes
kept), so the README being edited is the one that runs. Its ``.venv`` is a directory of its
own whose ``bin`` links to this environment's, with a fresh ``make`` stamp: ``make demo``
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
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MARK = "<!-- readme-test -->"
PORTS = (7500, 8080)
"""The coordinator's default gRPC and HTTP ports, which the README's blocks use."""
DEADLINE_S = 400.0
"""The blocks take 50-100 s on 2 busy cores (``make demo`` about half of it)."""
BLOCK_LINE = "### readme block {}"

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(DEADLINE_S + 40)]


def marked_blocks(readme: str) -> list[str]:
    """The ``sh`` blocks marked for this test, in order, as written."""
    lines = readme.splitlines()
    blocks = []
    for i, line in enumerate(lines):
        if line.strip() != MARK:
            continue
        fence = lines[i + 1] if i + 1 < len(lines) else ""
        assert fence.strip() == "```sh", f"README line {i + 2}: {MARK} must precede a ```sh fence, not {fence!r}"
        end = next(j for j in range(i + 2, len(lines)) if lines[j].strip() == "```")
        blocks.append("\n".join(lines[i + 2 : end]))
    return blocks


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
    venv = dest / ".venv"
    venv.mkdir()
    (venv / "bin").symlink_to(Path(sys.prefix) / "bin")
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

    blocks = marked_blocks((copy / "README.md").read_text())
    text = "\n".join(blocks)
    needed_commands = ["make demo", "swarmtrain keygen", "swarmtrain coordinator", "swarmtrain doctor"]
    for needed in [*needed_commands, "swarmtrain peer", "swarmtrain status"]:
        assert needed in text, f"no marked README block runs {needed!r}"
    assert "swarmtrain admin list" in text
    script = tmp_path / "readme.sh"
    body = "".join(f"echo '{BLOCK_LINE.format(i)}'\n{block}\n" for i, block in enumerate(blocks))
    script.write_text("set -euo pipefail\n" + body)

    log = tmp_path / "readme.log"
    code = run_script(script, copy, env, log)
    output = log.read_text(errors="replace")
    assert code == 0, f"a README block failed (exit {code}):\n{tail(log)}"

    demo = section(output, 0)
    assert "demo summary" in demo and "demo succeeded" in demo, demo[-3000:]
    assert re.search(r"digests agree:\s+yes", demo), demo[-3000:]

    key = home / ".config" / "swarmtrain" / "identity.key"
    assert key.exists() and stat.S_IMODE(key.stat().st_mode) == 0o600
    assert f"key written to {key}" in output
    assert "examples/demo.toml: ok sha256:" in output
    assert "grpc: 127.0.0.1:7500" in output and "http: http://127.0.0.1:8080/" in output
    doctor = section(output, next(i for i, block in enumerate(blocks) if "swarmtrain doctor" in block))
    assert "ok    reachable from outside: direct: the coordinator reached this machine" in doctor, doctor
    assert "ok    expected contribution:" in doctor and "\nall checks passed" in doctor, doctor

    # two volunteers: the keygen account and one whose key the peer created on its first run
    accounts = re.findall(r"^peer ed25519:\S+ of account (ed25519:\S+)( \(new identity\))? joining", output, re.M)
    assert len(accounts) == 2 and len({a for a, _ in accounts}) == 2, accounts
    assert sorted(bool(new) for _, new in accounts) == [False, True], accounts
    assert (copy / "bob.key").exists()
    # each leaves with the coordinator's account of its work: credited, or still pending (the
    # coordinator decides a round a tick after its last report; the demo above waits for that)
    credits = re.findall(r"^coordinator: credited ([\d,]+) samples \(.*?\)(?:, ([\d,]+) pending)?$", output, re.M)
    counted = [sum(int(n.replace(",", "") or 0) for n in figures) for figures in credits]
    assert len(counted) == 2 and all(n > 0 for n in counted), output[-4000:]
    assert output.count("peer stopped cleanly") == 2

    admin_block = next(i for i, block in enumerate(blocks) if "swarmtrain admin list" in block)
    status, _, admin = section(output, admin_block).partition("admission: ")
    assert re.search(r"^round [1-9]\d* ", status, re.M), status  # `swarmtrain status`, after the peers left
    assert len(re.findall(r"^  ed25519:\S+ ", status, re.M)) == 2, status
    assert admin.startswith("open") and "bans (0):" in admin, admin
    assert output.rstrip().endswith("coordinator stopped"), output[-2000:]
