"""Read py-spy's raw (collapsed-stack) output: which functions the samples were in."""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass, field
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
    by_module: list[Entry] = field(default_factory=list)
    """Our own modules (file paths), self and inclusive time, by self time."""


def summarize(raw: str, count: int = 15, own_package: str = "router") -> Profile:
    """Read collapsed stacks: each line `frame;frame;...;innermost N`, a frame
    `function (file)`.
    """
    self_samples: dict[str, int] = {}
    total_samples: dict[str, int] = {}
    module_self: dict[str, int] = {}
    module_total: dict[str, int] = {}
    samples = 0
    for line in raw.splitlines():
        stack, _, number = line.rpartition(" ")
        if not stack or not number.isdigit():
            continue
        n = int(number)
        samples += n
        frames = stack.split(";")
        innermost = frames[-1]
        self_samples[innermost] = self_samples.get(innermost, 0) + n
        for frame in set(frames):
            total_samples[frame] = total_samples.get(frame, 0) + n
        if package_of(innermost) == own_package:
            module = where_of(innermost)
            module_self[module] = module_self.get(module, 0) + n
        for module in {where_of(f) for f in frames if package_of(f) == own_package}:
            module_total[module] = module_total.get(module, 0) + n
    if not samples:
        return Profile(0, [], [], {})
    modules = sorted(
        module_total, key=lambda m: (module_self.get(m, 0), module_total[m]), reverse=True
    )
    by_module = [
        Entry(
            function="",
            where=module,
            self_pct=100.0 * module_self.get(module, 0) / samples,
            total_pct=100.0 * module_total[module] / samples,
        )
        for module in modules
    ]

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
    return Profile(
        samples, [entry(f) for f in ranked], [entry(f) for f in own[:10]], by_package, by_module
    )


def where_of(frame: str) -> str:
    """The file of a frame `function (file)`."""
    return frame.partition(" (")[2].rstrip(")")


def package_of(frame: str) -> str:
    """The top-level package a frame's file belongs to; `stdlib` for a bare module file."""
    where = frame.partition(" (")[2].rstrip(")")
    if where.startswith("<attrs generated"):
        # e.g. `<attrs generated methods trio._core._run.CancelStatus>`
        return where.rsplit(" ", 1)[-1].split(".", 1)[0]
    if "/" in where:
        return where.split("/", 1)[0]
    return "stdlib"


@dataclass(frozen=True, slots=True)
class Syscall:
    """One system call's count over a traced window, per request served in it."""

    name: str
    calls: int
    errors: int
    per_request: float


def syscalls(strace_summary: str, requests: int) -> list[Syscall]:
    """`strace -c`'s table (`% time seconds usecs/call calls [errors] syscall`), by calls,
    each per request of the `requests` the window served; the total row left out."""
    found: list[Syscall] = []
    for line in strace_summary.splitlines():
        fields = line.split()
        if len(fields) < 5 or not fields[3].isdigit() or fields[-1] == "total":
            continue
        try:
            float(fields[0])
        except ValueError:
            continue
        errors = int(fields[4]) if len(fields) == 6 and fields[4].isdigit() else 0
        calls = int(fields[3])
        found.append(Syscall(fields[-1], calls, errors, calls / requests if requests else 0.0))
    return sorted(found, key=lambda call: call.calls, reverse=True)
