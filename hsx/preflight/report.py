"""The preflight report: one row per check, readable in ten seconds (DESIGN.md section 5).

The same report renders three ways: a rich table for the CLI, markdown for a Prefect artifact
(the task layer publishes it; hsx never imports prefect), and a JSON-able dict for logs and tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text


class Status(StrEnum):
    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"


_STYLE = {Status.PASS: "bold green", Status.WARN: "bold yellow", Status.FAIL: "bold red"}
_ICON = {Status.PASS: "✅", Status.WARN: "⚠️", Status.FAIL: "❌"}


@dataclass(frozen=True)
class CheckResult:
    """The outcome of one preflight check."""

    check: str  # short check name: "resolve", "contract", "signatures", "weights", "resources", ...
    status: Status
    summary: str  # one line a person reads in a second; never empty
    details: tuple[str, ...] = ()  # extra lines, e.g. one per signature mismatch

    def __post_init__(self) -> None:
        # why: an empty message is a bug (DESIGN.md section 6); catch it where it is made.
        if not self.check.strip():
            raise ValueError("CheckResult.check must name the check; found an empty string")
        if not self.summary.strip():
            raise ValueError(f"CheckResult.summary of check {self.check!r} is empty")
        if "\n" in self.summary:
            raise ValueError(
                f"CheckResult.summary of check {self.check!r} must be one line; "
                f"found {self.summary.count(chr(10)) + 1} lines (put the rest in details)"
            )
        # why: accept plain strings ("pass") from callers and normalise to the enum.
        object.__setattr__(self, "status", Status(self.status))
        object.__setattr__(self, "details", tuple(self.details))

    def to_dict(self) -> dict[str, Any]:
        return {
            "check": self.check,
            "status": self.status.value,
            "summary": self.summary,
            "details": list(self.details),
        }


@dataclass
class PreflightReport:
    """All check results for one model folder."""

    model_dir: str
    results: list[CheckResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when no check failed (warnings do not block extraction)."""
        return all(r.status != Status.FAIL for r in self.results)

    def counts(self) -> dict[str, int]:
        return {s.value: sum(1 for r in self.results if r.status == s) for s in Status}

    def to_dict(self) -> dict[str, Any]:
        return {
            "model_dir": self.model_dir,
            "ok": self.ok,
            "counts": self.counts(),
            "results": [r.to_dict() for r in self.results],
        }

    def _headline(self) -> str:
        c = self.counts()
        verdict = "OK" if self.ok else "FAILED"
        return f"Preflight {verdict}: {c['pass']} pass, {c['warn']} warn, {c['fail']} fail"

    def render_table(self, console: Console) -> None:
        """Print a table (check | status | summary) with details indented under each summary."""
        table = Table(title=f"hsx preflight: {self.model_dir}", show_lines=False, expand=False)
        table.add_column("check", style="bold", no_wrap=True)
        table.add_column("status", no_wrap=True)
        table.add_column("summary", overflow="fold")
        for r in self.results:
            body = Text(r.summary)
            for line in r.details:
                body.append("\n    " + line, style="dim")
            table.add_row(r.check, Text(r.status.value.upper(), style=_STYLE[r.status]), body)
        console.print(table)
        console.print(Text(self._headline(), style="bold green" if self.ok else "bold red"))

    def to_markdown(self) -> str:
        """Markdown for a Prefect artifact: a summary table, then details per check."""

        def cell(text: str) -> str:
            # why: a pipe or newline inside a cell breaks the markdown table.
            return text.replace("|", "\\|").replace("\n", " ")

        lines = [
            f"# hsx preflight: `{self.model_dir}`",
            "",
            f"**{self._headline()}**",
            "",
            "| check | status | summary |",
            "|---|---|---|",
        ]
        for r in self.results:
            lines.append(
                f"| {cell(r.check)} | {_ICON[r.status]} {r.status.value} | {cell(r.summary)} |"
            )
        detailed = [r for r in self.results if r.details]
        for r in detailed:
            lines += ["", f"### {r.check} ({r.status.value})", ""]
            lines += [f"- {cell(d)}" for d in r.details]
        return "\n".join(lines) + "\n"
