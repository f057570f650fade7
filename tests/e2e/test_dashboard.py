"""The dashboard in headless Chromium (Debian's package) against a real coordinator and
peers: it renders, its charts have data, its peers table lists the running peers, its rounds
table shows how each round averaged (and marks a round that split). A screenshot is saved
under tests/artifacts/."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from swarmtrain.localswarm import LocalPeer
from tests.integration.test_coordinator_swarm import SPEC, CoordinatorProcess, status, wait_for

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
    spec.write_text(SPEC.format(mode="open", allowlist="").replace("min_group_size = 3", "min_group_size = 2"))
    coordinator = CoordinatorProcess(spec, tmp_path / "state")
    peers: list[LocalPeer] = []
    try:
        address = coordinator.address()
        for i in range(2):
            args = [
                "--coordinator",
                address,
                "--host",
                "127.0.0.1",
                "--key",
                str(tmp_path / f"k{i}"),
                "--shard-seed",
                str(i),
                "--max-rounds",
                "500",
            ]
            peers.append(LocalPeer(args, tmp_path, f"peer{i}"))
        wait_for(
            lambda: status(address).get("current_round", 0) >= 3 and status(address)["peers_online"] == 2,
            180,
            "3 finalized rounds with 2 peers online",
        )
        with playwright.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.goto(coordinator.http(), wait_until="load")
                page.wait_for_function("document.querySelectorAll('#peers tbody tr').length === 2", timeout=30_000)
                page.wait_for_function(
                    "['loss-chart','sps-chart','peers-chart'].every(id => "
                    "Number(document.getElementById(id).dataset.points) > 1)",
                    timeout=30_000,
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
                assert page.locator("#loss-chart polyline").count() == 1
                # how each round averaged: two peers of min_group_size 2 form one group, one state
                page.wait_for_function("document.querySelectorAll('#rounds tbody tr').length >= 3", timeout=30_000)
                for tr in page.locator("#rounds tbody tr").all():
                    cells = [td.inner_text().strip() for td in tr.locator("td").all()]
                    assert cells[1:4] == ["1", "1", "2"], cells  # groups, states, peers averaged
                assert page.locator("#rounds tbody tr.split").count() == 0
                ARTIFACTS.mkdir(parents=True, exist_ok=True)
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
            finally:
                browser.close()
        assert (ARTIFACTS / "dashboard.png").stat().st_size > 10_000
    finally:
        for peer in peers:
            peer.kill()
        coordinator.kill()
