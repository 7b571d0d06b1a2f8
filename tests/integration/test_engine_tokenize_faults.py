"""An engine whose /tokenize fails, stalls or lies costs no client a failed request: each
chat request through `kv_aware` (asking the engine for its token ids) is answered, is
placed by load, and the ask is counted by how it ended. Nothing of it touches the breaker."""

from __future__ import annotations

import httpx
import orjson
import pytest
import trio

from tests.support.raw_upstream import Exchange, open_raw_upstream
from tests.support.router_instance import open_router

GUARD_S = 30
MODEL = "m"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello " * 40}], "max_tokens": 2}
ANSWER = orjson.dumps(
    {
        "id": "x",
        "object": "chat.completion",
        "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
    }
)
JSON = [(b"content-type", b"application/json")]
TOKENIZE_ANSWERS = {
    "refused": (500, b'{"error": "boom"}'),
    "bad_answer:garbage": (200, b"<html>not json</html>"),
    "bad_answer:count": (200, b'{"count": 9, "tokens": [1, 2, 3], "max_model_len": 100}'),
    "bad_answer:strings": (200, b'{"count": 2, "tokens": ["a", "b"], "max_model_len": 100}'),
}


def vllm_like(tokenize: str) -> object:
    async def respond(exchange: Exchange) -> None:
        target = exchange.request.target
        if target in (b"/get_server_info", b"/server_info"):
            await exchange.respond(404, JSON, b"{}")
        elif target == b"/version":
            await exchange.respond(200, JSON, b'{"version": "0.32.0"}')
        elif target == b"/v1/models":
            body = {"data": [{"id": MODEL, "root": MODEL, "max_model_len": 2048}]}
            await exchange.respond(200, JSON, orjson.dumps(body))
        elif target == b"/kv_event_sources":
            await exchange.respond(200, JSON, b"{}")
        elif target == b"/tokenize":
            if tokenize == "timeout":
                await exchange.hold_until_peer_closes()
            elif tokenize == "failed":
                exchange.reset()
            else:
                status, body = TOKENIZE_ANSWERS[tokenize]
                await exchange.respond(status, JSON, body)
        elif target == b"/v1/chat/completions":
            await exchange.respond(200, JSON, ANSWER)
        else:
            await exchange.respond(200, [], b"")

    return respond


@pytest.mark.parametrize("mode", ["timeout", "failed", *TOKENIZE_ANSWERS])
async def test_a_tokenize_that_fails_or_lies_costs_no_client_anything(mode: str) -> None:
    outcome = mode.partition(":")[0]
    with trio.fail_after(GUARD_S):
        async with (
            open_raw_upstream(vllm_like(mode)) as engine,  # type: ignore[arg-type]
            open_router(
                [f"{engine.url},model={MODEL}"],
                policy="kv_aware",
                kv_token_sources="engine",
                kv_tokenize_timeout_s=0.3,
            ) as router,
            httpx.AsyncClient(base_url=router.url, timeout=10) as client,
        ):
            decided = 'router_kv_aware_token_source{model="m",source="engine"} 1.0'
            while decided not in (await client.get("/metrics")).text:  # noqa: ASYNC110 - a scrape
                await trio.sleep(0.02)
            started = trio.current_time()
            for _ in range(4):
                answer = await client.post("/v1/chat/completions", json=CHAT)
                assert answer.status_code == 200, answer.text
            took = trio.current_time() - started
            metrics = (await client.get("/metrics")).text
            worker = router.fleet.workers()[0]
    assert f'router_kv_aware_engine_tokenize_total{{outcome="{outcome}"}} 4.0' in metrics
    reason = 'reason="engine_tokenize",role="mixed"'
    assert f"router_kv_aware_no_prediction_total{{{reason}}} 4.0" in metrics
    # A stalled engine costs each request at most the ask's deadline.
    assert took < 4 * (0.3 + 0.5)
    assert worker.breaker is None or worker.breaker.statistics(trio.current_time()).trips == 0
