"""The Kubernetes form of a case: what its fleet and steps may say about Pods."""

from __future__ import annotations

from pathlib import Path

import pytest

from conformance.loader import load_case
from conformance.model import FleetChangeStep
from tests.conformance.test_validate import validate, write

KUBE = """\
name: a Kubernetes case
description: b starts not Ready, a terminates, b turns Ready, a goes and comes back
discovery: kubernetes
fleet:
  a: {}
  b: {status: not_ready}
steps:
  - set_status: {worker: a, status: draining}
  - set_status: {worker: b, status: active}
  - remove: a
  - add: a
  - send: {count: 1}
"""


def test_a_kubernetes_case_loads_and_needs_only_kubernetes_discovery(tmp_path: Path) -> None:
    case = load_case(write(tmp_path, KUBE), tmp_path)
    assert case.discovery == "kubernetes"
    assert case.worker("b").status == "not_ready"
    needed = case.capabilities_needed()
    # A terminating Pod is Kubernetes' own DRAINING: no DRAINING record is needed.
    assert "discovery.kubernetes" in needed and "worker.status" not in needed
    actions = [
        (s.action, s.workers, s.status) for s in case.steps if isinstance(s, FleetChangeStep)
    ]
    assert actions == [
        ("set_status", ("a",), "draining"),
        ("set_status", ("b",), "active"),
        ("remove", ("a",), None),
        ("add", ("a",), None),
    ]


@pytest.mark.parametrize(
    ("text", "line", "field", "words"),
    [
        # A terminating Pod cannot turn back; it can only go (and a new one come).
        (
            KUBE.replace(
                "  - remove: a\n  - add: a\n", "  - set_status: {worker: a, status: active}\n"
            ),
            10,
            "steps[2].set_status",
            "pod a is terminating, which cannot be undone",
        ),
        (
            KUBE.replace(
                "  - remove: a\n  - add: a\n",
                "  - remove: a\n  - set_status: {worker: a, status: active}\n",
            ),
            11,
            "steps[3].set_status",
            "pod a is not there",
        ),
        (KUBE.replace("  - remove: a\n", ""), 10, "steps[2].add", "pod a is still there"),
        # not_ready is a Pod's state: a static or etcd fleet has none.
        (
            KUBE.replace("discovery: kubernetes", "discovery: etcd"),
            6,
            "fleet.b.status",
            "needs `discovery: kubernetes`",
        ),
        (
            KUBE.replace("discovery: kubernetes", "discovery: etcd")
            .replace("b: {status: not_ready}", "b: {}")
            .replace("{worker: b, status: active}", "{worker: b, status: not_ready}"),
            9,
            "steps[1].set_status",
            "needs `discovery: kubernetes`",
        ),
    ],
)
def test_an_impossible_pod_change_names_file_line_and_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, line: int, field: str, words: str
) -> None:
    path = write(tmp_path, text)
    (tmp_path / "VERSION").write_text("1\n")
    code, err = validate(tmp_path, capsys)
    assert code == 2
    assert err.startswith(f"{path}:{line}: {field}: "), err
    assert words in err
