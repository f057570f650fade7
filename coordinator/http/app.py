"""FastAPI app over a running ``Coordinator``: ``/api/v1/*`` JSON (OpenAPI at
``/openapi.json``, every response's model in ``coordinator.http.schemas``), ``/metrics`` (Prometheus text), ``/healthz`` and the dashboard ``/``.

Handlers only read; they take the same lock as the gRPC servicer and the ticker, so they
see a consistent core. Nothing here is served from a CDN.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Query
from fastapi.responses import FileResponse, HTMLResponse, PlainTextResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import generate_latest

from coordinator.archiver import Archiver
from coordinator.core import Coordinator
from coordinator.credits import OFFENCE
from coordinator.exporter import ModelExporter
from coordinator.health import network_paths
from coordinator.http import schemas
from coordinator.http.metrics import metrics_registry
from protocol.identity import PublicKey


def create_app(
    core: Coordinator,
    lock: threading.Lock,
    clock: Callable[[], float] = time.time,
    *,
    archiver: Archiver | None = None,
    exporter: ModelExporter | None = None,
    grpc_port: int = 0,
) -> FastAPI:
    app = FastAPI(title="swarmtrain coordinator", version="1", docs_url=None, redoc_url=None)

    @app.get("/healthz", response_model=schemas.Healthz)
    def healthz() -> dict[str, Any]:
        return {"ok": True, "run": core.spec.run.name}

    @app.get("/api/v1/status", response_model=schemas.Status)
    def status() -> dict[str, Any]:
        with lock:
            snap = core.snapshot(now=clock())
            online = core.health.online(snap.at)
        kept = archiver.checkpoints() if archiver is not None else []
        latest_checkpoint = kept[0] if kept else None
        return {
            "run_name": snap.run_name,
            "spec_digest": snap.spec_digest,
            "current_round": snap.current_round,
            "current_state_digest": snap.current_state_digest,
            "peers_online": snap.peers_online,
            "samples_per_second": snap.samples_per_second,
            "last_checkpoint_round": latest_checkpoint.round if latest_checkpoint else None,
            "server_time": snap.at,
            "validation_loss": snap.evaluated.validation_loss if snap.evaluated else None,
            "validation_round": snap.evaluated.round if snap.evaluated else None,
            "data": dataclasses.asdict(snap.data) if snap.data is not None else None,
            "rounds": [dataclasses.asdict(f) for f in snap.rounds],
            "rounds_per_hour": snap.rounds_per_hour,
            "progress": dataclasses.asdict(snap.progress) if snap.progress is not None else None,
            "join": {"grpc_port": grpc_port, "coordinator_key": core.identity.public_key.id},
            "network_paths": {path: n for path, n in network_paths(online).items() if n},
        }

    @app.get("/api/v1/checkpoints", response_model=schemas.Checkpoints)
    def checkpoints() -> dict[str, Any]:
        """The coordinator's archive: kept checkpoints, newest first."""
        if archiver is None:
            return {"enabled": False, "every_rounds": 0, "checkpoints": [], "last_error": ""}
        return {
            "enabled": True,
            "every_rounds": archiver.every,
            "checkpoints": [dataclasses.asdict(c) for c in archiver.checkpoints()],
            "last_error": archiver.last_error,
        }

    @app.get("/api/v1/model", response_model=schemas.Model)
    def model() -> dict[str, Any]:
        """The newest archived round as a transformers model directory (``swarmtrain export``)."""
        latest = exporter.latest() if exporter is not None else None
        error = exporter.last_error if exporter is not None else ""
        if latest is None:
            return {"last_error": error}
        return {
            "round": latest.round,
            "state_digest": latest.state_digest,
            "architecture": latest.architecture,
            "parameters": latest.parameters,
            "files": [{"name": f.name, "bytes": f.bytes, "url": f"model/{f.name}"} for f in latest.files],
            "last_error": error,
        }

    @app.get(
        "/model/{name}",
        response_class=FileResponse,
        responses={
            200: {"content": {"application/octet-stream": {}}, "description": "the file"},
            404: {"description": "no file of that name in the latest model export (or none yet)"},
        },
    )
    def model_file(name: str) -> FileResponse:
        path = exporter.file(name) if exporter is not None else None
        if path is None:
            raise HTTPException(status_code=404, detail=f"no file {name!r} in the latest model export")
        return FileResponse(path, filename=name)

    @app.get("/api/v1/peers", response_model=list[schemas.PeerRow])
    def peers() -> list[dict[str, Any]]:
        with lock:
            health = {p.key: p for p in core.health.peers()}
            stored = core.store.peers()
            offences = core.store.denials_by_peer(OFFENCE)
        out = []
        for row in stored:
            h = health.get(row.key)
            out.append(
                {
                    "key": row.key,
                    "account": row.account_key,
                    "libp2p_peer_id": row.libp2p_peer_id,
                    "software_version": row.software_version,
                    "reachable": row.reachable,
                    "network_path": h.network_path if h else "",
                    "relay": bool(h and h.relay),
                    "punched_peers": h.punched_peers if h else 0,
                    "state": h.state.value if h else "offline",
                    "round": h.round if h else None,
                    "samples_per_second": h.samples_per_second if h else 0.0,
                    "last_seen": h.last_seen if h else row.last_seen,
                    "local_ranks": h.local_ranks if h else _local_ranks(row.hardware_json),
                    "offences": offences.get(row.key, 0),
                    "flagged": bool(h and h.flagged),
                }
            )
        return out

    @app.get("/api/v1/rounds", response_model=list[schemas.RoundRow])
    def rounds(limit: int = Query(200, ge=1, le=5000)) -> list[dict[str, Any]]:
        with lock:
            return [dataclasses.asdict(row) for row in core.store.rounds(limit=limit)]

    @app.get("/api/v1/credits", response_model=schemas.Credits)
    def credits(limit: int = Query(20, ge=1, le=1000)) -> dict[str, Any]:
        with lock:
            by_peer = {key: dataclasses.asdict(totals) for key, totals in core.store.credits_by_peer().items()}
            board = [dataclasses.asdict(row) for row in core.store.leaderboard(limit=limit)]
            return {"leaderboard": board, "by_peer": by_peer}

    @app.get("/api/v1/history", response_model=list[schemas.HistoryPoint])
    def history(seconds: float = Query(3600.0, gt=0, le=core.history_keep_s)) -> list[dict[str, Any]]:
        """Swarm samples of the last ``seconds`` (no longer than the coordinator keeps them)."""
        with lock:
            return [dataclasses.asdict(point) for point in core.store.samples(since=clock() - seconds)]

    def archive_round() -> tuple[int | None, float | None]:
        kept = archiver.checkpoints() if archiver is not None else []
        return (kept[0].round, kept[0].archived_at) if kept else (None, None)

    registry = metrics_registry(core, clock, archive_round=archive_round if archiver is not None else None)

    @app.get("/metrics", response_class=PlainTextResponse)
    def metrics() -> PlainTextResponse:
        with lock:
            text = generate_latest(registry).decode()
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/", response_class=HTMLResponse)
    def dashboard() -> HTMLResponse:
        return HTMLResponse((resources.files("coordinator.http") / "dashboard.html").read_text(encoding="utf-8"))

    # the dashboard's script and its charting library (uPlot, put there by `make web`): served
    # from the package, never from a CDN
    static = Path(str(resources.files("coordinator.http") / "static"))
    app.mount("/static", StaticFiles(directory=static, check_dir=False), name="static")

    _ = PublicKey  # keys are printed as public ids throughout
    return app


def _local_ranks(hardware_json: str) -> int:
    """The local ranks a stored peer said it runs (1 for records from before they were kept)."""
    try:
        return int(json.loads(hardware_json).get("local_ranks", 1))
    except (ValueError, TypeError, AttributeError):
        return 1
