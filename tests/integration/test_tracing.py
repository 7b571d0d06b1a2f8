"""Tracing over loopback: the router exports OTLP/HTTP to a receiver that decodes it, and
the workers get the attempt's `traceparent`."""

from __future__ import annotations

import httpx
import trio

from router.fake_worker.settings import FakeWorkerSettings
from router.observability.tracing import OtlpTracing
from tests.support.fake_fleet import open_fake_fleet
from tests.support.otlp_receiver import OtlpReceiver, ReceivedSpan, open_otlp_receiver
from tests.support.ports import free_port
from tests.support.router_instance import open_router
from tests.support.waiting import wait_until

GUARD_S = 30
MODEL = "fake-model"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
SPAN_KIND_SERVER, SPAN_KIND_CLIENT = 2, 3
STATUS_ERROR = 2


def _traceparent_parts(value: str) -> tuple[str, str]:
    _, trace_id, span_id, _ = value.split("-")
    return trace_id, span_id


async def _spans(router_tracing: object, receiver: OtlpReceiver, count: int) -> list[ReceivedSpan]:
    assert isinstance(router_tracing, OtlpTracing)
    await router_tracing.flush()
    await wait_until(lambda: len(receiver.spans) >= count)
    return receiver.spans


async def test_a_failed_over_request_is_one_span_with_a_child_per_attempt() -> None:
    flaky = FakeWorkerSettings(fail_first=1, fail_status=503)
    with trio.fail_after(GUARD_S):
        async with (
            open_otlp_receiver() as receiver,
            open_fake_fleet([flaky, FakeWorkerSettings()]) as fleet,
        ):
            specs = [f"{handle.url},model={MODEL}" for handle in fleet]
            async with open_router(specs, otlp_traces_endpoint=receiver.url) as router:
                async with httpx.AsyncClient(base_url=router.url) as client:
                    response = await client.post(
                        "/v1/chat/completions",
                        json=CHAT,
                        headers={
                            "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01",
                            "x-request-id": "traced-1",
                        },
                    )
                    assert response.status_code == 200
                spans = await _spans(router.app.tracing, receiver, 3)
    [root] = receiver.named("POST /v1/chat/completions")
    assert (root.trace_id, root.parent_span_id, root.kind) == (
        CLIENT_TRACE,
        CLIENT_SPAN,
        SPAN_KIND_SERVER,
    )
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["router.request_id"] == "traced-1"
    assert root.service == "trio-router"
    attempts = sorted(
        receiver.children_of(root),
        key=lambda span: span.attributes["router.worker"] != fleet[0].url,
    )
    assert len(spans) == 3 and len(attempts) == 2
    assert [
        (
            a.attributes["router.worker"],
            a.attributes["router.attempt"],
            a.attributes["router.verdict"],
            a.attributes["http.response.status_code"],
            a.kind,
        )
        for a in attempts
    ] == [
        (fleet[0].url, 1, "fault", 503, SPAN_KIND_CLIENT),
        (fleet[1].url, 2, "success", 200, SPAN_KIND_CLIENT),
    ]
    # Each worker got its own attempt's traceparent, in the client's trace, never the client's own.
    for handle, attempt in zip(fleet, attempts, strict=True):
        [headers] = list(handle.worker.routing.headers)
        assert _traceparent_parts(headers["traceparent"]) == (CLIENT_TRACE, attempt.span_id)


async def test_pd_legs_are_sibling_spans_and_a_503_marks_the_request_span_an_error() -> None:
    bootstrap = free_port()
    fleet_settings = [
        FakeWorkerSettings(role="prefill", bootstrap_port=bootstrap),
        FakeWorkerSettings(role="decode"),
    ]
    with trio.fail_after(GUARD_S):
        async with open_otlp_receiver() as receiver, open_fake_fleet(fleet_settings) as fleet:
            specs = [
                f"{fleet[0].url},role=prefill,bootstrap_port={bootstrap}",
                f"{fleet[1].url},role=decode",
            ]
            async with open_router(
                specs, otlp_traces_endpoint=receiver.url, max_attempts=1
            ) as router:
                async with httpx.AsyncClient(base_url=router.url) as client:
                    assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
                    await client.post(
                        f"{fleet[1].url}/debug/behaviour",
                        json={"fail_first": 1, "fail_status": 503},
                    )
                    assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 503
                await _spans(router.app.tracing, receiver, 6)
    served, failed = sorted(
        receiver.named("POST /v1/chat/completions"),
        key=lambda s: s.attributes["http.response.status_code"],
    )
    legs = sorted(
        (span.attributes["router.role"], span.attributes["router.verdict"])
        for span in receiver.children_of(served)
    )
    assert legs == [("decode", "success"), ("prefill", "success")]
    assert {span.trace_id for span in receiver.children_of(served)} == {served.trace_id}
    assert failed.status_code == STATUS_ERROR and served.status_code != STATUS_ERROR
    failed_legs = {
        span.attributes["router.role"]: span.attributes.get("router.verdict")
        for span in receiver.children_of(failed)
    }
    assert failed_legs["decode"] == "fault"


async def test_without_an_endpoint_nothing_is_exported_and_the_clients_traceparent_passes() -> None:
    traceparent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    with trio.fail_after(GUARD_S):
        async with open_otlp_receiver() as receiver, open_fake_fleet(1) as fleet:
            async with open_router([f"{fleet[0].url},model={MODEL}"]) as router:
                assert not router.app.tracing.enabled
                async with httpx.AsyncClient(base_url=router.url) as client:
                    response = await client.post(
                        "/v1/chat/completions", json=CHAT, headers={"traceparent": traceparent}
                    )
                    assert response.status_code == 200
    assert receiver.posts == 0
    assert [headers["traceparent"] for headers in fleet[0].worker.routing.headers] == [traceparent]
