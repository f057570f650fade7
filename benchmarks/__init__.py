"""Benchmarks (not part of `make test`): run with `python -m benchmarks.<name>`."""
