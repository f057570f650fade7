"""One check's outcome, printed as one line (``ok``/``warn``/``FAIL``/``skip``) or as JSON."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from protocol.errors import SwarmtrainError

Status = Literal["ok", "warn", "fail", "skip"]
LABELS: dict[Status, str] = {"ok": "ok  ", "warn": "warn", "fail": "FAIL", "skip": "skip"}


@dataclass
class Verdict:
    name: str
    status: Status
    detail: str
    fix: str = ""
    """What to do about a failure or warning ("" for ok)."""
    data: dict[str, Any] = field(default_factory=dict)
    """Figures for ``--json`` (bytes, seconds, versions)."""

    def line(self) -> str:
        text = f"{LABELS[self.status]}  {self.name}: {self.detail}"
        return f"{text} -> fix: {self.fix}" if self.fix else text

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class CheckFailed(SwarmtrainError):
    """Raised inside a check: the check failed with this detail and ``fix``."""

    def __init__(self, detail: str, fix: str = "", **data: Any) -> None:
        super().__init__(detail)
        self.detail, self.fix, self.data = detail, fix, data


class CheckWarning(CheckFailed):
    """Raised inside a check: it passed, with a caveat worth fixing."""


def run_check(name: str, check: Callable[[], str | tuple[str, dict[str, Any]]]) -> Verdict:
    """Run ``check`` (returns its detail, or detail and data) and turn what happens into a
    verdict; an unexpected exception is a failure naming it, never a crash of the doctor."""
    try:
        outcome = check()
    except CheckWarning as warning:
        return Verdict(name, "warn", warning.detail, warning.fix, warning.data)
    except CheckFailed as failure:
        return Verdict(name, "fail", failure.detail, failure.fix, failure.data)
    except Exception as exc:  # noqa: BLE001 - the doctor reports every failure, never crashes
        return Verdict(name, "fail", f"{type(exc).__name__}: {exc}")
    detail, data = outcome if isinstance(outcome, tuple) else (outcome, {})
    return Verdict(name, "ok", detail, data=data)


def skipped(name: str, why: str) -> Verdict:
    return Verdict(name, "skip", why)
