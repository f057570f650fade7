"""Where this averager's bulk channel listens (``engine.bulk_channel``): plain data, no hivemind,
so that the peer's command line checks its flag before anything heavy is imported."""

from __future__ import annotations

__all__ = ["BulkSettings"]


class BulkSettings:
    """Whether this averager uses the bulk channel, and where it listens.

    ``enabled``: off, parts go over libp2p only, both ways. ``host``/``port``: the listener's
    address (None: every interface; 0: any free port: a volunteer behind a firewall that
    forwards one port gives it here). ``public_port``: the port others dial, where a router or
    a rented machine's mapping forwards another one to ``port`` (0: ``port``)."""

    def __init__(self, enabled: bool = True, host: str | None = None, port: int = 0, public_port: int = 0) -> None:
        for name, value in (("bulk port", port), ("public bulk port", public_port)):
            if not 0 <= value <= 65535:
                raise ValueError(f"{name} must be in [0, 65535], got {value}")
        if public_port and not port:
            raise ValueError("a public bulk port needs the port it forwards to")
        self.enabled, self.host, self.port, self.public_port = enabled, host, port, public_port

    @classmethod
    def parse(cls, text: str, host: str | None = None) -> BulkSettings:
        """``off``, ``PORT`` or ``PORT:PUBLIC`` (a CLI flag's value); ``ValueError`` says what is wrong."""
        if text.strip().lower() == "off":
            return cls(enabled=False)
        listen, colon, public = text.partition(":")
        try:
            if colon and not public:
                raise ValueError(text)
            return cls(host=host, port=int(listen), public_port=int(public) if colon else 0)
        except ValueError as exc:
            if "bulk port" in str(exc):
                raise
            raise ValueError(f"expected off, PORT or PORT:PUBLIC_PORT, got {text!r}") from None
