"""The doctor's data check for a token run: is the run's prepared data here, or can this
machine fetch it from where the run publishes it, and how much does a round read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from protocol.errors import ConfigError
from protocol.manifest import MANIFEST_NAME, Manifest, parse_manifest
from protocol.spec import RunSpec
from swarmtrain.doctor.verdict import CheckFailed, CheckWarning


def data_check(spec: RunSpec, data_dir: Path | None) -> tuple[str, dict[str, Any]]:
    """A token run's data: whole here (as the peer will check it; a warning if not, a copy being a
    setup step), else published at ``data.url`` (its manifest fetched and checked against the
    spec's digest, nothing written: a failure if the URL does not serve the run's data)."""
    from peer.task.tokens import check_data, data_directory

    directory = data_directory(spec, data_dir)
    if spec.data.url is None:
        try:
            _, manifest = check_data(spec, directory)
        except ConfigError as exc:  # a setup step, not something this machine lacks: a warning
            raise CheckWarning(
                str(exc),
                "copy the run's prepared directory here and pass --data-dir, or ask the operator to "
                "publish it ([data] url)",
            ) from exc
        return f"all {_shards(manifest)} shards of the run's data are in {directory}", _figures(spec, manifest)
    manifest = _published_manifest(spec)
    per_round = _page_bytes(spec, manifest)
    return (
        f"published at {spec.data.url}: {manifest.total_bytes() / 1e9:.2f} GB in {_shards(manifest)} shards; a data "
        f"stream reads ~{per_round / 1e6:.1f} MB of it per round, fetched into {directory} ahead of need "
        "(--data-cap GB bounds what is kept)",
        _figures(spec, manifest),
    )


def _published_manifest(spec: RunSpec) -> Manifest:
    import httpx

    from peer.task.fetch import parse_source

    assert spec.data.url is not None
    source = parse_source(spec.data.url)
    url = source.url(MANIFEST_NAME)
    try:
        response = httpx.get(url, headers=dict(source.headers), follow_redirects=True, timeout=30)
        response.raise_for_status()
        manifest = parse_manifest(response.text, source=url)
    except (httpx.HTTPError, ConfigError) as exc:
        raise CheckFailed(f"{url}: {exc}", "check the network, or ask the operator whether data.url is up") from exc
    if manifest.digest() != spec.data.manifest:
        raise CheckFailed(
            f"{url} is manifest {manifest.digest()}, the run uses {spec.data.manifest}",
            "ask the operator: data.url does not hold the run's data",
        )
    return manifest


def _page_bytes(spec: RunSpec, manifest: Manifest) -> int:
    """What one data stream reads in one round: its page, rounded up to whole shards."""
    steps = spec.rounds.inner_steps or 1
    page = steps * spec.inner.batch_size
    rows = max(e.sequences for e in manifest.train)
    shards = -(-page // rows) + 1  # a page spans its shards and, at most, parts of one more
    return min(shards * rows, manifest.train_sequences()) * (manifest.seq_len + 1) * manifest.itemsize


def _shards(manifest: Manifest) -> int:
    return len(manifest.train) + len(manifest.validation)


def _figures(spec: RunSpec, manifest: Manifest) -> dict[str, Any]:
    return {
        "total_bytes": manifest.total_bytes(),
        "shards": _shards(manifest),
        "round_bytes": _page_bytes(spec, manifest),
        "url": spec.data.url,
    }
