"""The conformance cases that declare `fleets: [..., vllm]`, on real engines with real
faults, against our router: every one passes (`conformance run --fleet vllm --plane
python` in one test). The other planes' verdicts on engines are data, recorded by `make
conformance-engines` in docs/parity.md."""

from __future__ import annotations

import trio

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
