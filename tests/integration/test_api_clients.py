"""The whole inference API through the router, with the real `openai` and `anthropic`
clients, against fake workers over loopback sockets.

Each client call runs in a thread (the clients are synchronous); the answer through the
router must be the worker's own, and each request must reach a worker exactly once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anthropic
import openai
import trio

from router.fake_worker.formats import expected_text
from router.fake_worker.pooling import vector
from router.fake_worker.settings import FakeWorkerSettings
from tests.support.fake_fleet import FakeWorkerHandle, open_fake_fleet
from tests.support.router_instance import open_router

GUARD_S = 30
MODEL = "fake-model"


async def through_router_and_direct(
    scenario: Callable[[str], dict[str, Any]], worker: FakeWorkerSettings | None = None
) -> tuple[dict[str, Any], dict[str, Any], FakeWorkerHandle]:
    """`scenario` (a client run against a base URL, in a thread: the clients are
    synchronous) through a router, then straight at its one fake worker: what each run
    saw, and the worker, stopped, for its counts."""
    with trio.fail_after(GUARD_S):
        async with (
            open_fake_fleet([worker or FakeWorkerSettings()]) as fleet,
            open_router([fleet[0].url]) as router,
        ):
            routed = await trio.to_thread.run_sync(scenario, router.url)
            direct = await trio.to_thread.run_sync(scenario, fleet[0].url)
    return routed, direct, fleet[0]


def _openai(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=10)


def _anthropic(base_url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=10)


def _embeddings(base_url: str) -> dict[str, Any]:
    with _openai(base_url) as client:
        result = client.embeddings.create(
            model=MODEL, input=["the same words", "other words here", "the same words"]
        )
    return {
        "vectors": [item.embedding for item in result.data],
        "indexes": [item.index for item in result.data],
        "prompt_tokens": result.usage.prompt_tokens,
        "total_tokens": result.usage.total_tokens,
    }


async def test_openai_embeddings_create_through_the_router() -> None:
    routed, direct, worker = await through_router_and_direct(
        _embeddings, FakeWorkerSettings(embedding_dim=12)
    )
    paths = dict(worker.worker.routing.paths)
    assert routed == direct
    vectors = routed["vectors"]
    assert [len(v) for v in vectors] == [12, 12, 12]
    assert vectors[0] == vectors[2] != vectors[1]  # equal inputs, equal vectors
    assert vectors[0] == vector("the same words", 12)
    assert routed["indexes"] == [0, 1, 2]
    assert routed["prompt_tokens"] == routed["total_tokens"] == 9
    assert paths["/v1/embeddings"] == 2  # one through the router, one direct


def _responses(base_url: str) -> dict[str, Any]:
    with _openai(base_url) as client:
        unary = client.responses.create(
            model=MODEL, input="say four words please", max_output_tokens=5
        )
        with client.responses.create(
            model=MODEL, input="say four words please", max_output_tokens=5, stream=True
        ) as stream:
            events = list(stream)
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    final = events[-1]
    assert unary.usage is not None
    return {
        "text": unary.output_text,
        "status": unary.status,
        "usage": (unary.usage.input_tokens, unary.usage.output_tokens, unary.usage.total_tokens),
        "event_types": [event.type for event in events],
        "sequence": [event.sequence_number for event in events],
        "deltas": deltas,
        "final_text": final.response.output_text,  # type: ignore[union-attr]
    }


async def test_openai_responses_create_unary_and_streaming_through_the_router() -> None:
    routed, direct, worker = await through_router_and_direct(_responses)
    dispatches = worker.worker.routing.dispatches
    assert routed == direct
    assert routed["text"] == routed["deltas"] == routed["final_text"] == expected_text(5)
    assert routed["status"] == "incomplete"  # stopped by max_output_tokens
    assert routed["usage"] == (4, 5, 9)
    types = routed["event_types"]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types.count("response.output_text.delta") == 5
    assert types[-1] == "response.incomplete"
    assert routed["sequence"] == list(range(len(types)))
    assert dispatches == 4  # two calls each way


def _messages(base_url: str) -> dict[str, Any]:
    conversation = [{"role": "user", "content": "three words here"}]
    with _anthropic(base_url) as client:
        unary = client.messages.create(
            model=MODEL, max_tokens=6, system="be brief", messages=conversation
        )  # type: ignore[arg-type]
        with client.messages.stream(
            model=MODEL, max_tokens=6, system="be brief", messages=conversation
        ) as stream:  # type: ignore[arg-type]
            streamed_text = "".join(stream.text_stream)
            final = stream.get_final_message()
        with client.messages.create(
            model=MODEL, max_tokens=2, messages=conversation, stream=True
        ) as raw:  # type: ignore[arg-type]
            raw_events = [event.type for event in raw]
    text = unary.content[0].text  # type: ignore[union-attr]
    return {
        "text": text,
        "stop_reason": unary.stop_reason,
        "usage": (unary.usage.input_tokens, unary.usage.output_tokens),
        "streamed": streamed_text,
        "final": (final.stop_reason, final.usage.input_tokens, final.usage.output_tokens),
        "raw_events": raw_events,
    }


async def test_anthropic_messages_create_unary_and_streaming_through_the_router() -> None:
    routed, direct, worker = await through_router_and_direct(_messages)
    dispatches = worker.worker.routing.dispatches
    assert routed == direct
    assert routed["text"] == routed["streamed"] == expected_text(6)
    assert routed["stop_reason"] == "max_tokens"
    assert routed["usage"] == (5, 6)  # "be brief" + "three words here"
    assert routed["final"] == ("max_tokens", 5, 6)
    # (the client drops `ping` events)
    assert routed["raw_events"] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert dispatches == 6


def _anthropic_error(base_url: str, model: str) -> anthropic.APIStatusError:
    with _anthropic(base_url) as client:
        try:
            client.messages.create(
                model=model, max_tokens=4, messages=[{"role": "user", "content": "hi"}]
            )
        except anthropic.APIStatusError as exc:
            return exc
    raise AssertionError("the request was answered 2xx")


async def test_anthropic_client_reads_the_routers_404_and_503_as_errors_of_its_api() -> None:
    with trio.fail_after(GUARD_S):
        async with open_fake_fleet(1) as fleet, open_router([fleet[0].url]) as router:
            missing = await trio.to_thread.run_sync(_anthropic_error, router.url, "no-such-model")
            router.fleet.workers()[0].healthy = False
            unavailable = await trio.to_thread.run_sync(_anthropic_error, router.url, MODEL)
            dispatches = fleet[0].worker.routing.dispatches
    assert isinstance(missing, anthropic.NotFoundError)
    assert missing.body == {
        "type": "error",
        "error": {
            "type": "not_found_error",
            "message": "model 'no-such-model' is not served by any worker",
            "code": "model_not_found",
        },
    }
    assert unavailable.status_code == 503
    assert isinstance(unavailable.body, dict)
    assert unavailable.body["error"]["type"] == "overloaded_error"
    assert unavailable.body["error"]["code"] == "no_available_workers"
    assert unavailable.response.headers["retry-after"] == "1"
    assert dispatches == 0
