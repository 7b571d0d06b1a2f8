"""The router as of another commit, for an A/B in one run: `python -m bench --baseline REF`.

The tree of `REF` is extracted (`git archive`, no work tree or index touched) into the
bench's work directory and `ours-base` runs `router serve` from it with this checkout's
interpreter and packages, the same flags and the same fake fleet as `ours`. Rounds
interleave as for every contender, so the machine's drift falls on both alike.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.procs import BenchError

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True, slots=True)
class Baseline:
    """A commit's tree on disk: what `ours-base` imports `router` from."""

    ref: str
    commit: str
    tree: Path

    @property
    def env(self) -> dict[str, str]:
        """The environment that makes `python -m router.cli` the baseline's."""
        # PYTHONSAFEPATH: no working directory ahead of PYTHONPATH (it would be this checkout).
        return {"PYTHONPATH": str(self.tree), "PYTHONSAFEPATH": "1"}

    def label(self) -> str:
        return f"{self.ref} ({self.commit[:9]})"


def _git(*args: str) -> bytes:
    done = subprocess.run(
        ["git", "-C", str(REPO), *args], capture_output=True, timeout=60, check=False
    )
    if done.returncode != 0:
        raise BenchError(f"git {' '.join(args)}: {done.stderr.decode(errors='replace').strip()}")
    return done.stdout


def extract(ref: str, into: Path) -> Baseline:
    """`ref`'s tree under `into`, checked to be what the interpreter imports from there."""
    if ref.startswith("-"):
        raise BenchError(f"--baseline {ref!r}: not a commit")
    commit = _git("rev-parse", "--verify", "--end-of-options", f"{ref}^{{commit}}").decode().strip()
    tree = into / f"baseline-{commit[:12]}"
    tree.mkdir(parents=True, exist_ok=True)
    archive = _git("archive", "--format=tar", commit)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(tree, filter="data")
    baseline = Baseline(ref, commit, tree)
    probe = subprocess.run(
        [sys.executable, "-c", "import router; print(router.__file__)"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **baseline.env},
        check=False,
    )
    imported = Path(probe.stdout.strip() or "/")
    if probe.returncode != 0 or not imported.is_relative_to(tree):
        raise BenchError(
            f"--baseline {ref}: `router` imports from {imported}, not from {tree}"
            f" ({probe.stderr.strip()[-300:]})"
        )
    return baseline


COMPILE_TIMEOUT_S = 900.0
"""mypyc's compile of the request path takes 1.5 minutes on the quiet 2-core machine."""


def compile_baseline(baseline: Baseline) -> None:
    """Compiles `baseline`'s request path in place, as `make compiled` does its copy, so that
    an A/B against the compiled build (`--compiled-tree`) compares like with like. Raises
    BenchError when the compile fails or the result does not say it is compiled."""
    done = subprocess.run(
        [sys.executable, "setup.py", "--quiet", "build_ext", "--inplace"],
        cwd=baseline.tree,
        capture_output=True,
        text=True,
        timeout=COMPILE_TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0:
        raise BenchError(
            f"--baseline {baseline.ref}: its compile failed: {(done.stderr or done.stdout)[-800:]}"
        )
    compiled_env(baseline.tree)


def prepare(ref: str, into: Path, *, compiled: bool, log: Callable[[str], None]) -> Baseline:
    """`ref`'s tree under `into` (`extract`), compiled too when `compiled` (`ours` is)."""
    baseline = extract(ref, into)
    if compiled:
        log(f"ours-base: compiling {baseline.label()} (as ours is)")
        compile_baseline(baseline)
    return baseline


def compiled_env(tree: Path) -> dict[str, str]:
    """The environment that runs `router` from the compiled build in `tree` (`make
    compiled`). Raises BenchError unless a router started so says it is compiled."""
    env = {"PYTHONPATH": str(tree.resolve()), "PYTHONSAFEPATH": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "router.cli", "--version"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=False,
    )
    if "(compiled)" not in done.stdout:
        raise BenchError(
            f"--compiled-tree {tree}: its router is not the compiled build "
            f"({(done.stdout or done.stderr).strip()[:200] or 'no answer'}): run `make compiled`"
        )
    return env
