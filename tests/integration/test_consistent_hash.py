"""`consistent_hash` through the router: a session keeps its worker (and its KV cache), and a
worker leaving the fleet moves only the sessions it held."""

from __future__ import annotations

from collections.abc import Sequence

import httpx
import trio

from tests.support.fake_fleet import open_fake_fleet
from tests.support.router_instance import open_router

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 1}


async def _worker_of(client: httpx.AsyncClient, session: str) -> str:
    response = await client.post(
        "/v1/chat/completions", json=CHAT, headers={"x-session-id": session}
    )
    assert response.status_code == 200
    return response.headers["x-router-worker"]


async def _placement(client: httpx.AsyncClient, sessions: Sequence[str]) -> dict[str, str]:
    return {session: await _worker_of(client, session) for session in sessions}


async def test_a_session_stays_on_one_worker_for_20_requests() -> None:
    with trio.fail_after(20):
        async with (
            open_fake_fleet(3) as fleet,
            open_router([w.url for w in fleet], policy="consistent_hash") as router,
            httpx.AsyncClient(base_url=router.url) as client,
        ):
            chosen = {await _worker_of(client, "session-42") for _ in range(20)}
            dispatches = sorted(w.worker.routing.dispatches for w in fleet)
            # Other sessions are spread, not pinned to the same worker.
            others = set((await _placement(client, [f"s{i}" for i in range(30)])).values())
    assert len(chosen) == 1
    assert dispatches == [0, 0, 20]
    assert len(others) >= 2


async def test_a_worker_leaving_moves_only_its_own_sessions() -> None:
    sessions = [f"user-{i}" for i in range(60)]
    with trio.fail_after(20):
        async with (
            open_fake_fleet(4) as fleet,
            open_router([w.url for w in fleet], policy="consistent_hash") as router,
            httpx.AsyncClient(base_url=router.url) as client,
        ):
            before = await _placement(client, sessions)
            leaving = fleet[0].url
            gone = router.fleet.remove(leaving)
            assert gone is not None
            after = await _placement(client, sessions)
            router.fleet.upsert(gone.record)
            back = await _placement(client, sessions)
            dispatches = {w.url: w.worker.routing.dispatches for w in fleet}
    held = {session for session, worker in before.items() if worker == leaving}
    moved = {session for session in sessions if before[session] != after[session]}
    assert held, "the leaving worker held no session: the test would show nothing"
    assert moved == held
    assert leaving not in after.values()
    # Its sessions spread over the survivors rather than piling onto one of them.
    assert len({after[session] for session in held}) >= 2 or len(held) == 1
    # When it returns it takes back exactly its own sessions.
    assert back == before
    # Cost: while it was gone, the leaving worker received nothing.
    assert dispatches[leaving] == 2 * len(held)
    assert sum(dispatches.values()) == 3 * len(sessions)


async def test_without_a_session_the_prompt_prefix_keeps_a_conversation_together() -> None:
    turns: list[dict[str, str]] = [
        {"role": "system", "content": "you are terse"},
        {"role": "user", "content": "plan a trip to Lisbon"},
    ]
    with trio.fail_after(20):
        async with (
            open_fake_fleet(3) as fleet,
            open_router([w.url for w in fleet], policy="consistent_hash") as router,
            httpx.AsyncClient(base_url=router.url) as client,
        ):
            chosen = set()
            for turn in range(6):
                response = await client.post(
                    "/v1/chat/completions", json={**CHAT, "messages": turns}
                )
                assert response.status_code == 200
                chosen.add(response.headers["x-router-worker"])
                # A conversation grows by appending: the key (up to the first user turn) holds.
                turns = [
                    *turns,
                    {"role": "assistant", "content": f"a{turn}"},
                    {"role": "user", "content": f"q{turn}"},
                ]
    assert len(chosen) == 1
    assert sorted(w.worker.routing.dispatches for w in fleet) == [0, 0, 6]
