"""Read py-spy's raw (collapsed-stack) output: which functions the samples were in."""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.procs import BenchError


@dataclass(frozen=True, slots=True)
class Entry:
    """One function: its share of samples as the innermost frame (self) and anywhere on the
    stack (total), in percent of all non-idle samples.
    """

    function: str
    where: str
    self_pct: float
    total_pct: float


def find_py_spy() -> str:
    beside = Path(sys.executable).with_name("py-spy")
    if beside.exists():
        return str(beside)
    path = shutil.which("py-spy")
    if path is None:
        raise BenchError("py-spy is not installed (pip install py-spy, in the bench extra)")
    return path


@dataclass(frozen=True, slots=True)
class Profile:
    """What one py-spy recording says: the top functions by self time, overall and in our
    own package, and self time by package.
    """

    samples: int
    top_self: list[Entry]
    top_router: list[Entry]
    by_package: dict[str, float]


def summarize(raw: str, count: int = 15, own_package: str = "router") -> Profile:
    """Read collapsed stacks: each line `frame;frame;...;innermost N`, a frame
    `function (file)`.
    """
    self_samples: dict[str, int] = {}
    total_samples: dict[str, int] = {}
    samples = 0
    for line in raw.splitlines():
        stack, _, number = line.rpartition(" ")
        if not stack or not number.isdigit():
            continue
        n = int(number)
        samples += n
        frames = stack.split(";")
        self_samples[frames[-1]] = self_samples.get(frames[-1], 0) + n
        for frame in set(frames):
            total_samples[frame] = total_samples.get(frame, 0) + n
    if not samples:
        return Profile(0, [], [], {})

    def entry(frame: str) -> Entry:
        function, _, where = frame.partition(" (")
        return Entry(
            function=function,
            where=where.rstrip(")"),
            self_pct=100.0 * self_samples.get(frame, 0) / samples,
            total_pct=100.0 * total_samples[frame] / samples,
        )

    ranked = sorted(self_samples, key=lambda frame: self_samples[frame], reverse=True)[:count]
    own = [frame for frame in self_samples if package_of(frame) == own_package]
    own.sort(key=lambda frame: self_samples[frame], reverse=True)
    packages: dict[str, float] = {}
    for frame, n in self_samples.items():
        name = package_of(frame)
        packages[name] = packages.get(name, 0.0) + 100.0 * n / samples
    by_package = dict(sorted(packages.items(), key=lambda item: item[1], reverse=True))
    return Profile(samples, [entry(f) for f in ranked], [entry(f) for f in own[:10]], by_package)


def package_of(frame: str) -> str:
    """The top-level package a frame's file belongs to; `stdlib` for a bare module file."""
    where = frame.partition(" (")[2].rstrip(")")
    if where.startswith("<attrs generated"):
        # e.g. `<attrs generated methods trio._core._run.CancelStatus>`
        return where.rsplit(" ", 1)[-1].split(".", 1)[0]
    if "/" in where:
        return where.split("/", 1)[0]
    return "stdlib"
