"""Find, load and select case files: every `*.yaml` under the spec root is one case, its
id the path without the suffix. What a file may contain is `conformance.schema`."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from conformance.model import Case
from conformance.nodes import SpecError
from conformance.schema import CaseReader

SPEC_SUFFIX = ".yaml"
# The spec's version, in the spec root: bumped when the meaning of a case changes.
VERSION_FILE = "VERSION"


def default_spec_root() -> Path:
    """`./spec` when run from a checkout's root, else the `spec/` beside this package."""
    here = Path.cwd() / "spec"
    if here.is_dir():
        return here
    return Path(__file__).resolve().parent.parent / "spec"


def spec_version(root: Path) -> str:
    """The first line of `<root>/VERSION`; SpecError when it is missing or empty."""
    path = root / VERSION_FILE
    try:
        lines = path.read_text(encoding="utf-8").split()
    except OSError as exc:
        raise SpecError(path, 1, "", f"the spec has no version file: {exc.strerror}") from None
    if len(lines) != 1:
        raise SpecError(path, 1, "", "must hold one word, the spec version")
    return lines[0]


def case_files(paths: Iterable[Path]) -> list[Path]:
    """Every `*.yaml` under the given files and folders, sorted, each once."""
    found: set[Path] = set()
    for path in paths:
        if path.is_dir():
            found.update(p for p in path.rglob(f"*{SPEC_SUFFIX}") if p.is_file())
        else:
            found.add(path)
    return sorted(found)


def case_id(path: Path, root: Path) -> str:
    try:
        relative = path.resolve().relative_to(root.resolve())
    except ValueError:
        relative = Path(path.name)
    return relative.with_suffix("").as_posix()


def load_case(path: Path, root: Path | None = None) -> Case:
    """Read and validate one case file; raises SpecError (or OSError if unreadable)."""
    text = path.read_text(encoding="utf-8")
    return CaseReader(path, case_id(path, root or path.parent)).read(text)


@dataclass(frozen=True, slots=True)
class LoadResult:
    cases: list[Case]
    errors: list[SpecError]


def load_cases(paths: Sequence[Path], root: Path) -> LoadResult:
    """Every case under `paths`; a bad file is an error, the others still load."""
    cases: list[Case] = []
    errors: list[SpecError] = []
    for path in case_files(paths):
        try:
            cases.append(load_case(path, root))
        except SpecError as error:
            errors.append(error)
        except (OSError, UnicodeDecodeError) as error:
            errors.append(SpecError(path, 1, "", f"cannot be read: {error}"))
    return LoadResult(cases, errors)


def select_cases(cases: Iterable[Case], patterns: Sequence[str], tags: Sequence[str]) -> list[Case]:
    """Cases whose id matches any glob of `patterns` (all when none) and that carry every tag."""
    chosen = []
    for case in cases:
        if patterns and not any(fnmatch.fnmatchcase(case.id, p) for p in patterns):
            continue
        if not all(tag in case.tags for tag in tags):
            continue
        chosen.append(case)
    return chosen
