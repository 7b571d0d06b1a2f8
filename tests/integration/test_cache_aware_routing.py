"""`cache_aware` through a real router in front of fake workers with prefix caches: the
conversation stays where its cache is, and the workers' own counters show the gain."""

from __future__ import annotations

import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families

from router.fake_worker.settings import FakeWorkerSettings
from tests.support.fake_fleet import open_fake_fleet
from tests.support.router_instance import open_router
from tests.support.waiting import wait_until

SYSTEM = {"role": "system", "content": "You answer questions about the fleet. " * 20}


async def _converse(client: httpx.AsyncClient, name: str, turns: int) -> list[str]:
    """One conversation, each turn sending the whole history; the workers that served it."""
    messages = [SYSTEM]
    served = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"{name} asks question {turn} " * 5})
        response = await client.post(
            "/v1/chat/completions",
            json={"model": "fake-model", "messages": messages, "max_tokens": 4},
        )
        assert response.status_code == 200
        served.append(response.headers["x-router-worker"])
        messages.append(
            {"role": "assistant", "content": response.json()["choices"][0]["message"]["content"]}
        )
    return served


async def _hit_rate(policy: str) -> tuple[float, list[list[str]]]:
    with trio.fail_after(30):
        async with (
            open_fake_fleet(3, cache_tokens=100_000) as fleet,
            open_router([w.url for w in fleet], policy=policy) as router,
            httpx.AsyncClient(base_url=router.url) as client,
        ):
            placements = [await _converse(client, f"user{n}", 6) for n in range(4)]
            prompt = sum(w.worker.routing.loads[0].prompt_tokens for w in fleet)
            cached = sum(w.worker.routing.loads[0].cached_tokens for w in fleet)
    return cached / prompt, placements


async def test_each_conversation_stays_on_one_worker_and_hits_its_cache() -> None:
    rate, placements = await _hit_rate("cache_aware")
    rr_rate, rr_placements = await _hit_rate("round_robin")
    assert all(len(set(served)) == 1 for served in placements)
    assert all(len(set(served)) == 3 for served in rr_placements)
    # Every turn after a conversation's first finds all but its newest message cached.
    assert rate > 0.7
    assert rate > rr_rate + 0.2


async def test_a_removed_worker_is_forgotten_even_when_it_comes_back() -> None:
    with trio.fail_after(30):
        async with (
            open_fake_fleet(2, cache_tokens=100_000) as fleet,
            open_router([w.url for w in fleet], policy="cache_aware") as router,
            httpx.AsyncClient(base_url=router.url) as client,
        ):
            (holder,) = set(await _converse(client, "ann", 5))
            gone = router.fleet.remove(holder)
            assert gone is not None
            moved = await _converse(client, "ann", 2)
            router.fleet.upsert(gone.record)
            # Back with a cold cache: its old five turns are forgotten, so the two turns
            # the other worker holds win the whole conversation.
            after = await _converse(client, "ann", 5)
            holder_dispatches = next(w for w in fleet if w.url == holder).worker.routing.dispatches
    assert holder not in moved and set(after) == set(moved)
    assert holder_dispatches == 5


async def test_metrics_show_the_trees_and_why_each_pick_was_made() -> None:
    with trio.fail_after(30):
        async with (
            open_fake_fleet(2) as fleet,
            open_router([w.url for w in fleet], policy="cache_aware", max_tree_size=1000) as router,
            httpx.AsyncClient(base_url=router.url) as client,
        ):
            await _converse(client, "bob", 2)
            await _converse(client, "eve", 2)
            scrape = (await client.get("/metrics")).text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(scrape)
        for s in family.samples
    }
    assert samples[("router_cache_aware_picks_total", (("reason", "room"), ("role", "mixed")))] == 1
    # Eve's first turn shares the system prompt (most of it) with Bob's: a match.
    assert (
        samples[("router_cache_aware_picks_total", (("reason", "match"), ("role", "mixed")))] == 3
    )
    # Two conversations of ~1,000 characters against a 1,000-character budget: evicted, bounded.
    assert samples[("router_cache_aware_tree_chars", (("role", "mixed"),))] <= 1000
    assert samples[("router_cache_aware_evicted_chars_total", (("role", "mixed"),))] > 0


async def test_pd_prefill_pool_routes_each_conversation_on_its_whole_prompt() -> None:
    """With `--prefill-policy cache_aware`, a conversation's prefills stay on the prefill
    that holds it; two conversations sharing only their first message do not collapse
    onto one prefill (the gateway once routed PD chat on the first message only)."""
    settings = [
        FakeWorkerSettings(role="prefill", bootstrap_port=9300 + i, cache_tokens=100_000)
        for i in range(2)
    ] + [FakeWorkerSettings(role="decode")]
    with trio.fail_after(30):
        async with open_fake_fleet(settings) as fleet:
            specs = [
                f"{h.url},role=prefill,bootstrap_port={h.settings.bootstrap_port}"
                for h in fleet[:2]
            ]
            specs.append(f"{fleet[2].url},role=decode")
            async with (
                open_router(specs, prefill_policy="cache_aware", cache_threshold=0.9) as router,
                httpx.AsyncClient(base_url=router.url) as client,
            ):
                for name in ("ann", "bob"):
                    await _converse(client, name, 3)
                with trio.fail_after(5):
                    await wait_until(lambda: all(w.inflight == 0 for w in router.fleet.workers()))
            prefills = [h.worker.routing.dispatches for h in fleet[:2]]
    # Each conversation shares its system prompt (about 90 % of a first turn) with the
    # other; on the whole prompt the second one still matches below 0.9 and takes the
    # empty prefill, then stays there.
    assert sorted(prefills) == [3, 3]
