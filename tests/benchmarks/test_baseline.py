"""`python -m bench --baseline REF`: the commit's tree, and a router that imports from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.baseline import Baseline, compile_baseline, extract
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


def test_a_baseline_whose_compile_fails_is_refused_with_the_compilers_words(
    tmp_path: Path,
) -> None:
    broken = Baseline("broken", "0" * 40, tmp_path)
    (tmp_path / "setup.py").write_text("raise SystemExit('no compiler here')\n")
    with pytest.raises(BenchError, match=r"its compile failed: .*no compiler here"):
        compile_baseline(broken)


def test_a_baseline_that_builds_but_is_not_compiled_is_refused(tmp_path: Path) -> None:
    # A setup.py that succeeds without compiling anything leaves the baseline's pure
    # sources, which an A/B against the compiled build must not run as if compiled.
    baseline = extract("HEAD", tmp_path)
    (baseline.tree / "setup.py").write_text("")
    with pytest.raises(BenchError, match="not the compiled build"):
        compile_baseline(baseline)
