"""What an API server (or something answering in its place) can send the Pods client, and
what each costs: an endless line, garbage, a 410 either way, an oversize listing. Every
case is one clear exception for the watch loop (resume or relist), never a crash or
unbounded memory."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import httpx
import orjson
import pytest
import trio

from router.discovery import kubernetes
from router.discovery.kube_pods import pod_sources
from router.discovery.kubernetes import KubeGone, KubeTiming, KubeUnavailable, PodsApi
from tests.support.raw_upstream import Exchange, open_raw_upstream

SOURCE = pod_sources("app=engine", "", "")[0]
JSON = [(b"content-type", b"application/json")]


async def watch_all(respond: Callable[[Exchange], Awaitable[None]]) -> list[dict[str, object]]:
    """Every event one watch yields against a server answering with `respond`."""
    events = []
    error: Exception | None = None
    async with (
        open_raw_upstream(respond) as upstream,
        httpx.AsyncClient(base_url=upstream.url) as http,
    ):
        api = PodsApi(
            http,
            "default",
            KubeTiming(request_timeout_s=5, watch_timeout_s=5, watch_read_margin_s=1),
        )
        try:
            async with api.watch(SOURCE, "100") as stream:
                async for event in stream:
                    events.append(event)
        except Exception as exc:  # raised below, outside the server's nursery
            error = exc
    if error is not None:
        raise error
    return events


def line(kind: str, obj: dict[str, object]) -> bytes:
    return orjson.dumps({"type": kind, "object": obj}) + b"\n"


async def test_an_endless_line_is_refused_at_the_bound_not_held(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kubernetes, "MAX_EVENT_BYTES", 64 * 1024)
    sent = []

    async def respond(exchange: Exchange) -> None:
        await exchange.start(200, JSON)
        for _ in range(1000):  # up to 64 MiB, without a newline
            await exchange.send(b"x" * 65536)
            sent.append(1)

    with (
        trio.fail_after(30),
        pytest.raises(KubeUnavailable, match="an event larger than 65536 bytes"),
    ):
        await watch_all(respond)
    assert len(sent) < 100  # the client stopped reading long before the end


@pytest.mark.parametrize(
    ("payload", "error", "message"),
    [
        (b"not json\n", KubeUnavailable, "not JSON"),
        (b"[1, 2]\n", KubeUnavailable, "not a watch event"),
        (b'{"type": "ADDED", "object": "pod"}\n', KubeUnavailable, "not a watch event"),
        (
            line(
                "ERROR", {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old"}
            ),
            KubeGone,
            "too old",
        ),
        (
            line(
                "ERROR",
                {"kind": "Status", "code": 500, "reason": "InternalError", "message": "boom"},
            ),
            KubeUnavailable,
            "ERROR event 500",
        ),
    ],
)
async def test_a_bad_or_error_line_is_one_clear_exception(
    payload: bytes, error: type[Exception], message: str
) -> None:
    async def respond(exchange: Exchange) -> None:
        await exchange.start(200, JSON)
        await exchange.send(
            line("ADDED", {"metadata": {"name": "w-0", "resourceVersion": "101"}}) + payload
        )
        await exchange.end()

    with trio.fail_after(30), pytest.raises(error, match=message):
        await watch_all(respond)


async def test_events_split_across_chunks_arrive_whole() -> None:
    first, second = (
        line("ADDED", {"metadata": {"name": "a"}}),
        line("BOOKMARK", {"metadata": {"resourceVersion": "7"}}),
    )
    data = first + second

    async def respond(exchange: Exchange) -> None:
        await exchange.start(200, JSON)
        for index in range(0, len(data), 7):
            await exchange.send(data[index : index + 7])
        await exchange.end()

    with trio.fail_after(30):
        events = await watch_all(respond)
    assert [event["type"] for event in events] == ["ADDED", "BOOKMARK"]


@pytest.mark.parametrize(
    ("status", "error"), [(410, KubeGone), (403, KubeUnavailable), (500, KubeUnavailable)]
)
async def test_a_watch_refused_by_status_says_why(status: int, error: type[Exception]) -> None:
    body = orjson.dumps({"kind": "Status", "code": status, "reason": "Why", "message": "because"})

    async def respond(exchange: Exchange) -> None:
        await exchange.respond(status, JSON, body)

    with trio.fail_after(30), pytest.raises(error, match="Why: because"):
        await watch_all(respond)


async def test_an_oversize_listing_is_refused_at_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kubernetes, "MAX_LIST_BYTES", 64 * 1024)

    async def respond(exchange: Exchange) -> None:
        await exchange.start(200, JSON)
        for _ in range(100):
            await exchange.send(b" " * 65536)
        await exchange.end()

    with trio.fail_after(30):
        async with (
            open_raw_upstream(respond) as upstream,
            httpx.AsyncClient(base_url=upstream.url) as http,
        ):
            api = PodsApi(http, "default", KubeTiming())
            with pytest.raises(KubeUnavailable, match="larger than 65536 bytes"):
                await api.list(SOURCE)
            assert upstream.requests == 1
