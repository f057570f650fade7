"""The peer's link to its coordinator: signed calls, the pinned coordinator key, heartbeats, and
reports kept on disk until the coordinator answers."""
