"""The one exception tree of swarmtrain.

Every error that a user, an operator or a remote peer can cause is a ``SwarmtrainError``;
foreign exceptions (tomllib, pydantic, cryptography, protobuf, grpc) are translated at the
boundary with ``raise ... from exc``. Messages are one line, name what was wrong and where.
``assert`` is reserved for internal invariants.
"""

from __future__ import annotations


class SwarmtrainError(Exception):
    """Base of every error swarmtrain raises on purpose."""


class ConfigError(SwarmtrainError, ValueError):
    """A configuration file or command-line value is invalid."""


class SpecError(ConfigError):
    """A run spec failed to parse or validate; ``problems`` holds one line per problem."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = list(problems)
        super().__init__("\n".join(f"{source}: {p}" for p in self.problems))


class IdentityError(SwarmtrainError):
    """A key or key file is missing, malformed or unsafe."""


class KeyFilePermissionError(IdentityError):
    """A private key file is readable or writable by group or others."""


class VerificationError(SwarmtrainError):
    """Something received from another party failed verification; nothing was changed."""


class MalformedMessageError(VerificationError):
    """Bytes that do not decode to a well-formed message."""


class MalformedTensorError(VerificationError):
    """Bytes that do not decode to a well-formed, finite tensor under the named codec."""


class BadSignatureError(VerificationError):
    """The signature does not match the content and the claimed signer."""


class WrongSignerError(VerificationError):
    """Correctly signed, but by a key other than the one expected."""


class WrongKindError(VerificationError):
    """A message of another kind than expected (e.g. a heartbeat replayed as a report)."""


class StaleMessageError(VerificationError):
    """A message whose timestamp is too old, or too far in the future."""


class ReplayedMessageError(VerificationError):
    """A message whose nonce was already seen from this signer."""


class TokenError(VerificationError):
    """An access token was refused."""


class TokenExpiredError(TokenError):
    """The token's validity window does not contain the current time."""


class TokenWrongRunError(TokenError):
    """The token was issued for another run (spec digest)."""


class TokenWrongPeerError(TokenError):
    """The token was issued to another peer key."""


class AdmissionError(SwarmtrainError):
    """The coordinator refuses to admit (or keep) a peer: banned, not on the allowlist, wrong run."""


class WrongRunError(AdmissionError):
    """The peer runs another spec than the coordinator's run."""


class BootstrapError(SwarmtrainError):
    """No bootstrap peer of the swarm's DHT answered for as long as the peer would wait."""


DIAL_BACK_BUSY = "dial-back busy"
"""Begins the details of a refused probe (gRPC ``RESOURCE_EXHAUSTED``) whose dial-back waited on
another one (one at a time per source, a few at a time in all; each takes at most a few seconds):
the caller may ask again in a second (``peer.net.dial_back.ask_dial_back``). Two machines behind
one address (a home's NAT, two peers on one host) probe at the same time."""
