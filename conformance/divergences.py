"""A plane's known divergences from the spec, and what a case's run means given them.

The file maps a case id to the behaviour the plane shows instead and why:

    failover/attempts-distinct-workers:
      observed: "retries the same worker: 5 dispatches for 5 attempts"
      reason: "its retry loop re-runs selection without excluding tried workers"
      failure_matches: "dispatches\\[all\\]"   # optional: the failure must look like this

A listed case that fails is `divergent`; one that fails some other way than
`failure_matches` says is a plain `fail`; one that passes is `stale` (the list must stay
true, so that is an error too).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from conformance.nodes import NodeReader, SpecError, join

FIELDS = ("observed", "reason", "failure_matches")


@dataclass(frozen=True, slots=True)
class Divergence:
    case_id: str
    observed: str
    reason: str
    failure_matches: re.Pattern[str] | None = None
    line: int = 0

    def explains(self, failures: Sequence[str]) -> bool:
        if self.failure_matches is None:
            return True
        return any(self.failure_matches.search(line) for line in failures)


def load_divergences(path: Path | None) -> dict[str, Divergence]:
    """The divergence file of a plane (none: no divergences); raises SpecError if malformed."""
    if path is None or not path.exists():
        return {}
    r = NodeReader(path)
    text = path.read_text(encoding="utf-8")
    if not text.strip() or all(
        line.lstrip().startswith("#") or not line.strip() for line in text.splitlines()
    ):
        return {}
    out: dict[str, Divergence] = {}
    for case_id, key_node, value in r.items(r.compose(text), ""):
        m = r.mapping(value, case_id, FIELDS, required=("observed", "reason"))
        pattern = None
        if "failure_matches" in m:
            raw = r.string(m["failure_matches"], join(case_id, "failure_matches"))
            try:
                pattern = re.compile(raw)
            except re.error as exc:
                raise r.fail(
                    m["failure_matches"], join(case_id, "failure_matches"), f"not a regex: {exc}"
                ) from None
        out[case_id] = Divergence(
            case_id=case_id,
            observed=" ".join(r.string(m["observed"], join(case_id, "observed")).split()),
            reason=" ".join(r.string(m["reason"], join(case_id, "reason")).split()),
            failure_matches=pattern,
            line=key_node.start_mark.line + 1,
        )
    return out


def unknown_cases(
    path: Path, divergences: dict[str, Divergence], case_ids: set[str]
) -> list[SpecError]:
    """Entries that name no case: a renamed or deleted case must not leave a stale excuse."""
    return [
        SpecError(path, d.line, d.case_id, "no such case")
        for d in divergences.values()
        if d.case_id not in case_ids
    ]
