"""A token run's prepared data, fetched from where the operator published it (``[data] url``).

A peer starts with an empty data directory: it fetches the manifest (checked against the spec's
digest), the tokenizer (checked against its digest), then only the shards its data stream's
pages read, a couple of rounds ahead of need (``Prefetcher``, from ``DataAssignment.page_shards``).
Every file is written to a ``.part`` file, resumed with an HTTP range request after a broken
transfer, never longer than the manifest says, and renamed into place only once its SHA-256 is
the manifest's: a corrupted or truncated shard is refused (one warning line) and fetched again.
A disk cap (``cap_bytes``) evicts the least recently used shards that no coming round needs.
Processes sharing a directory (the ranks of a node) take a file lock per file.

Sources: any HTTP(S) static file server (``swarmtrain data serve``, nginx, a bucket), through
httpx; ``hf://datasets/ORG/NAME[@REVISION][/PATH]``, a dataset repository on the Hugging Face Hub,
through ``huggingface_hub`` (its URLs and its token, if the machine has one).
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import httpx
from filelock import FileLock

from protocol.errors import ConfigError
from protocol.manifest import (
    MANIFEST_NAME,
    TOKENIZER_FILES,
    Manifest,
    ShardEntry,
    check_shard_size,
    file_sha256,
    parse_manifest,
)

logger = logging.getLogger(__name__)

SMALL_FILE_LIMIT = 64 << 20
"""The most a manifest or a tokenizer file may be (their digests are checked once whole)."""
RETRIES = 3
CHUNK = 1 << 20


@dataclass(frozen=True)
class Source:
    """Where a prepared directory is published: each file's URL and the request headers."""

    base: str
    headers: tuple[tuple[str, str], ...] = ()

    def url(self, name: str) -> str:
        return self.base + name


def parse_source(url: str) -> Source:
    """The ``Source`` of a spec's ``data.url`` (ConfigError for another scheme)."""
    if url.startswith(("http://", "https://")):
        return Source(url if url.endswith("/") else url + "/")
    if url.startswith("hf://datasets/"):
        from huggingface_hub import constants
        from huggingface_hub.utils import build_hf_headers

        rest = url.removeprefix("hf://datasets/").strip("/")
        parts = rest.split("/")
        if len(parts) < 2 or not all(parts[:2]):
            raise ConfigError(f"data.url {url!r}: expected hf://datasets/ORG/NAME[@REVISION][/PATH]")
        name, _, revision = parts[1].partition("@")
        repo = f"{parts[0]}/{name}"
        path = "/".join(parts[2:])
        base = f"{constants.ENDPOINT}/datasets/{repo}/resolve/{revision or 'main'}/" + (f"{path}/" if path else "")
        return Source(base, tuple(build_hf_headers().items()))
    raise ConfigError(f"data.url {url!r}: expected an http(s):// URL or hf://datasets/ORG/NAME")


class DataFetcher:
    """Fills ``directory`` from ``source``, verified; ``cap_bytes`` bounds the shards kept."""

    def __init__(
        self,
        source: Source,
        directory: Path,
        *,
        cap_bytes: int | None = None,
        timeout_s: float = 60.0,
        retries: int = RETRIES,
        on_progress: Callable[[int], None] | None = None,
    ) -> None:
        self.source, self.directory, self.cap_bytes, self.retries = source, Path(directory), cap_bytes, retries
        self.on_progress = on_progress
        self.on_evict: list[Callable[[str], None]] = []
        """Called with a shard's file name when the cap removes it (its readers unmap it)."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"{self.directory}: cannot create the data directory ({exc.strerror})") from exc
        self._client = httpx.Client(follow_redirects=True, timeout=timeout_s, headers=dict(source.headers))
        self._lock = threading.Lock()
        self._file_locks: dict[str, threading.Lock] = {}
        self._last_use: dict[str, float] = {}
        self._pinned: set[str] = set()
        self._verified: set[str] = set()
        self._reserved: dict[str, int] = {}
        self.fetched_bytes = 0

    def close(self) -> None:
        self._client.close()

    # -- the small files ---------------------------------------------------------------------

    def manifest(self, digest: str) -> Manifest:
        """The run's manifest, from disk if it is the one ``digest`` names, else fetched."""
        path = self.directory / MANIFEST_NAME
        if path.exists():  # never write over another dataset's files
            try:
                local: Manifest | None = parse_manifest(path.read_text(encoding="utf-8"), source=str(path))
            except (ConfigError, OSError, UnicodeDecodeError):
                local = None
            if local is not None and local.digest() == digest:
                return local
            held = local.digest() if local is not None else "an unreadable one"
            raise ConfigError(
                f"data manifest mismatch: {self.directory} holds other data (manifest {held}), the run uses "
                f"{digest}: give the peer an empty --data-dir (it fetches the run's data there)"
            )
        body = self._required(MANIFEST_NAME)
        try:
            manifest = parse_manifest(body.decode("utf-8"), source=self.source.url(MANIFEST_NAME))
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{self.source.url(MANIFEST_NAME)}: not UTF-8 text") from exc
        if manifest.digest() != digest:
            raise ConfigError(
                f"{self.source.url(MANIFEST_NAME)} is manifest {manifest.digest()}, the run uses {digest} "
                "(data.url points at other data)"
            )
        _write_atomic(path, body)
        return manifest

    def tokenizer(self, digest: str) -> None:
        """The run's tokenizer files beside the shards (``tokenizer.json`` checked against
        ``digest``; the optional others as published)."""
        path = self.directory / "tokenizer.json"
        if path.is_file() and file_sha256(path) == digest:
            return
        body = self._required("tokenizer.json")

        got = "sha256:" + hashlib.sha256(body).hexdigest()
        if got != digest:
            raise ConfigError(
                f"{self.source.url('tokenizer.json')} is tokenizer {got}, the run uses {digest} (data.url points at "
                "other data)"
            )
        for name in TOKENIZER_FILES[1:]:
            try:
                _write_atomic(self.directory / name, self._small(name))
            except _Missing:
                pass
        _write_atomic(path, body)

    def _required(self, name: str) -> bytes:
        try:
            return self._small(name)
        except _Missing as exc:
            raise ConfigError(f"{exc}: not found (HTTP 404): is data.url the prepared directory?") from exc

    def _small(self, name: str) -> bytes:
        url = self.source.url(name)
        for attempt in range(1, self.retries + 1):
            try:
                with self._client.stream("GET", url) as response:
                    if response.status_code == 404:
                        raise _Missing(url)
                    response.raise_for_status()
                    body = bytearray()
                    for chunk in response.iter_bytes(CHUNK):
                        body += chunk
                        if len(body) > SMALL_FILE_LIMIT:
                            raise ConfigError(f"{url}: larger than {SMALL_FILE_LIMIT >> 20} MiB: not a {name}")
                    return bytes(body)
            except httpx.HTTPError as exc:
                if attempt == self.retries:
                    raise ConfigError(f"{url}: cannot fetch it ({_reason(exc)}); is data.url right and up?") from exc
                _backoff(attempt, url, _reason(exc))
        raise AssertionError("unreachable")

    # -- shards --------------------------------------------------------------------------------

    def shard(self, manifest: Manifest, entry: ShardEntry) -> Path:
        """``entry``'s file, verified (hashed in full the first time this process uses a file
        already on disk), fetched if it is absent or damaged; blocks until it is here."""
        target = self.directory / entry.file
        with self._file_lock(entry.file):
            self._last_use[entry.file] = time.monotonic()
            if entry.file in self._verified and target.is_file():
                return target
            with FileLock(str(self.directory / f".{entry.file}.lock")):
                damage = _damage(target, manifest, entry)
                if damage is None:
                    self._verified.add(entry.file)
                    return target
                if target.exists():
                    logger.warning("shard %s on disk refused (%s); fetching it again", entry.file, damage)
                    target.unlink()
                size = manifest.shard_bytes(entry)
                self._make_room(manifest, size, keep=entry.file)
                try:
                    self._download(entry.file, size=size, sha256=entry.sha256)
                finally:
                    self._release(entry.file)
                self._verified.add(entry.file)
        return target

    def pin(self, names: Iterable[str]) -> None:
        """The shards the coming rounds read: never evicted for room."""
        with self._lock:
            self._pinned = set(names)

    def _file_lock(self, name: str) -> threading.Lock:
        with self._lock:
            return self._file_locks.setdefault(name, threading.Lock())

    def _make_room(self, manifest: Manifest, size: int, *, keep: str) -> None:
        """Under the cap, reserve ``size`` bytes for ``keep``'s download (released by
        ``_release``), removing the least recently used shards no coming round reads."""
        if self.cap_bytes is None:
            return
        entries = {e.file: e for e in (*manifest.train, *manifest.validation)}
        with self._lock:  # the prefetcher and the round's own reads fetch at once
            present = {n: manifest.shard_bytes(e) for n, e in entries.items() if (self.directory / n).is_file()}
            used = sum(present.values()) + sum(self._reserved.values())
            for name in sorted(present, key=lambda n: self._last_use.get(n, 0.0)):
                if used + size <= self.cap_bytes:
                    break
                if name in self._pinned or name == keep or name in self._reserved:
                    continue
                (self.directory / name).unlink(missing_ok=True)
                self._verified.discard(name)
                used -= present[name]
                logger.info("data cap: removed shard %s (not read by the coming rounds)", name)
                for forget in self.on_evict:
                    forget(name)
            if used + size > self.cap_bytes:
                raise ConfigError(
                    f"the data cap ({_size(self.cap_bytes)}) cannot hold the shards the coming rounds read "
                    f"({_size(used + size)}): raise --data-cap"
                )
            self._reserved[keep] = size

    def _release(self, name: str) -> None:
        with self._lock:
            self._reserved.pop(name, None)

    def _download(self, name: str, *, size: int, sha256: str) -> None:
        url = self.source.url(name)
        part = self.directory / f".{name}.part"
        problem = ""
        for attempt in range(1, self.retries + 1):
            try:
                self._get(url, part, size)
            except _Missing as exc:
                raise ConfigError(f"{url}: not found (404): data.url does not hold the run's shards") from exc
            except httpx.HTTPError as exc:
                problem = _reason(exc)
                if attempt < self.retries:
                    _backoff(attempt, url, problem)
                continue
            have = part.stat().st_size
            got = file_sha256(part) if have == size else ""
            if got == sha256:
                os.replace(part, self.directory / name)
                self.fetched_bytes += size
                return
            problem = f"{have} of {size} bytes" if have != size else f"sha256 {got}, the manifest says {sha256}"
            logger.warning("shard %s from %s refused (%s); fetching it again", name, url, problem)
            part.unlink(missing_ok=True)
        raise ConfigError(f"{url}: no verified copy in {self.retries} tries (last: {problem})")

    def _get(self, url: str, part: Path, size: int) -> None:
        """``url`` into ``part``, resuming what is there; never more than ``size`` bytes."""
        have = part.stat().st_size if part.exists() else 0
        if have >= size:
            part.unlink()
            have = 0
        headers = {"Range": f"bytes={have}-"} if have else {}
        with self._client.stream("GET", url, headers=headers) as response:
            if response.status_code == 404:
                raise _Missing(url)
            if response.status_code == 416:  # what we hold is already longer than the server's file
                part.unlink()
            response.raise_for_status()
            resumed = have > 0 and response.status_code == 206
            written = have if resumed else 0
            with part.open("ab" if resumed else "wb") as out:
                for chunk in response.iter_bytes(CHUNK):
                    chunk = chunk[: size + 1 - written]  # one byte over is enough to refuse it
                    out.write(chunk)
                    written += len(chunk)
                    if self.on_progress is not None:
                        self.on_progress(len(chunk))
                    if written > size:
                        break


class Prefetcher:
    """Fetches, on a thread of its own, the shards of the coming rounds of one data stream, so a
    round's inner steps find them on disk; pins them against the cap's eviction."""

    def __init__(
        self, fetcher: DataFetcher, manifest: Manifest, shards_of: Callable[[int], list[int]], *, ahead: int = 2
    ) -> None:
        self.fetcher, self.manifest, self.shards_of, self.ahead = fetcher, manifest, shards_of, ahead
        self._wanted: queue.Queue[int] = queue.Queue()
        self._last = -1
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="data-prefetch", daemon=True)
        self._thread.start()

    def round_starts(self, round_: int) -> None:
        """Round ``round_`` begins: fetch its shards and the next ``ahead`` rounds'."""
        if round_ == self._last:
            return
        self._last = round_
        names = [self.manifest.train[i].file for r in range(round_, round_ + self.ahead + 1) for i in self.shards_of(r)]
        self.fetcher.pin(names)
        self._wanted.put(round_)

    def _loop(self) -> None:
        while True:
            round_ = self._wanted.get()
            while not self._wanted.empty():  # only the newest matters
                round_ = self._wanted.get()
            try:
                for r in range(round_, round_ + self.ahead + 1):
                    for index in self.shards_of(r):
                        self.fetcher.shard(self.manifest, self.manifest.train[index])
            except Exception as exc:  # noqa: BLE001 - the round's own read reports it
                logger.warning("prefetching round %d's data: %s", round_, exc)


def _damage(path: Path, manifest: Manifest, entry: ShardEntry) -> str | None:
    """Why the file at ``path`` is not ``entry``'s (absent, its size, its hash), or None."""
    if not path.is_file():
        return "absent"
    try:
        check_shard_size(path, manifest, entry)
    except ConfigError:
        return f"{path.stat().st_size} bytes, the manifest says {manifest.shard_bytes(entry)}"
    got = file_sha256(path)
    return None if got == entry.sha256 else f"sha256 {got}, the manifest says {entry.sha256}"


class _Missing(Exception):
    """The server says 404: retrying will not help."""


def _backoff(attempt: int, url: str, reason: str) -> None:
    delay = min(30.0, 2.0**attempt)
    logger.warning("fetching %s: %s; again in %.0f s", url, reason, delay)
    time.sleep(delay)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, httpx.HTTPStatusError):
        return f"HTTP {exc.response.status_code}"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _write_atomic(path: Path, body: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(body)
    os.replace(tmp, path)
