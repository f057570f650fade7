"""The dashboard in headless Chromium (Debian's package) against a real coordinator and
peers: it loads its charting library from the coordinator (no other host is reachable from the
page), its time-series charts have axes and data (loss, throughput and peers, each round's time
split, bytes per round, failed and split rounds), its figures show tokens/s, rounds/h and the
ETA of a run with an end, its peers table lists the running peers and the peers by network
path and credit share, its rounds table shows how each round averaged (and marks a round that
split), and an empty run shows the join command. Screenshots are saved under tests/artifacts/."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from swarmtrain.localswarm import LocalCoordinator, LocalPeer, start_peers
from swarmtrain.localswarm import wait_until as wait_for
from tests.integration.coordinator_status import status
from tests.specs import COORDINATOR_SPEC as SPEC

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (make test installs it as root)")
def test_dashboard_renders_live_swarm(tmp_path: Path) -> None:
    playwright = pytest.importorskip("playwright.sync_api")
    spec = tmp_path / "spec.toml"
    text = SPEC.format(mode="open", allowlist="").replace("min_group_size = 3", "min_group_size = 2")
    spec.write_text(text.replace("inner_steps = 3", "inner_steps = 3\nmax_rounds = 500"))  # a run with an end: ETA
    coordinator = LocalCoordinator(spec, tmp_path / "state")
    peers: list[LocalPeer] = []
    try:
        address = coordinator.address()
        with playwright.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                foreign: list[str] = []
                page.on("request", lambda r: None if r.url.startswith(coordinator.http()) else foreign.append(r.url))
                page.goto(coordinator.http(), wait_until="load")
                # the run is empty: the page says how to join it, with this coordinator's key
                page.wait_for_selector("#join", state="visible", timeout=30_000)
                command = page.inner_text("#join-command")
                port = address.rsplit(":", 1)[1]
                assert re.fullmatch(
                    rf"swarmtrain peer --coordinator 127\.0\.0\.1:{port} --coordinator-key ed25519:\S+", command
                )
                ARTIFACTS.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(ARTIFACTS / "dashboard-empty.png"), full_page=True)
                peers += start_peers(spec, 2, tmp_path, ["--max-rounds", "500"], coordinator=address)
                wait_for(
                    lambda: status(address).get("current_round", 0) >= 3 and status(address)["peers_online"] == 2,
                    180,
                    "3 finalized rounds with 2 peers online",
                )
                page.wait_for_function("document.querySelectorAll('#peers tbody tr').length === 2", timeout=30_000)
                charts = ["loss-chart", "throughput-chart", "split-chart", "bytes-chart", "failed-chart"]
                page.wait_for_function(
                    f"{charts}.every(id => Number(document.getElementById(id).dataset.points) > 1)", timeout=60_000
                )
                assert "swarmtrain: coord" in page.inner_text("#run")
                # both peers working (a heartbeat delayed by a loaded machine may show one
                # "unreachable" for a moment; the page refreshes itself)
                page.wait_for_function(
                    "(() => { const s = [...document.querySelectorAll('#peers tbody tr td:nth-child(2)')]"
                    ".map(td => td.innerText.trim()); return s.length === 2 && s.every(x => "
                    "['training', 'averaging', 'joining', 'straggling'].includes(x)); })()",
                    timeout=60_000,
                )
                # real charts: uPlot's canvases, each with an x axis of time or rounds and a y axis
                for chart in charts:
                    assert page.locator(f"#{chart} canvas").count() == 1, chart
                    assert page.evaluate(f"window.swarmCharts['{chart}'].axes.length") >= 2, chart
                assert page.evaluate("window.swarmCharts['loss-chart'].scales.x.time") is True
                page.wait_for_function(  # the peers' heartbeats carry their samples/s into the history
                    "Math.max(...window.swarmCharts['throughput-chart'].data[1]) > 0", timeout=60_000
                )
                split = page.evaluate("window.swarmCharts['split-chart'].data")
                assert len(split) == 5 and all(v is not None and v > 0 for v in split[1]), split  # the stacked total
                assert page.evaluate("typeof uPlot") == "function"
                assert float(page.inner_text("#pace").split()[0]) > 0
                assert "500 rounds" in page.inner_text("#done") and page.inner_text("#eta") != "-"
                assert page.inner_text("#tokens").split()[0] != "n/a"
                paths = [td.inner_text() for td in page.locator("#paths tbody tr td:first-child").all()]
                assert paths and all(paths), paths
                page.wait_for_function("document.querySelectorAll('#credits tbody tr').length >= 1", timeout=60_000)
                assert page.locator("#credits tbody tr td:nth-child(4)").first.inner_text().endswith("%")
                assert not page.is_visible("#join")  # peers are online
                # how each round averaged: two peers of min_group_size 2 form one group, one state
                page.wait_for_function("document.querySelectorAll('#rounds tbody tr').length >= 3", timeout=30_000)
                for tr in page.locator("#rounds tbody tr").all():
                    cells = [td.inner_text().strip() for td in tr.locator("td").all()]
                    assert cells[1:4] == ["1", "1", "2"], cells  # groups, states, peers averaged
                assert page.locator("#rounds tbody tr.split").count() == 0
                page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)

                def split_round(route: Any) -> None:  # the real status, its newest round split in two
                    answer = route.fetch()
                    body = answer.json()
                    body["rounds"][0].update(groups=2, states=2)
                    route.fulfill(response=answer, json=body)

                page.route("**/api/v1/status", split_round)
                page.wait_for_function(
                    "document.querySelectorAll('#rounds tbody tr.split').length === 1", timeout=30_000
                )
                assert page.locator("#rounds tbody tr").first.locator("td").nth(2).inner_text() == "2 (split)"
                assert foreign == [], foreign  # no CDN: every asset came from the coordinator
            finally:
                browser.close()
        assert (ARTIFACTS / "dashboard.png").stat().st_size > 10_000
    finally:
        for peer in peers:
            peer.kill()
        coordinator.kill()
