"""The route table, the resolve stage per route kind, and the non-generation plan: which
workers a non-generation request may reach, and the 503 when none of them is mixed."""

from __future__ import annotations

import re
from pathlib import Path

import orjson
import pytest

from router.api.errors import BadRequest, ModelNotFound, NoAvailableWorkers
from router.api.routes import ROUTES, Dialect, Kind
from router.fake_worker.apis import GENERATION_PATHS
from router.fake_worker.pooling import POOLING_ROUTES
from router.fleet.candidates import AllOpenMode
from router.fleet.records import Mode, Role
from router.pipeline.plan import plan_request
from router.pipeline.resolve import parse_generation_request
from tests.pipeline.test_plan import NOW, fleet_of, record, trip

DOCS = Path(__file__).resolve().parents[2] / "docs"
GENERATION = {
    "/v1/chat/completions",
    "/v1/completions",
    "/generate",
    "/v1/responses",
    "/v1/messages",
}


def test_the_table_holds_the_whole_api_with_one_kind_and_dialect_each() -> None:
    assert {path for path, route in ROUTES.items() if route.kind is Kind.GENERATION} == GENERATION
    assert set(ROUTES) - GENERATION == {
        "/v1/embeddings",
        "/v1/rerank",
        "/v1/score",
        "/v1/classify",
        "/v1/tokenize",
        "/v1/detokenize",
        "/tokenize",
        "/detokenize",
        "/pooling",
    }
    assert {path for path, route in ROUTES.items() if route.dialect is Dialect.ANTHROPIC} == {
        "/v1/messages"
    }
    assert ROUTES["/v1/responses"].dialect is Dialect.RESPONSES
    assert all(route.path == path and "model" in route.reads for path, route in ROUTES.items())
    assert not any(route.streams for route in ROUTES.values() if not route.generation)


def test_the_fake_worker_serves_every_route_the_router_forwards() -> None:
    assert set(GENERATION_PATHS) == GENERATION
    assert set(POOLING_ROUTES) == set(ROUTES) - GENERATION


def test_api_md_lists_every_route_and_label() -> None:
    text = (DOCS / "api.md").read_text()
    spans = set(re.findall(r"`([^`\n]+)`", text))
    assert sorted(set(ROUTES) - spans) == []
    assert sorted({route.label for route in ROUTES.values()} - spans) == []


def parse(path: str, body: object, models: tuple[str, ...] = ("m",)):  # type: ignore[no-untyped-def]
    return parse_generation_request(path, orjson.dumps(body), list(models))


def test_non_generation_bodies_are_checked_for_their_model_only() -> None:
    request = parse("/v1/embeddings", {"input": 5, "stream": "yes", "messages": 7})
    assert (request.model, request.stream, request.route) == ("m", False, "embeddings")
    with pytest.raises(BadRequest, match="'model' must be a non-empty string"):
        parse("/v1/rerank", {"model": 3})
    with pytest.raises(BadRequest, match="must be a JSON object"):
        parse("/pooling", ["input"])


def test_messages_and_responses_are_checked_like_generation() -> None:
    assert parse(
        "/v1/messages",
        {
            "max_tokens": 3,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
            "stream": True,
        },
    ).stream
    with pytest.raises(BadRequest, match="'messages' must be a non-empty list"):
        parse("/v1/messages", {"max_tokens": 3, "messages": []})
    with pytest.raises(BadRequest, match="'stream' must be a boolean"):
        parse("/v1/responses", {"input": "x", "stream": "true"})
    with pytest.raises(BadRequest, match="'temperature' must be a number"):
        parse("/v1/responses", {"input": "x", "temperature": "hot"})


def test_non_generation_goes_to_mixed_workers_only() -> None:
    fleet = fleet_of(record("p", Role.PREFILL), record("d", Role.DECODE), record("a"))
    generation = plan_request("m", fleet.for_model("m"), NOW, AllOpenMode.DISPATCH)
    other = plan_request("m", fleet.for_model("m"), NOW, AllOpenMode.DISPATCH, generation=False)
    assert generation.mode is Mode.PD
    assert other.mode is Mode.MIXED
    assert [w.id for w in other.legs[Role.MIXED].candidates] == ["a"]


def test_a_pd_only_model_is_503_for_non_generation_and_still_404_when_unknown() -> None:
    fleet = fleet_of(record("p", Role.PREFILL), record("d", Role.DECODE))
    with pytest.raises(NoAvailableWorkers) as info:
        plan_request("m", fleet.for_model("m"), NOW, AllOpenMode.DISPATCH, 2.0, generation=False)
    assert info.value.message == (
        "model 'm' is served only by prefill/decode workers (2 workers), and PD workers serve "
        "generation only: this route needs a mixed worker"
    )
    assert info.value.headers() == [(b"retry-after", b"2")]
    with pytest.raises(ModelNotFound):
        plan_request("other", fleet.for_model("other"), NOW, AllOpenMode.DISPATCH, generation=False)


def test_unavailable_mixed_workers_beside_pd_name_the_mixed_pool() -> None:
    fleet = fleet_of(
        record("p", Role.PREFILL),
        record("d", Role.DECODE),
        record("a", draining=True),
        record("b"),
        unhealthy=("b",),
    )
    with pytest.raises(NoAvailableWorkers) as info:
        plan_request("m", fleet.for_model("m"), NOW, AllOpenMode.DISPATCH, generation=False)
    assert (
        info.value.message
        == "all 2 mixed workers for model 'm' are unavailable (1 draining, 1 unhealthy)"
    )


def test_breaker_open_mixed_workers_follow_the_all_open_mode() -> None:
    fleet = fleet_of(record("a"))
    trip(fleet.get("a"), cooldown_s=7.0)
    forced = plan_request("m", fleet.for_model("m"), NOW, AllOpenMode.DISPATCH, generation=False)
    assert forced.legs[Role.MIXED].forced
    with pytest.raises(NoAvailableWorkers) as info:
        plan_request("m", fleet.for_model("m"), NOW, AllOpenMode.REJECT, generation=False)
    assert info.value.message == "the only worker for model 'm' is unavailable (1 breaker open)"
    assert info.value.headers() == [(b"retry-after", b"7")]
