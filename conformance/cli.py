"""`conformance`: run the YAML spec against data planes, validate it, list it.

    conformance run [--plane python|smg|vllm-router|all|module:Class] [--case GLOB] [--tag T]
                    [--fleet fake|vllm|grpc|vllm-grpc] [--report-md FILE] [--report-yaml DIR]
                    [--junit FILE] [--jobs N] [--run-unsupported] [--case-timeout-s S]
    conformance validate [--plane P] [PATH ...]
    conformance list [--plane P] [--case GLOB] [--tag T] [--fleet F]
    conformance parity [DIR] [--out FILE]

Exit status: 0 when every case passed or is a listed divergence or unsupported; 1 on any
fail, stale divergence or case that could not run (real engines that did not start
included); 2 on bad arguments or an invalid spec; 3 when the fleet or a plane is not
installed (one line per missing piece, naming what to install; nothing is started);
130 when interrupted (SIGINT or SIGTERM: every process the run started is stopped first).
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import trio

from conformance.capabilities import unknown
from conformance.divergences import Divergence, load_divergences, unknown_cases
from conformance.engines import EngineUnavailable
from conformance.environment import fleet_problem
from conformance.loader import default_spec_root, load_cases, select_cases, spec_version
from conformance.model import ENGINE_FLEETS, FLEET_KINDS, Case, fleet_capabilities
from conformance.nodes import SpecError
from conformance.planes import PLANES, Plane, Unsupported, resolve_plane
from conformance.publish import ReportError, load_reports, parity_markdown, write_report
from conformance.report import RunInfo, junit, markdown, reports
from conformance.runner import (
    CASE_TIMEOUT_S,
    ENGINE_CASE_TIMEOUT_S,
    FAILING,
    Outcome,
    RunOptions,
    run_suite,
)

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NOT_INSTALLED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
DEFAULT_REPORTS = Path("conformance/reports")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="conformance", description="Play the conformance spec against data planes."
    )
    parser.add_argument(
        "--spec", type=Path, default=None, help="spec root folder (default: ./spec)"
    )
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="run cases against planes and report parity")
    _plane_option(run)
    _selection(run)
    run.add_argument(
        "--report-md", type=Path, default=None, help="write the parity matrix as Markdown"
    )
    run.add_argument(
        "--report-yaml",
        type=Path,
        default=None,
        metavar="DIR",
        help="write one publishable report per plane to DIR/<plane>/<version>.yaml",
    )
    run.add_argument("--junit", type=Path, default=None, help="write JUnit XML")
    run.add_argument(
        "--jobs", type=int, default=4, help="(case, plane) pairs run at once (default 4)"
    )
    run.add_argument(
        "--run-unsupported",
        action="store_true",
        help="run cases a plane lacks a capability for anyway, to observe it",
    )
    _fleet_option(run)
    run.add_argument(
        "--case-timeout-s",
        type=float,
        default=None,
        help=f"a case still running after this is an error (default {CASE_TIMEOUT_S:g}; "
        f"{ENGINE_CASE_TIMEOUT_S:g} on real engines)",
    )
    run.add_argument(
        "-v", "--verbose", action="store_true", help="print every failure line as cases finish"
    )

    validate = commands.add_parser(
        "validate", help="check case files, divergence files and plane capabilities"
    )
    _plane_option(validate)
    validate.add_argument(
        "paths", nargs="*", type=Path, help="case files or folders (default: the spec root)"
    )

    listing = commands.add_parser(
        "list", help="list cases with their tags and what each plane makes of them"
    )
    _plane_option(listing)
    _selection(listing)
    _fleet_option(listing, default=None)

    parity = commands.add_parser("parity", help="write the parity matrix from published reports")
    parity.add_argument(
        "reports",
        nargs="?",
        type=Path,
        default=DEFAULT_REPORTS,
        help=f"folder of <plane>/<version>.yaml reports (default {DEFAULT_REPORTS})",
    )
    parity.add_argument("--out", type=Path, default=None, help="write here instead of stdout")
    return parser


def _plane_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--plane",
        action="append",
        default=None,
        help=f"{', '.join(PLANES)}, all, or module:Class (repeatable; default all)",
    )


def _fleet_option(parser: argparse.ArgumentParser, default: str | None = "fake") -> None:
    parser.add_argument(
        "--fleet",
        choices=FLEET_KINDS,
        default=default,
        help="what the workers are: fake workers over HTTP (fake, the default of run) or "
        "gRPC (grpc), or real vLLM engines (`make engine-env`) serving HTTP (vllm) or gRPC "
        "(vllm-grpc), one case at a time; only the cases whose `fleets` name it"
        + ("" if default else " (list: every case, when not given)"),
    )


def _selection(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--case",
        action="append",
        default=[],
        metavar="GLOB",
        help="case ids matching GLOB (repeatable)",
    )
    parser.add_argument(
        "--tag", action="append", default=[], help="only cases with this tag (repeatable)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    root: Path = args.spec or default_spec_root()
    if args.command == "parity":
        return parity(args.reports, args.out)
    try:
        planes = _planes(args.plane or ["all"])
    except (ValueError, ImportError) as exc:
        print(f"conformance: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.command == "validate":
        # Divergence files list cases of the repository's spec; another root has others.
        return validate(args.paths or [root], root, planes, check_divergence_ids=args.spec is None)
    loaded = load_cases([root], root)
    if loaded.errors:
        for error in loaded.errors:
            print(f"invalid case: {error}", file=sys.stderr)
        return EXIT_USAGE
    cases = select_cases(loaded.cases, args.case, args.tag)
    if args.fleet is not None:
        cases = [case for case in cases if args.fleet in case.fleets]
    if not cases:
        print("no case matches the selection", file=sys.stderr)
        return EXIT_USAGE
    if args.command == "list":
        return list_cases(cases, planes, args.fleet or "fake")
    try:
        version = spec_version(root)
    except SpecError as error:
        print(f"invalid spec: {error}", file=sys.stderr)
        return EXIT_USAGE
    return run(cases, planes, args, argv, version)


def _planes(names: Sequence[str]) -> list[Plane]:
    expanded: list[str] = []
    for name in names:
        for part in name.split(","):
            expanded += list(PLANES) if part == "all" else [part]
    return [resolve_plane(name) for name in dict.fromkeys(expanded)]


def validate(
    paths: Sequence[Path], root: Path, planes: Sequence[Plane], check_divergence_ids: bool = True
) -> int:
    """Report every invalid case file, divergence file and plane capability; 0 when all
    are valid.

    With `check_divergence_ids`, a divergence entry that names no case under `root` is an
    error too, and so is a spec root without a VERSION file."""
    loaded = load_cases(paths, root)
    errors: list[SpecError | str] = list(loaded.errors)
    if not loaded.cases and not errors:
        print(f"no case files under {', '.join(map(str, paths))}", file=sys.stderr)
        return EXIT_USAGE
    all_ids = (
        {case.id for case in load_cases([root], root).cases}
        if check_divergence_ids and root.is_dir()
        else set()
    )
    if check_divergence_ids:
        try:
            spec_version(root)
        except SpecError as error:
            errors.append(error)
    for plane in planes:
        for name in unknown(set(plane.capabilities) | set(plane.missing_notes)):
            errors.append(
                f"plane {plane.name}: unknown capability {name!r} (see conformance/capabilities.py)"
            )
        for path in dict.fromkeys((plane.divergences, plane.grpc_divergences)):
            if path is None:
                continue
            try:
                divergences = load_divergences(path)
            except SpecError as bad_file:
                errors.append(bad_file)
                continue
            if all_ids:
                errors += unknown_cases(path, divergences, all_ids)
    for problem in errors:
        print(problem, file=sys.stderr)
    print(f"{len(loaded.cases)} valid case(s), {len(errors)} error(s)")
    return EXIT_USAGE if errors else EXIT_OK


def list_cases(cases: Sequence[Case], planes: Sequence[Plane], fleet: str = "fake") -> int:
    divergences = {p.name: _divergences(p, fleet) for p in planes}
    for case in cases:
        verdicts = []
        for plane in planes:
            missing = (case.capabilities_needed() | fleet_capabilities(fleet)) - plane.capabilities
            if missing:
                verdicts.append(f"{plane.name}: unsupported")
            elif (refused := _refusal(plane, case)) is not None:
                verdicts.append(f"{plane.name}: unsupported ({refused})")
            elif case.id in divergences[plane.name]:
                verdicts.append(f"{plane.name}: divergent")
            else:
                verdicts.append(f"{plane.name}: runs")
        tags = ",".join(case.tags) or "-"
        print(f"{case.id:<48} [{tags}] {'; '.join(verdicts)}")
        print(f"    {case.name}")
    print(f"{len(cases)} case(s)")
    return EXIT_OK


def _refusal(plane: Plane, case: Case) -> str | None:
    """Why the plane's `check` refuses the case, or None when it takes it."""
    try:
        plane.check(case)
    except Unsupported as exc:
        return str(exc)
    return None


def _divergences(plane: Plane, fleet: str) -> dict[str, Divergence]:
    return load_divergences(plane.divergence_file(fleet))


def parity(folder: Path, out: Path | None) -> int:
    """The parity matrix from the reports under `folder`, to `out` or stdout."""
    try:
        found = load_reports(folder)
    except ReportError as error:
        print(f"conformance: {error}", file=sys.stderr)
        return EXIT_USAGE
    if not found:
        print(f"conformance: no reports under {folder}", file=sys.stderr)
        return EXIT_USAGE
    text = parity_markdown(found, f"the reports in `{folder.as_posix()}/`")
    if out is None:
        sys.stdout.write(text)
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text, encoding="utf-8")
    return EXIT_OK


def run(
    cases: Sequence[Case],
    planes: Sequence[Plane],
    args: argparse.Namespace,
    argv: Sequence[str] | None,
    version: str,
) -> int:
    try:
        divergences = {plane.name: _divergences(plane, args.fleet) for plane in planes}
    except SpecError as bad_file:
        print(f"invalid divergence file: {bad_file}", file=sys.stderr)
        return EXIT_USAGE
    probes = {plane.name: plane.probe() for plane in planes}
    problems = [fleet_problem(args.fleet)] + [probe.problem for probe in probes.values()]
    if any(problems):
        for problem in problems:
            if problem:
                print(f"conformance: {problem}", file=sys.stderr)
        return EXIT_NOT_INSTALLED
    total = len(cases) * len(planes)
    done = 0

    def progress(outcome: Outcome) -> None:
        nonlocal done
        done += 1
        print(
            f"[{done:>3}/{total}] {outcome.verdict:<11} {outcome.plane:<7} {outcome.case_id} ({outcome.seconds:.1f}s)"
            + (
                f"  {outcome.detail.splitlines()[0]}"
                if outcome.detail and outcome.verdict != "pass"
                else ""
            ),
            flush=True,
        )
        if outcome.verdict in FAILING or args.verbose:
            for line in [*outcome.detail.splitlines()[1:], *outcome.failures]:
                print(f"        {line}", flush=True)
        for note in outcome.notes:
            print(f"        note: {note}", flush=True)
        if args.verbose and outcome.plane_log:
            print(f"        last output of {outcome.plane}:", flush=True)
            for line in outcome.plane_log.splitlines():
                print(f"          | {line}", flush=True)

    engines = args.fleet in ENGINE_FLEETS
    timeout_s = args.case_timeout_s or (ENGINE_CASE_TIMEOUT_S if engines else CASE_TIMEOUT_S)
    jobs = 1 if engines else args.jobs
    options = RunOptions(
        jobs=jobs,
        run_unsupported=args.run_unsupported,
        on_outcome=progress,
        case_timeout_s=timeout_s,
        fleet=args.fleet,
    )
    versions = {name: probe.version for name, probe in probes.items()}
    print(
        f"running {len(cases)} case(s) of spec version {version} on "
        f"{', '.join(f'{n} ({v})' for n, v in versions.items())}, {jobs} at a time"
        + (
            f", on {max(len(case.fleet) for case in cases)} vLLM engine(s) started first"
            if engines
            else ""
        )
        + (" (gRPC)" if args.fleet in ("grpc", "vllm-grpc") else ""),
        flush=True,
    )
    started = time.monotonic()
    try:
        outcomes = trio.run(run_until_interrupted, cases, planes, divergences, options)
    except (EngineUnavailable, BaseExceptionGroup) as problem:
        failed = _engines_failed(problem)
        if failed is None:
            raise
        print(f"conformance: the engines did not start: {failed}", file=sys.stderr)
        return EXIT_FAILED
    seconds = time.monotonic() - started
    if outcomes is None:
        print(
            f"interrupted after {seconds:.1f}s; every process of the run was stopped",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    command = "conformance " + shlex.join(list(sys.argv[1:] if argv is None else argv))
    info = RunInfo(
        planes=versions,
        capabilities={plane.name: plane.capabilities for plane in planes},
        command=command,
        seconds=seconds,
        jobs=jobs,
        spec_version=version,
        fleet=args.fleet,
    )
    if args.report_md is not None:
        args.report_md.parent.mkdir(parents=True, exist_ok=True)
        args.report_md.write_text(markdown(outcomes, info), encoding="utf-8")
    if args.report_yaml is not None:
        for report in reports(outcomes, info):
            print(f"report: {write_report(args.report_yaml, report)}")
    if args.junit is not None:
        args.junit.parent.mkdir(parents=True, exist_ok=True)
        args.junit.write_text(junit(outcomes, info), encoding="utf-8")
    counts = {
        v: sum(1 for o in outcomes if o.verdict == v)
        for v in ("pass", "divergent", "unsupported", "fail", "stale", "error")
    }
    print(
        f"done in {seconds:.1f}s: "
        + ", ".join(f"{count} {verdict}" for verdict, count in counts.items() if count)
    )
    return EXIT_FAILED if any(o.verdict in FAILING for o in outcomes) else EXIT_OK


def _engines_failed(problem: BaseException) -> EngineUnavailable | None:
    """The engine failure a run ended with, out of the groups its nurseries wrapped it
    in; None when it ended with anything else too."""
    if isinstance(problem, EngineUnavailable):
        return problem
    if not isinstance(problem, BaseExceptionGroup):
        return None
    failed, rest = problem.split(EngineUnavailable)
    if failed is None or rest is not None:
        return None
    leaf: BaseException = failed
    while isinstance(leaf, BaseExceptionGroup):
        leaf = leaf.exceptions[0]
    return leaf if isinstance(leaf, EngineUnavailable) else None


async def run_until_interrupted(
    cases: Sequence[Case],
    planes: Sequence[Plane],
    divergences: dict[str, dict[str, Divergence]],
    options: RunOptions,
) -> list[Outcome] | None:
    """`run_suite`, or None when SIGINT or SIGTERM arrived first. Either signal cancels
    the suite, which stops every process it started (sidecars, fleets, planes) before
    this returns."""
    outcomes: list[Outcome] | None = None
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def suite() -> None:
                nonlocal outcomes
                outcomes = await run_suite(cases, planes, divergences, options)
                nursery.cancel_scope.cancel()

            async def watch() -> None:
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(suite)
            nursery.start_soon(watch)
    return outcomes


if __name__ == "__main__":
    sys.exit(main())
