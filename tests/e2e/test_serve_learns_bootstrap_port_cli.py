"""`router serve --worker http://p:30000,role=prefill` used to refuse to start: a prefill
named without its bootstrap port now learns it from the engine (`/get_server_info`)."""

from __future__ import annotations

import httpx
import trio

from tests.support.cli_process import open_cli_piped


async def test_serve_starts_with_a_bare_prefill_and_hands_off_with_the_learned_port() -> None:
    with trio.fail_after(60):
        async with (
            open_cli_piped(
                "fake-worker", "--port", "0", "--role", "prefill", "--bootstrap-port", "9555"
            ) as (_, prefill_out, _),
            open_cli_piped("fake-worker", "--port", "0", "--role", "decode") as (_, decode_out, _),
        ):
            pattern = r"^fake-worker listening on (http://\S+)$"
            prefill_url = await prefill_out.url(pattern)
            decode_url = await decode_out.url(pattern)
            async with open_cli_piped(
                "serve",
                "--port",
                "0",
                "--worker",
                f"{prefill_url},role=prefill",
                "--worker",
                f"{decode_url},role=decode",
            ) as (router, _, router_err):
                router_url = await router_err.url(r"router listening on (http://\S+)")
                await router_err.wait_for(r"admitted with facts from its engine")
                body = {
                    "model": "fake-model",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 2,
                }
                async with httpx.AsyncClient(timeout=10) as client:
                    answer = await client.post(router_url + "/v1/chat/completions", json=body)
                    routing = (await client.get(decode_url + "/debug/routing")).json()
                assert router.returncode is None
    assert answer.status_code == 200, answer.text
    assert [h["bootstrap_port"] for h in routing["handoffs"]] == [9555]
    assert "Traceback" not in router_err.text
