"""Conformance reports a project can publish: one YAML file per plane and version, and the
parity matrix generated from those files.

`conformance run --report-yaml DIR` writes `DIR/<plane>/<version>.yaml`, and on real
engines (`--fleet vllm`) `DIR/<plane>/<version>-vllm.yaml`, whose `fleet: vllm` makes
its column of the matrix a column of its own:

    plane: smg
    version: 1.13.0
    fleet: fake
    date: 2026-11-30
    spec_version: "1"
    command: conformance run --plane smg --report-yaml conformance/reports
    capabilities: [breaker.all_open_reject, dp_rank, ...]
    summary: {pass: 28, divergent: 7, unsupported: 7, fail: 0, stale: 0, error: 0}
    cases:
      - id: breaker/all-open-dispatch
        verdict: unsupported
        observed: "needs breaker.all_open_dispatch (...)"
      - id: breaker/opens-at-threshold
        verdict: pass

A case that did not pass carries `observed` (what the plane was seen doing, or why it did
not run) and every failure line of its run (a divergence's too, and an unsupported case's
when `--run-unsupported` ran it), and a case the runner had to help (a resend) its
`notes`. `conformance parity DIR` reads every report under DIR and writes the Markdown
matrix (`docs/parity.md`), with the same lines.
"""

from __future__ import annotations

import datetime
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from conformance.runner import FAILING, Outcome

VERDICTS = ("pass", "divergent", "unsupported", "fail", "stale", "error")
# Upper case for what fails the run, so it stands out in a wide table.
CELL = {
    "pass": "pass",
    "divergent": "divergent",
    "unsupported": "unsupported",
    "fail": "**FAIL**",
    "stale": "**STALE**",
    "error": "**ERROR**",
}


class ReportError(ValueError):
    """A report file that cannot be read: the path and what is wrong."""


@dataclass(frozen=True, slots=True)
class CaseResult:
    id: str
    verdict: str
    observed: str = ""
    failures: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()  # what the runner did beyond the steps (a resend)
    seconds: float = 0.0  # how long it ran (0 when it did not run)


@dataclass(frozen=True, slots=True)
class PlaneReport:
    plane: str
    version: str
    date: str
    spec_version: str
    command: str
    capabilities: tuple[str, ...]
    cases: tuple[CaseResult, ...] = field(default_factory=tuple)
    fleet: str = "fake"
    run_seconds: float = 0.0
    """The wall time of the run that made the report (all of its planes together)."""

    @property
    def column(self) -> str:
        """The report's column in the matrix: plane and version, and the fleet unless fake."""
        suffix = "" if self.fleet == "fake" else f" on {self.fleet}"
        return f"{self.plane} {self.version}{suffix}"

    @property
    def case_seconds(self) -> float:
        """The time its cases took, added up (cases run side by side, so more than the
        run's wall time when `--jobs` is above 1)."""
        return sum(case.seconds for case in self.cases)

    @property
    def summary(self) -> dict[str, int]:
        counts = Counter(case.verdict for case in self.cases)
        return {verdict: counts.get(verdict, 0) for verdict in VERDICTS}

    def to_data(self) -> dict[str, Any]:
        cases: list[dict[str, Any]] = []
        for case in self.cases:
            entry: dict[str, Any] = {"id": case.id, "verdict": case.verdict}
            if case.seconds:
                entry["seconds"] = round(case.seconds, 1)
            if case.observed:
                entry["observed"] = case.observed
            if case.failures:
                entry["failures"] = list(case.failures)
            if case.notes:
                entry["notes"] = list(case.notes)
            cases.append(entry)
        return {
            "plane": self.plane,
            "version": self.version,
            "fleet": self.fleet,
            "date": self.date,
            "run_seconds": round(self.run_seconds),
            "spec_version": self.spec_version,
            "command": self.command,
            "capabilities": list(self.capabilities),
            "summary": self.summary,
            "cases": cases,
        }


def build_report(
    plane: str,
    version: str,
    capabilities: Iterable[str],
    outcomes: Sequence[Outcome],
    spec_version: str,
    command: str,
    date: datetime.date | None = None,
    fleet: str = "fake",
    run_seconds: float = 0.0,
) -> PlaneReport:
    """The report of one plane from its outcomes (other planes' outcomes are ignored)."""
    results = []
    for o in sorted((o for o in outcomes if o.plane == plane), key=lambda o: o.case_id):
        failures = tuple(_one_line(line) for line in o.failures) if o.verdict != "pass" else ()
        notes = tuple(_one_line(line) for line in o.notes)
        results.append(
            CaseResult(o.case_id, o.verdict, _one_line(o.detail), failures, notes, o.seconds)
        )
    return PlaneReport(
        plane=plane,
        version=version,
        date=(date or datetime.date.today()).isoformat(),
        spec_version=spec_version,
        command=command,
        capabilities=tuple(sorted(capabilities)),
        cases=tuple(results),
        fleet=fleet,
        run_seconds=run_seconds,
    )


def report_path(root: Path, report: PlaneReport) -> Path:
    """`<root>/<plane>/<version>.yaml` (`<version>-<fleet>.yaml` on a fleet other than
    fake), with anything odd in the names made safe."""
    suffix = "" if report.fleet == "fake" else f"-{_safe(report.fleet)}"
    return root / _safe(report.plane) / f"{_safe(report.version)}{suffix}.yaml"


def write_report(root: Path, report: PlaneReport) -> Path:
    path = report_path(root, report)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(report.to_data(), sort_keys=False, allow_unicode=True, width=100)
    path.write_text(text, encoding="utf-8")
    return path


def load_report(path: Path) -> PlaneReport:
    """One report file; ReportError naming the file if it is not one."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise ReportError(f"{path}: cannot be read: {exc}") from None
    if not isinstance(data, dict):
        raise ReportError(f"{path}: not a report (a mapping of plane, version, cases, ...)")
    try:
        cases = tuple(
            CaseResult(
                id=str(entry["id"]),
                verdict=_verdict(entry["verdict"]),
                observed=str(entry.get("observed", "")),
                failures=tuple(str(line) for line in entry.get("failures", ())),
                notes=tuple(str(line) for line in entry.get("notes", ())),
                seconds=float(entry.get("seconds", 0.0)),
            )
            for entry in data["cases"]
        )
        return PlaneReport(
            plane=str(data["plane"]),
            version=str(data["version"]),
            date=str(data["date"]),
            spec_version=str(data["spec_version"]),
            command=str(data.get("command", "")),
            capabilities=tuple(str(c) for c in data.get("capabilities", ())),
            cases=cases,
            fleet=str(data.get("fleet", "fake")),
            run_seconds=float(data.get("run_seconds", 0.0)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ReportError(f"{path}: not a report: {exc!r}") from None


def load_reports(root: Path) -> list[PlaneReport]:
    """Every `*.yaml` report under `root`, in plane then version order."""
    reports = [load_report(path) for path in sorted(root.rglob("*.yaml"))]
    return sorted(reports, key=lambda r: (r.fleet != "fake", r.fleet, r.plane, r.version))


def _verdict(value: Any) -> str:
    if value not in VERDICTS:
        raise ValueError(f"verdict {value!r} is not one of {', '.join(VERDICTS)}")
    return str(value)


# -- the parity matrix ---------------------------------------------------------------------


def parity_markdown(
    reports: Sequence[PlaneReport], source: str, notes: Mapping[str, str] | None = None
) -> str:
    """The parity matrix (cases x planes) of `reports`, with every non-pass explained.

    `source` says where the reports came from (a folder, or a run's command line);
    `notes` may add a line per plane column.
    """
    columns = [r.column for r in reports]
    by_column = {
        column: {case.id: case for case in r.cases}
        for column, r in zip(columns, reports, strict=True)
    }
    case_ids = sorted({case.id for r in reports for case in r.cases})
    spec_versions = sorted({r.spec_version for r in reports})
    lines = [
        "# Conformance parity matrix",
        "",
        f"Generated by `conformance parity` from {source}. Spec version "
        f"{', '.join(spec_versions) or 'unknown'}; {len(case_ids)} cases. "
        "See `docs/writing-spec-cases.md` for what the verdicts mean.",
        "",
        "| plane | version | fleet | date | spec | run wall time (s) | case time (s) | "
        + " | ".join(VERDICTS)
        + " |",
        "|---|---|---|---|---|--:|--:|" + "---|" * len(VERDICTS),
    ]
    for r in reports:
        counts = r.summary
        wall = f"{r.run_seconds:.0f}" if r.run_seconds else "?"
        lines.append(
            f"| {r.plane} | {r.version} | {r.fleet} | {r.date} | {r.spec_version} | {wall} | "
            f"{r.case_seconds:.0f} | " + " | ".join(str(counts[v]) for v in VERDICTS) + " |"
        )
    for column, text in (notes or {}).items():
        lines += ["", f"{column}: {text}"]
    lines += ["", "| case | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for case_id in case_ids:
        cells = [
            CELL[by_column[c][case_id].verdict] if case_id in by_column[c] else "" for c in columns
        ]
        lines.append(f"| `{case_id}` | " + " | ".join(cells) + " |")
    known = sorted({cap for r in reports for cap in r.capabilities})
    if known:
        lines += [
            "",
            "## Capabilities",
            "",
            "| capability | " + " | ".join(columns) + " |",
            "|---|" + "---|" * len(columns),
        ]
        for capability in known:
            cells = ["yes" if capability in r.capabilities else "no" for r in reports]
            lines.append(f"| `{capability}` | " + " | ".join(cells) + " |")
    for title, verdicts in (
        ("Divergences", ("divergent",)),
        ("Unsupported", ("unsupported",)),
        ("Failures", tuple(sorted(FAILING))),
    ):
        picked = [
            (column, case)
            for column in columns
            for case in by_column[column].values()
            if case.verdict in verdicts
        ]
        if not picked:
            continue
        lines += ["", f"## {title}", ""]
        for column, case in sorted(picked, key=lambda pair: (columns.index(pair[0]), pair[1].id)):
            what = case.observed or (
                f"{len(case.failures)} failure line(s):" if case.failures else "(nothing recorded)"
            )
            lines.append(f"- **{column}** `{case.id}` ({case.verdict}): {what}")
            lines += [f"  - {failure}" for failure in case.failures]
    noted = [
        (column, case) for column in columns for case in by_column[column].values() if case.notes
    ]
    if noted:
        lines += ["", "## Runner notes", ""]
        for column, case in noted:
            lines.append(f"- **{column}** `{case.id}` ({case.verdict}):")
            lines += [f"  - {note}" for note in case.notes]
    lines.append("")
    return "\n".join(lines)


_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]+")


def _safe(name: str) -> str:
    cleaned = _UNSAFE.sub("_", name).strip("._")
    return cleaned or "unknown"


def _one_line(text: str, limit: int = 600) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[:limit] + "..."
