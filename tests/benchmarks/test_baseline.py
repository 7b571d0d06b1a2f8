"""`python -m bench --baseline REF`: the commit's tree, and a router that imports from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.baseline import extract
from bench.procs import BenchError


def test_the_baseline_tree_is_the_commits_and_the_router_imports_from_it(tmp_path: Path) -> None:
    baseline = extract("HEAD", tmp_path)
    assert baseline.tree.is_relative_to(tmp_path) and len(baseline.commit) == 40
    assert (baseline.tree / "router" / "cli" / "__main__.py").exists()
    # extract() itself refuses a tree the interpreter would not import from; this
    # checkout's own files are not what the baseline runs.
    assert baseline.env["PYTHONPATH"] == str(baseline.tree)
    assert baseline.label().startswith("HEAD (")


@pytest.mark.parametrize("ref", ["no-such-ref-anywhere", "--output=/tmp/x", "HEAD:README.md"])
def test_a_ref_that_is_not_a_commit_is_refused(tmp_path: Path, ref: str) -> None:
    with pytest.raises(BenchError):
        extract(ref, tmp_path)
    assert not any(tmp_path.iterdir())  # nothing extracted
