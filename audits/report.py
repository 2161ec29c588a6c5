"""Audit results as plain data: one CheckResult per named check, one AuditReport per adapter."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field
from typing import Any

PASS, WARN, FAIL = "pass", "warn", "fail"
VERIFIED, WARNED, REJECTED = "VERIFIED", "WARN", "REJECTED"
SHOWN_NAMES = 3  # names a check's detail lists before "(+N more)"


def shown_names(names: list[str]) -> str:
    return ", ".join(names[:SHOWN_NAMES]) + (f" (+{len(names) - SHOWN_NAMES} more)" if len(names) > SHOWN_NAMES else "")


@dataclass
class CheckResult:
    """One check: its status, the number it measured, the threshold that number was held to, and why.

    `measurements` keeps per-module numbers for the JSON report; the table shows `detail`.
    """

    name: str
    status: str
    value: float | None
    threshold: float | None
    detail: str
    measurements: dict = field(default_factory=dict)


@dataclass
class AuditReport:
    adapter: str
    base: str
    verdict: str
    checks: list[CheckResult]
    reasons: list[str]
    variant: Any = None  # audits/variant.py's AdapterVariant: which LoRA it is and what combining it gives

    def to_dict(self) -> dict:
        return asdict(self)


def verdict_of(checks: list[CheckResult]) -> str:
    """Any failure rejects; warnings alone still let the adapter through, flagged."""
    statuses = {check.status for check in checks}
    if FAIL in statuses:
        return REJECTED
    return WARNED if WARN in statuses else VERIFIED


def reasons_of(checks: list[CheckResult]) -> list[str]:
    """Failures first, then warnings, each as `check: detail`."""
    ordered = [c for c in checks if c.status == FAIL] + [c for c in checks if c.status == WARN]
    return [f"{check.name}: {check.detail}" for check in ordered]


def make_report(adapter: str, base: str, checks: list[CheckResult], variant=None) -> AuditReport:
    return AuditReport(adapter, base, verdict_of(checks), checks, reasons_of(checks), variant)


_said: ContextVar[set | None] = ContextVar("verdicts_said", default=None)  # lines printed within each_verdict_once


def verdict_line(report: AuditReport) -> str:
    """One line: the adapter, its verdict and every reason (failures first, then warnings)."""
    reasons = "; ".join(report.reasons)
    return f"audit: {report.adapter}: {report.verdict}" + (f" ({reasons})" if reasons else "")


@contextmanager
def each_verdict_once():
    """Within it, each verdict line is printed once: a sweep audits its adapter again at every point it merges."""
    token = _said.set(set())
    try:
        yield
    finally:
        _said.reset(token)


def announce(report: AuditReport) -> None:
    """Print the verdict line on stderr, whatever -q says: a WARN is never silent."""
    said, key = _said.get(), (report.adapter, report.base, report.verdict, tuple(report.reasons))
    if said is not None:
        if key in said:
            return
        said.add(key)
    print(verdict_line(report), file=sys.stderr, flush=True)
