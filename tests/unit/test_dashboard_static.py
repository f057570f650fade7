"""What a stranger can read through the dashboard's static files: its script and charting
library, nothing else of the coordinator's (an attacker's path traversal, encoded or not)."""

from __future__ import annotations

import threading

import pytest
from fastapi.testclient import TestClient

from coordinator.core import Coordinator
from coordinator.http.app import create_app


@pytest.mark.parametrize(
    "path", ["/static/../app.py", "/static/%2e%2e/app.py", "/static/..%2fapp.py", "/static/vendor/../../schemas.py"]
)
def test_the_dashboards_static_files_serve_nothing_outside_their_folder(core: Coordinator, path: str) -> None:
    """The folder ``/static`` serves (the dashboard's script and charting library) is the only
    one a stranger can read files from: the coordinator's own source and state stay out."""
    api = TestClient(create_app(core, threading.Lock()))
    answer = api.get(path)
    assert answer.status_code == 404 and b"def " not in answer.content, (path, answer.status_code)
    assert api.get("/static/dashboard.js").status_code == 200
