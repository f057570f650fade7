"""Data in: a token run's prepared data fetched from a real HTTP server (`swarmtrain data serve`,
a separate process) into an empty directory: only the shards a data stream's pages read, each
verified against the manifest the spec pins; damaged, truncated and oversized copies refused
and fetched again; a broken transfer resumed with a range request; a disk cap that holds.
Every attack a hostile or broken server could make is tried against the real fetcher."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from peer.task.fetch import DataFetcher, parse_source
from peer.task.tokens import AssignedBatches, TokenShards, open_data, run_assignment
from protocol.errors import ConfigError
from protocol.manifest import MANIFEST_NAME, load_manifest, tokenizer_sha256
from protocol.spec import RunSpec, parse_spec
from swarmtrain.localswarm import LocalDataServer, swarmtrain_executable, wait_until
from tests.specs import bare_spec, llama_task, token_data

SEQ_LEN, SHARD_SEQUENCES = 16, 40


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A prepared directory of many small shards (stdlib sources, a 300-token BPE)."""
    from peer.task.data import stdlib_files
    from swarmtrain.dataprep import prepare, train_tokenizer

    root = tmp_path_factory.mktemp("published")
    files = stdlib_files()[:12]
    train_tokenizer(files, root / "tokenizer", vocab_size=300)
    prepare(files, root / "tokenizer", root / "data", seq_len=SEQ_LEN, validation_fraction=0.1,
            shard_sequences=SHARD_SEQUENCES, progress=False)  # fmt: skip
    assert len(load_manifest(root / "data").train) >= 12
    return root / "data"


@pytest.fixture
def served(prepared: Path, tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A copy of the prepared directory (the test may damage it) served by `swarmtrain data serve`."""
    root = tmp_path / "server"
    shutil.copytree(prepared, root)
    server = LocalDataServer(root, tmp_path / "server.log")
    try:
        yield root, server.url()
    finally:
        server.stop()
    # a clean stop: uvicorn shuts down, then lets SIGTERM end the process as the signal's own
    assert server.proc.returncode in (0, -signal.SIGTERM), server.proc.returncode
    assert not any("Traceback" in line for line in server.lines), "\n".join(server.lines[-20:])


def _llama(seq_len: int) -> dict[str, dict[str, str | int | float | bool]]:
    return llama_task(
        seq_len=seq_len, vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip


def spec_toml(spec: RunSpec) -> str:
    data = token_data(
        url=spec.data.url, manifest=spec.data.manifest, tokenizer=spec.data.tokenizer, slots=spec.data.slots
    )
    return bare_spec(
        "fetch",
        task=_llama(SEQ_LEN),
        inner_steps=5,
        sections=data,
    )


def spec_for(data: Path, url: str, *, slots: int = 4) -> RunSpec:
    manifest = load_manifest(data)
    sections = token_data(url=url, manifest=manifest.digest(), tokenizer=tokenizer_sha256(data), slots=slots)
    draft = parse_spec(
        bare_spec(
            "x",
            task=_llama(16),
            batch_size=None,
            inner_steps=5,
            sections=sections,
        )
    )
    return parse_spec(spec_toml(draft))


def disk_bytes(directory: Path) -> int:
    """Bytes of the shards and partial downloads in ``directory`` (files removed meanwhile: 0)."""
    total = 0
    for path in [*directory.glob("*.bin"), *directory.glob(".*.part")]:
        try:
            total += path.stat().st_size
        except FileNotFoundError:
            pass
    return total


def shard_files(directory: Path) -> set[str]:
    return {p.name for p in directory.glob("train-*.bin")}


def test_an_empty_directory_gets_exactly_its_streams_shards_verified(
    served: tuple[Path, str], prepared: Path, tmp_path: Path
) -> None:
    _, url = served
    spec = spec_for(prepared, url)
    mine = tmp_path / "volunteer"
    directory, manifest, fetcher = open_data(spec, mine)
    assert fetcher is not None and directory == mine
    assert {p.name for p in mine.iterdir()} >= {MANIFEST_NAME, "tokenizer.json", "tokenizer_config.json"}
    assert not shard_files(mine)  # nothing before a round asks
    assignment = run_assignment(spec, manifest)
    batches = AssignedBatches(TokenShards(mine, manifest, manifest.train, fetcher=fetcher), assignment, slot=1)
    local = AssignedBatches(TokenShards(prepared, manifest, manifest.train), assignment, slot=1)
    for round_ in range(3):
        for step in range(5):
            got, want = batches.batch_at(round_, step), local.batch_at(round_, step)
            assert all((a == b).all() for a, b in zip(got, want))  # the same rows as a whole local copy
    prefetched = {
        manifest.train[i].file for r in range(3 + batches.prefetcher.ahead) for i in assignment.page_shards(r, 1)
    }  # type: ignore[union-attr]
    read = {manifest.train[i].file for r in range(3) for i in assignment.page_shards(r, 1)}
    wait_until(lambda: shard_files(mine) == prefetched, 30, "the prefetch of the next rounds' shards")
    assert read <= shard_files(mine) and len(prefetched) < len(manifest.train)  # only its own
    fetcher.close()


def test_damaged_truncated_and_oversized_copies_are_refused_and_fetched_again(
    served: tuple[Path, str], prepared: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root, url = served
    spec = spec_for(prepared, url)
    mine = tmp_path / "volunteer"
    _, manifest, fetcher = open_data(spec, mine)
    assert fetcher is not None
    first, second, third = manifest.train[:3]
    good = (prepared / first.file).read_bytes()
    # on our disk: a flipped byte (same size), a truncated file
    damaged = bytearray(good)
    damaged[7] ^= 0xFF
    (mine / first.file).write_bytes(bytes(damaged))
    (mine / second.file).write_bytes((prepared / second.file).read_bytes()[:-3])
    with caplog.at_level(logging.WARNING, logger="peer.task.fetch"):
        for entry in (first, second):
            assert fetcher.shard(manifest, entry).read_bytes() == (prepared / entry.file).read_bytes()
    refused = [r.getMessage() for r in caplog.records if "on disk refused" in r.getMessage()]
    assert len(refused) == 2 and "sha256" in refused[0] and "bytes, the manifest says" in refused[1], refused

    # on the server: a damaged copy is refused every try, then one line says so; nothing kept
    (root / third.file).write_bytes(bytes(damaged) if third.file == first.file else b"\0" * manifest.shard_bytes(third))
    with pytest.raises(ConfigError, match=rf"{third.file}: no verified copy in 3 tries \(last: sha256"):
        fetcher.shard(manifest, third)
    assert not (mine / third.file).exists() and not list(mine.glob(".*.part"))
    # a hostile server sends more than the manifest says: refused without storing it all
    (root / third.file).write_bytes((prepared / third.file).read_bytes() + b"x" * (5 << 20))
    with pytest.raises(ConfigError, match=r"no verified copy in 3 tries \(last: \d+ of \d+ bytes"):
        fetcher.shard(manifest, third)
    # the server's copy mended: fetched, verified
    shutil.copyfile(prepared / third.file, root / third.file)
    assert fetcher.shard(manifest, third).read_bytes() == (prepared / third.file).read_bytes()
    fetcher.close()


def test_a_broken_transfer_resumes_where_it_stopped(served: tuple[Path, str], prepared: Path, tmp_path: Path) -> None:
    _, url = served
    spec = spec_for(prepared, url)
    mine = tmp_path / "volunteer"
    _, manifest, fetcher = open_data(spec, mine)
    assert fetcher is not None
    entry = manifest.train[0]
    whole = (prepared / entry.file).read_bytes()
    (mine / f".{entry.file}.part").write_bytes(whole[: len(whole) // 2])
    received: list[int] = []
    fetcher.on_progress = received.append
    assert fetcher.shard(manifest, entry).read_bytes() == whole
    assert sum(received) == len(whole) - len(whole) // 2  # only the rest came over the wire
    fetcher.close()


def test_a_wrong_manifest_or_tokenizer_at_the_url_is_refused_in_one_line(
    served: tuple[Path, str], prepared: Path, tmp_path: Path
) -> None:
    root, url = served
    spec = spec_for(prepared, url)
    (root / "tokenizer.json").write_text('{"not": "the run\'s"}')
    with pytest.raises(ConfigError, match="tokenizer.json is tokenizer sha256:.* the run uses .*other data"):
        open_data(spec, tmp_path / "a")
    other = spec.model_copy(update={"data": spec.data.model_copy(update={"manifest": "sha256:" + "1" * 64})})
    with pytest.raises(ConfigError, match="manifest.json is manifest sha256:.*the run uses sha256:1111.*other data"):
        open_data(other, tmp_path / "b")
    nowhere = spec.model_copy(update={"data": spec.data.model_copy(update={"url": url + "nothing/"})})
    with pytest.raises(ConfigError, match=r"nothing/manifest.json: cannot fetch it \(HTTP 404\)|not found"):
        open_data(nowhere, tmp_path / "c")


def test_the_disk_cap_holds_while_rounds_go_by(served: tuple[Path, str], prepared: Path, tmp_path: Path) -> None:
    _, url = served
    spec = spec_for(prepared, url)
    mine = tmp_path / "volunteer"
    _, manifest, _ = open_data(spec, mine)
    shard = max(manifest.shard_bytes(e) for e in manifest.train)
    cap = 8 * shard
    fetcher = DataFetcher(parse_source(url), mine, cap_bytes=cap)
    assignment = run_assignment(spec, manifest)
    batches = AssignedBatches(TokenShards(mine, manifest, manifest.train, fetcher=fetcher), assignment, slot=0)
    seen: set[str] = set()
    for round_ in range(assignment.rounds_per_epoch):
        for step in range(assignment.steps):
            batches.batch_at(round_, step)
            on_disk = disk_bytes(mine)
            assert on_disk <= cap, (round_, on_disk, cap)
            seen |= shard_files(mine)
    assert len(seen) * shard > cap  # it went through more than the cap holds
    tiny = DataFetcher(parse_source(url), tmp_path / "tiny", cap_bytes=shard // 2)
    with pytest.raises(
        ConfigError, match=r"the data cap \(.*\) cannot hold the shards the coming rounds read .*raise --data-cap"
    ):
        tiny.shard(manifest, manifest.train[0])
    fetcher.close()
    tiny.close()


def test_data_fetch_and_verify_from_the_command_line(served: tuple[Path, str], prepared: Path, tmp_path: Path) -> None:
    _, url = served
    spec_file = tmp_path / "run.toml"
    spec = spec_for(prepared, url)
    text = spec_toml(spec)
    spec_file.write_text(text)
    env = {**os.environ, "SWARMTRAIN_HOME": str(tmp_path / "home")}
    done = subprocess.run([*swarmtrain_executable(), "data", "fetch", str(spec_file), "--no-progress"],
                          capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    where = tmp_path / "home" / "data" / str(spec.data.manifest)[7:23]
    assert f"verified in {where}" in done.stdout, done.stdout
    checked = subprocess.run([*swarmtrain_executable(), "data", "verify", str(where), "--no-progress"],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert checked.returncode == 0, checked.stderr
    again = subprocess.run([*swarmtrain_executable(), "data", "fetch", str(spec_file), "--no-progress"],
                           capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert again.returncode == 0 and "fetched 0.0 MB" in again.stdout, again.stdout + again.stderr
    assert f'url = "{url}"\n' in text
    spec_file.write_text(text.replace(f'url = "{url}"\n', 'path = "/nowhere"\n'))
    refused = subprocess.run([*swarmtrain_executable(), "data", "fetch", str(spec_file)],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert refused.returncode == 1 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "publishes no data" in refused.stderr


def test_the_doctor_checks_the_published_data_and_says_what_a_round_reads(
    served: tuple[Path, str], prepared: Path, tmp_path: Path
) -> None:
    root, url = served
    spec = spec_for(prepared, url)
    text = spec_toml(spec)
    spec_file = tmp_path / "run.toml"
    spec_file.write_text(text)

    def doctor() -> str:
        done = subprocess.run(
            [*swarmtrain_executable(), "doctor", "--spec", str(spec_file), "--skip-network", "--no-benchmark",
             "--key", str(tmp_path / "k")], capture_output=True, text=True, timeout=180,
        )  # fmt: skip
        line = next((line for line in done.stdout.splitlines() if " data: " in line), "")
        assert line, done.stdout + done.stderr
        return line

    line = doctor()
    assert line.startswith(f"ok    data: published at {url}: 0.00 GB in ") and "MB of it per round" in line, line
    (root / MANIFEST_NAME).write_text((root / MANIFEST_NAME).read_text().replace('"documents": ', '"documents": 1'))
    line = doctor()
    assert line.startswith("FAIL  data: ") and "the run uses" in line and "-> fix: ask the operator" in line, line
    assert f'url = "{url}"' in text
    spec_file.write_text(text.replace(f'url = "{url}"', f'path = "{tmp_path / "nowhere"}"'))
    line = doctor()
    assert line.startswith("warn  data: ") and "no such directory" in line and "--data-dir" in line, line


def test_the_data_server_serves_the_directory_and_nothing_outside_it(served: tuple[Path, str], tmp_path: Path) -> None:
    """A stranger asks `swarmtrain data serve` for files outside the published directory."""
    import urllib.error
    import urllib.request

    root, url = served
    (root.parent / "secret.key").write_text("not for strangers")
    with urllib.request.urlopen(url + MANIFEST_NAME, timeout=10) as response:
        assert response.read() == (root / MANIFEST_NAME).read_bytes()
    for path in ("../secret.key", "..%2Fsecret.key", "%2e%2e/secret.key", "%2e%2e%2fsecret.key", "/etc/passwd",
                 "..%5Csecret.key"):  # fmt: skip
        try:
            with urllib.request.urlopen(url + path, timeout=10) as response:
                body = response.read()
        except urllib.error.HTTPError as exc:
            assert exc.code in (400, 404), (path, exc.code)
            continue
        assert b"not for strangers" not in body and b"root:" not in body, path
