"""The conformance cases that declare `fleets: [..., vllm]`, on real engines with real
faults, against our router: every one passes (`conformance run --fleet vllm --plane
python` in one test). The other planes' verdicts on engines are data, recorded by `make
conformance-engines` in docs/parity.md."""

from __future__ import annotations

import trio

from conformance.divergences import load_divergences
from conformance.loader import default_spec_root, load_cases
from conformance.planes import resolve_plane
from conformance.runner import ENGINE_CASE_TIMEOUT_S, RunOptions, run_suite


async def test_every_engine_case_passes_on_the_python_plane() -> None:
    root = default_spec_root()
    cases = [case for case in load_cases([root], root).cases if "vllm" in case.fleets]
    assert len(cases) >= 9, [case.id for case in cases]  # the faults folder and its kin
    plane = resolve_plane("python")
    started = trio.current_time()
    with trio.fail_after(len(cases) * ENGINE_CASE_TIMEOUT_S):
        outcomes = await run_suite(
            cases,
            [plane],
            {},
            RunOptions(fleet="vllm", case_timeout_s=ENGINE_CASE_TIMEOUT_S),
        )
    print(f"\n{len(cases)} engine cases on python: {trio.current_time() - started:.0f} s")
    for outcome in outcomes:
        print(f"  {outcome.verdict:<6} {outcome.case_id} ({outcome.seconds:.1f} s)")
    failed = {o.case_id: [o.detail, *o.failures] for o in outcomes if o.verdict != "pass"}
    assert failed == {}


async def test_the_grpc_engine_cases_pass_on_smgs_grpc_path() -> None:
    """The cases that declare `fleets: [..., vllm-grpc]` on vLLM engines serving their gRPC
    service, behind smg's gRPC path: serving, a killed engine, a stream cut by a kill,
    every engine down (503) and an unknown model (404). Our plane has no gRPC path yet:
    every case is unsupported there, without starting anything for it."""
    root = default_spec_root()
    cases = [case for case in load_cases([root], root).cases if "vllm-grpc" in case.fleets]
    assert {case.id for case in cases} >= {
        "faults/serves-unary-and-stream",
        "faults/killed-worker-fails-over",
        "faults/all-killed-503-unknown-model-404",
        "classification/unknown-model-404",
    }
    smg, python = resolve_plane("smg"), resolve_plane("python")
    divergences = load_divergences(smg.divergence_file("vllm-grpc"))
    started = trio.current_time()
    with trio.fail_after(len(cases) * ENGINE_CASE_TIMEOUT_S):
        outcomes = await run_suite(
            cases,
            [smg, python],
            {smg.name: divergences},
            RunOptions(fleet="vllm-grpc", case_timeout_s=ENGINE_CASE_TIMEOUT_S),
        )
    print(f"\n{len(cases)} gRPC engine cases on smg: {trio.current_time() - started:.0f} s")
    for outcome in outcomes:
        print(
            f"  {outcome.verdict:<11} {outcome.plane:<6} {outcome.case_id} ({outcome.seconds:.1f} s)"
        )
    failed = {
        o.case_id: [o.detail, *o.failures]
        for o in outcomes
        if o.plane == "smg" and o.verdict not in ("pass", "divergent")
    }
    assert failed == {}
    assert {o.verdict for o in outcomes if o.plane == "python"} == {"unsupported"}
