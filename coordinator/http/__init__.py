"""The coordinator's HTTP side: JSON API, Prometheus metrics, dashboard page."""
