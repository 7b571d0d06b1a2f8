"""`router agent` without `--engine`: the engine's kind is learned from what it serves,
and the drain reads that kind's metric names; with `--engine` the flag stands."""

from __future__ import annotations

import httpx
import pytest
import trio

from router.agent.cli import EngineView, build_parser, options_from_args, prepare_engine
from router.fake_worker.settings import FakeWorkerSettings
from tests.support.fake_fleet import open_fake_fleet
from tests.support.raw_upstream import Exchange, open_raw_upstream


def agent_args(engine_url: str, *extra: str) -> list[str]:
    return ["--engine-url", engine_url, "--model", "fake-model", "--health-poll-s", "0.05", *extra]


async def prepared(engine_url: str, *extra: str) -> tuple[EngineView, str | None]:
    """What the agent makes of the engine before registering: its view and the record's
    engine."""
    options = options_from_args(build_parser().parse_args(agent_args(engine_url, *extra)))
    async with httpx.AsyncClient() as http:
        view = EngineView(http, engine_url + "/metrics", options.engine)
        record = await prepare_engine(http, options, view)
    return view, record.engine


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
async def test_without_the_flag_the_kind_is_learned_and_picks_the_metric_names(
    engine: str,
) -> None:
    with trio.fail_after(20):
        async with open_fake_fleet([FakeWorkerSettings(engine=engine)]) as (worker,):
            view, registered = await prepared(worker.url)
            async with httpx.AsyncClient() as http:
                load = await EngineView(http, worker.url + "/metrics", view.engine).read_load()
    assert view.engine == engine and registered == engine
    # the learned kind's gauges are found: the drain can see the engine's work
    assert load.running == 0 and load.queued == 0 and load.total == 0


async def test_the_flag_wins_over_what_the_engine_serves() -> None:
    with trio.fail_after(20):
        async with open_fake_fleet([FakeWorkerSettings(engine="vllm")]) as (worker,):
            options = options_from_args(
                build_parser().parse_args(agent_args(worker.url, "--engine", "sglang"))
            )
            async with httpx.AsyncClient() as http:
                view = EngineView(http, worker.url + "/metrics", options.engine)
                record = await prepare_engine(http, options, view)
                load = await view.read_load()
    assert view.engine == "sglang" and record.engine == "sglang"
    assert "/version" not in worker.worker.routing.paths  # not asked
    assert load.total is None  # SGLang's names on a vLLM engine: unknown, never idle


async def test_an_engine_of_no_known_kind_registers_as_unknown_and_its_load_is_unknown() -> None:
    async def respond(exchange: Exchange) -> None:
        if exchange.request.target == b"/health":
            await exchange.respond(200, [], b"")
        else:
            await exchange.respond(404, [(b"content-type", b"application/json")], b"{}")

    with trio.fail_after(20):
        async with open_raw_upstream(respond) as upstream:
            options = options_from_args(build_parser().parse_args(agent_args(upstream.url)))
            async with httpx.AsyncClient() as http:
                view = EngineView(http, upstream.url + "/metrics", options.engine)
                record = await prepare_engine(http, options, view)
                load = await view.read_load()
    assert view.engine is None and record.engine is None
    assert load.total is None
