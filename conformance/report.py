"""A run's results as JUnit XML, as publishable reports, and as the parity matrix."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from conformance.publish import PlaneReport, build_report, parity_markdown
from conformance.runner import Outcome


@dataclass(frozen=True, slots=True)
class RunInfo:
    planes: Mapping[str, str]  # plane name -> version
    capabilities: Mapping[str, frozenset[str]]  # plane name -> what it can do
    command: str
    seconds: float
    jobs: int
    spec_version: str = "unknown"
    fleet: str = "fake"  # what the workers were (conformance.model.FLEET_KINDS)


def reports(outcomes: Sequence[Outcome], info: RunInfo) -> list[PlaneReport]:
    """One publishable report per plane of the run."""
    return [
        build_report(
            plane,
            version,
            info.capabilities.get(plane, frozenset()),
            outcomes,
            info.spec_version,
            info.command,
            fleet=info.fleet,
            run_seconds=info.seconds,
        )
        for plane, version in info.planes.items()
    ]


def markdown(outcomes: Sequence[Outcome], info: RunInfo) -> str:
    """The parity matrix of this run, the same page `conformance parity` makes from reports."""
    source = f"the run `{info.command}` ({info.seconds:.0f} s wall time, {info.jobs} jobs)"
    return parity_markdown(reports(outcomes, info), source)


def junit(outcomes: Sequence[Outcome], info: RunInfo) -> str:
    suites = ET.Element("testsuites", name="conformance", time=f"{info.seconds:.1f}")
    for plane in info.planes:
        mine = [o for o in outcomes if o.plane == plane]
        counts: Counter[str] = Counter(o.verdict for o in mine)
        suite = ET.SubElement(
            suites,
            "testsuite",
            name=f"conformance.{plane}",
            tests=str(len(mine)),
            failures=str(counts["fail"] + counts["stale"]),
            errors=str(counts["error"]),
            skipped=str(counts["unsupported"] + counts["divergent"]),
            time=f"{sum(o.seconds for o in mine):.1f}",
        )
        ET.SubElement(
            ET.SubElement(suite, "properties"), "property", name="version", value=info.planes[plane]
        )
        for o in mine:
            case = ET.SubElement(
                suite,
                "testcase",
                classname=f"conformance.{plane}",
                name=o.case_id,
                time=f"{o.seconds:.2f}",
            )
            text = "\n".join([o.detail, *o.failures]).strip()
            if o.verdict == "fail":
                ET.SubElement(
                    case, "failure", message=_one_line(o.failures[0] if o.failures else o.detail)
                ).text = text
            elif o.verdict == "stale":
                ET.SubElement(case, "failure", message="stale divergence", type="stale").text = text
            elif o.verdict == "error":
                ET.SubElement(case, "error", message=_one_line(o.detail)).text = text
            elif o.verdict in ("unsupported", "divergent"):
                ET.SubElement(
                    case, "skipped", message=f"{o.verdict}: {_one_line(o.detail)}", type=o.verdict
                )
            if o.notes:
                ET.SubElement(case, "system-out").text = "\n".join(o.notes)
    ET.indent(suites)
    return ET.tostring(suites, encoding="unicode", xml_declaration=True) + "\n"


def _one_line(text: str, limit: int = 400) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[:limit] + "..."
