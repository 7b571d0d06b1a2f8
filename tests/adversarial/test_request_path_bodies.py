"""Hostile and awkward client bodies through a real router over loopback, mixed and PD.

The workers are raw stubs that record the exact bytes they receive, so a test sees what
an engine would parse. Invariant after every case: no 500 caused by the client's bytes,
every lease released (`/v1/workers` in-flight 0, no probe held), the router still serving.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import pytest
import trio

from router.cli.serve import RunningRouter
from tests.adversarial.support import LAYOUTS, open_stub_workers
from tests.support.raw_upstream import Exchange, RawUpstream
from tests.support.router_instance import open_router

MODEL = "m"
OK = orjson.dumps({"choices": [{"message": {"content": "hello"}}]})
HANDOFF = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


@dataclass
class Stub:
    """A worker that answers 200 and keeps every generation body it received."""

    bodies: list[bytes] = field(default_factory=list)
    upstream: RawUpstream | None = None

    async def respond(self, exchange: Exchange) -> None:
        if exchange.request.method == b"POST":  # not the health checks
            self.bodies.append(exchange.body)
        await exchange.respond(200, [(b"content-type", b"application/json")], OK)


@dataclass
class Layout:
    router: RunningRouter
    client: httpx.AsyncClient
    stubs: list[Stub]
    pd: bool

    async def post(self, body: bytes, path: str = "/v1/chat/completions") -> httpx.Response:
        return await self.client.post(
            path, content=body, headers={"content-type": "application/json"}
        )

    async def assert_clean(self) -> None:
        """Every lease released, no probe held, and a plain request still served."""
        workers = (await self.client.get("/v1/workers")).json()["workers"]
        assert [entry["inflight"] for entry in workers] == [0] * len(self.stubs)
        assert all(entry["breaker"]["state"] == "closed" for entry in workers)
        before = [len(stub.bodies) for stub in self.stubs]
        response = await self.post(chat())
        assert response.status_code == 200, response.text
        assert [len(stub.bodies) for stub in self.stubs] == [count + 1 for count in before]


def chat(**extra: Any) -> bytes:
    return orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra})


@asynccontextmanager
async def layout(pd: bool) -> AsyncIterator[Layout]:
    stubs = [Stub(), Stub()] if pd else [Stub()]
    async with (
        open_stub_workers([stub.respond for stub in stubs], model=MODEL) as specs,
        open_router(specs) as router,
        httpx.AsyncClient(base_url=router.url, timeout=30) as client,
    ):
        yield Layout(router, client, stubs, pd)


def exact(raw: bytes) -> Any:
    """Parse keeping each number's spelling and every key, duplicates included."""
    return json.loads(
        raw,
        parse_float=lambda t: ("float", t),
        parse_int=lambda t: ("int", t),
        object_pairs_hook=list,
    )


@LAYOUTS
async def test_a_body_nested_300_deep_is_forwarded_not_a_500(pd: bool) -> None:
    body = chat()[:-1] + b',"deep":' + b"[" * 300 + b"]" * 300 + b"}"
    with trio.fail_after(30):
        async with layout(pd) as setup:
            response = await setup.post(body)
            assert response.status_code == 200, response.text
            for stub in setup.stubs:
                assert stub.bodies[-1].endswith(body[1:])
            await setup.assert_clean()


@LAYOUTS
async def test_numbers_escapes_and_key_order_reach_every_leg_as_sent(pd: bool) -> None:
    body = (
        b'{"z":1,"model":"m","seed":123456789012345678901234567890,"t":1.0,"u":-0.0,'
        b'"w":"caf\\u00e9","messages":[{"role":"user","content":"hi"}],"a":1E+2}'
    )
    with trio.fail_after(30):
        async with layout(pd) as setup:
            response = await setup.post(body)
            assert response.status_code == 200, response.text
            received = [stub.bodies[-1] for stub in setup.stubs]
            if not pd:
                assert received == [body]  # mixed: the very bytes
            else:
                prefill, decode = received
                assert prefill == decode  # one body for both legs
                members = exact(decode)
                assert [key for key, _ in members[:3]] == list(HANDOFF)
                assert members[3:] == exact(body)
                assert decode.endswith(body[1:])
            await setup.assert_clean()


async def test_the_clients_handoff_keys_are_replaced_never_duplicated() -> None:
    body = chat(bootstrap_room=5, bootstrap_host="elsewhere")[:-1] + b',"bootstrap\\u005fport":1}'
    with trio.fail_after(30):
        async with layout(pd=True) as setup:
            response = await setup.post(body)
            assert response.status_code == 200, response.text
            for stub in setup.stubs:
                keys = [key for key, _ in exact(stub.bodies[-1])]
                assert sorted(keys) == sorted(["model", "messages", *HANDOFF])
                received = orjson.loads(stub.bodies[-1])
                assert (
                    received["bootstrap_host"] == "127.0.0.1" and received["bootstrap_port"] == 8998
                )
            await setup.assert_clean()


@LAYOUTS
@pytest.mark.parametrize(
    ("path", "body", "says"),
    [
        ("/v1/chat/completions", chat(n=129), b"'n' is 129; the limit is 128 (--max-n)"),
        ("/v1/chat/completions", chat(n=10**6), b"the limit is 128 (--max-n)"),
        ("/v1/chat/completions", chat(n=1)[:-2] + b"1180591620717411303424}", b"'n' must be"),
        (
            "/generate",
            orjson.dumps({"model": MODEL, "text": "x", "sampling_params": {"n": 10**6}}),
            b"'sampling_params.n' is 1000000; the limit is 128",
        ),
        (
            "/generate",
            orjson.dumps({"model": MODEL, "text": "x", "sampling_params": {"n": 0}}),
            b"'sampling_params.n' must be a positive integer",
        ),
    ],
)
async def test_request_controlled_fan_out_is_refused_before_any_worker_is_taken(
    pd: bool, path: str, body: bytes, says: bytes
) -> None:
    with trio.fail_after(30):
        async with layout(pd) as setup:
            response = await setup.post(body, path)
            assert response.status_code == 400
            assert says in response.content
            assert [stub.bodies for stub in setup.stubs] == [[] for _ in setup.stubs]
            await setup.assert_clean()


async def test_a_pd_batch_beyond_max_n_is_a_400_and_one_within_it_is_served() -> None:
    with trio.fail_after(30):
        async with layout(pd=True) as setup:
            too_many = orjson.dumps({"model": MODEL, "prompt": ["x"] * 129})
            response = await setup.post(too_many, "/v1/completions")
            assert response.status_code == 400
            assert b"needs 129 prefill/decode handoffs" in response.content
            assert [stub.bodies for stub in setup.stubs] == [[], []]
            response = await setup.post(
                orjson.dumps({"model": MODEL, "prompt": ["x"] * 128}), "/v1/completions"
            )
            assert response.status_code == 200
            rooms = orjson.loads(setup.stubs[1].bodies[-1])["bootstrap_room"]
            assert len(rooms) == 128
            await setup.assert_clean()


@LAYOUTS
@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"{",
        b"[]",
        b"null",
        b"\xef\xbb\xbf{}",
        b'{"model":"m","messages":"\\ud800"}',
        b'{"model":"m","messages":[{"role":"user","content":"hi"}],"x":1e400}',
        b'{"model":"m","messages":[{"role":"user","content":"hi"}]}' + b" " * 1000 + b"x",
        b"[" * 2000 + b"]" * 2000,
    ],
    ids=[
        "empty",
        "truncated",
        "array",
        "null",
        "bom",
        "lone-surrogate",
        "huge-float",
        "trailing",
        "deep-2000",
    ],
)
async def test_unreadable_bodies_are_400_and_reach_no_worker(pd: bool, body: bytes) -> None:
    with trio.fail_after(30):
        async with layout(pd) as setup:
            response = await setup.post(body)
            assert response.status_code == 400, response.text
            assert response.json()["error"]["code"] == "invalid_request"
            assert [stub.bodies for stub in setup.stubs] == [[] for _ in setup.stubs]
            await setup.assert_clean()


async def test_a_body_the_handoff_cannot_be_spliced_into_is_a_400_that_says_why() -> None:
    """A client handoff key makes the router scan the body; nesting that orjson accepts
    (1,000 deep) but the scanner will not is the client's problem, told, never a 500."""
    body = chat(bootstrap_room=1)[:-1] + b',"x":' + b"[" * 1000 + b"]" * 1000 + b"}"
    with trio.fail_after(30):
        async with layout(pd=True) as setup:
            response = await setup.post(body)
            assert response.status_code == 400, response.text
            assert b"cannot carry the prefill/decode handoff" in response.content
            assert [stub.bodies for stub in setup.stubs] == [[], []]
            await setup.assert_clean()
