"""The fake worker's handler driven in-process with a recording writer (no sockets), so
time-dependent behaviour runs on the autojump clock and every assertion reads exact state."""

from __future__ import annotations

from collections.abc import Sequence

import orjson
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from router.engines.facts import is_sglang_server_info, is_vllm_version
from router.fake_worker.behaviour import Behaviour, FailMode, InvalidBehaviour
from router.fake_worker.engine import FakeWorker
from router.fake_worker.formats import expected_text
from router.fake_worker.settings import FakeWorkerSettings
from router.http.server.messages import ClientDisconnected, Headers, Request


class RecordingWriter:
    """A `ResponseWriter` that keeps what it is given, and when (on trio's clock)."""

    def __init__(self, disconnect_after_writes: int | None = None) -> None:
        self.status: int | None = None
        self.headers: dict[bytes, bytes] = {}
        self.chunks: list[bytes] = []
        self.write_times: list[float] = []
        self.finished = False
        self.aborted: bool | None = None  # None: not aborted; else whether it was a reset
        self._started = False
        self._disconnect_after = disconnect_after_writes

    @property
    def started(self) -> bool:
        return self._started

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)

    def json(self) -> object:
        return orjson.loads(self.body)

    def events(self) -> list[bytes]:
        """The SSE data payloads, in order."""
        return [
            line.removeprefix(b"data: ")
            for line in self.body.split(b"\n\n")
            if line.startswith(b"data: ")
        ]

    async def abort(self, *, reset: bool = False) -> None:
        self.aborted = reset

    async def respond(self, status: int, headers: Headers, body: bytes) -> None:
        await self.start(status, headers)
        self.chunks.append(body)
        self.finished = True

    async def start(self, status: int, headers: Headers) -> None:
        assert not self._started
        self._started = True
        self.status = status
        self.headers = dict(headers)
        await trio.lowlevel.checkpoint()

    async def write(self, data: bytes) -> None:
        assert self._started and not self.finished
        if self._disconnect_after is not None and len(self.chunks) >= self._disconnect_after:
            raise ClientDisconnected("gone")
        self.chunks.append(data)
        self.write_times.append(trio.current_time())
        await trio.lowlevel.checkpoint()

    async def finish(self) -> None:
        self.finished = True


def make_request(
    method: str, target: str, body: object = None, headers: Sequence[tuple[bytes, bytes]] = ()
) -> Request:
    raw = b"" if body is None else body if isinstance(body, bytes) else orjson.dumps(body)
    return Request(method=method, target=target, headers=list(headers), body=raw)


async def call(
    worker: FakeWorker,
    method: str,
    target: str,
    body: object = None,
    headers: Sequence[tuple[bytes, bytes]] = (),
    writer: RecordingWriter | None = None,
) -> RecordingWriter:
    writer = writer or RecordingWriter()
    await worker.handler(make_request(method, target, body, headers), writer)
    return writer


CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "three word prompt"}]}


def chat(**fields: object) -> dict[str, object]:
    return {**CHAT, **fields}


def rank(r: int) -> list[tuple[bytes, bytes]]:
    return [(b"x-data-parallel-rank", str(r).encode())]


# -- health and startup -------------------------------------------------------------------


async def test_health_is_503_until_the_startup_delay_has_passed(autojump_clock: object) -> None:
    worker = FakeWorker(FakeWorkerSettings(startup_delay_s=5.0))
    start = worker.started_at
    assert (await call(worker, "GET", "/health")).status == 503
    await trio.sleep_until(start + 4.999)
    assert (await call(worker, "GET", "/health")).status == 503
    assert (await call(worker, "GET", "/health_generate")).status == 503
    await trio.sleep_until(start + 5.0)
    assert trio.current_time() - start == 5.0
    assert (await call(worker, "GET", "/health")).status == 200
    assert (await call(worker, "GET", "/health_generate")).status == 200
    assert worker.routing.paths == {"/health": 3, "/health_generate": 2}


async def test_health_follows_the_scripted_healthy_flag() -> None:
    worker = FakeWorker(FakeWorkerSettings())
    assert (await call(worker, "GET", "/health")).status == 200
    assert (await call(worker, "POST", "/debug/behaviour", {"healthy": False})).status == 200
    assert (await call(worker, "GET", "/health")).status == 503
    # Health is not generation: it neither consumes nor counts as a dispatch.
    assert worker.routing.dispatches == 0


# -- behaviour ------------------------------------------------------------------------------


async def test_behaviour_update_rejects_unknown_keys_and_changes_nothing() -> None:
    worker = FakeWorker(FakeWorkerSettings())
    before = worker.behaviour.to_json()
    reply = await call(worker, "POST", "/debug/behaviour", {"fail_first": 2, "fail_frist": 3})
    assert reply.status == 400
    message = reply.json()["error"]["message"]  # type: ignore[index]
    assert "fail_frist" in message
    assert worker.behaviour.to_json() == before


@pytest.mark.parametrize(
    "changes",
    [
        {"fail_first": 2, "fail_mode": "explode"},
        {"fail_first": "2"},
        {"fail_first": -2},
        {"fail_status": 200},
        {"fail_status": True},
        {"token_latency_ms": -1},
        {"ttft_ms": "fast"},
        {"tokens": 1.5},
        {"healthy": 1},
        [1, 2],
    ],
)
async def test_behaviour_update_validates_every_field_all_or_nothing(changes: object) -> None:
    worker = FakeWorker(FakeWorkerSettings())
    before = worker.behaviour.to_json()
    reply = await call(worker, "POST", "/debug/behaviour", changes)
    assert reply.status == 400
    assert worker.behaviour.to_json() == before


async def test_behaviour_update_applies_and_get_shows_it() -> None:
    worker = FakeWorker(FakeWorkerSettings())
    changes = {"fail_first": 3, "fail_mode": "status", "fail_status": 500, "token_latency_ms": 5}
    reply = await call(worker, "POST", "/debug/behaviour", changes)
    assert reply.status == 200
    shown = (await call(worker, "GET", "/debug/behaviour")).json()
    assert isinstance(shown, dict)
    assert {k: shown[k] for k in changes} == changes
    assert shown["fail_remaining"] == 3
    assert worker.behaviour.fail_mode is FailMode.STATUS
    assert (await call(worker, "POST", "/debug/behaviour", b"{nope")).status == 400


def test_fail_first_counts_down_and_minus_one_means_always() -> None:
    behaviour = Behaviour(fail_first=2)
    assert [behaviour.take_failure() for _ in range(4)] == [True, True, False, False]
    always = Behaviour(fail_first=-1)
    assert all(always.take_failure() for _ in range(50))
    always.update({"fail_first": 1})
    assert [always.take_failure() for _ in range(3)] == [True, False, False]
    with pytest.raises(InvalidBehaviour):
        Behaviour(fail_mode="nope")  # type: ignore[arg-type]


def test_settings_refuse_what_an_engine_could_not_be() -> None:
    for bad in (
        {"engine": "tgi"},
        {"role": "both"},
        {"pd_protocol": "tcp"},
        {"dp_size": 0},
        {"max_concurrency": -1},
        {"fail_status": 99},
        {"tokens": -1},
    ):
        with pytest.raises(ValueError):
            FakeWorkerSettings(**bad)


# -- generation -----------------------------------------------------------------------------


async def test_chat_unary_answers_exactly_the_generated_text_with_honest_usage() -> None:
    worker = FakeWorker(FakeWorkerSettings(tokens=16))
    reply = await call(worker, "POST", "/v1/chat/completions", chat(max_tokens=5))
    assert reply.status == 200
    body = reply.json()
    assert isinstance(body, dict)
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": expected_text(5)}
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    default = (await call(worker, "POST", "/v1/chat/completions", chat())).json()
    assert isinstance(default, dict)
    assert default["choices"][0]["message"]["content"] == expected_text(16)
    assert default["choices"][0]["finish_reason"] == "stop"
    assert worker.routing.loads[0].generation_tokens == 21
    assert worker.routing.loads[0].prompt_tokens == 6


async def test_chat_stream_is_openai_chunks_with_usage_and_done() -> None:
    worker = FakeWorker(FakeWorkerSettings())
    body = chat(max_tokens=3, stream=True, stream_options={"include_usage": True})
    reply = await call(worker, "POST", "/v1/chat/completions", body)
    assert reply.status == 200
    assert reply.headers[b"content-type"] == b"text/event-stream"
    assert reply.finished
    events = reply.events()
    assert events[-1] == b"[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == expected_text(3)
    assert [c["choices"][0]["finish_reason"] for c in chunks[1:4]] == [None, None, None]
    assert chunks[4]["choices"][0]["finish_reason"] == "length"
    assert chunks[5] == {
        "id": chunks[0]["id"],
        "object": "chat.completion.chunk",
        "created": chunks[0]["created"],
        "model": "fake-model",
        "choices": [],
        "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6},
    }
    assert len(chunks) == 6


async def test_completions_with_n_choices_count_every_token() -> None:
    worker = FakeWorker(FakeWorkerSettings())
    body = {"prompt": "one two", "max_tokens": 2, "n": 3}
    unary = (await call(worker, "POST", "/v1/completions", body)).json()
    assert isinstance(unary, dict)
    assert [c["text"] for c in unary["choices"]] == [expected_text(2)] * 3
    assert unary["usage"] == {"prompt_tokens": 2, "completion_tokens": 6, "total_tokens": 8}
    stream = await call(worker, "POST", "/v1/completions", {**body, "stream": True})
    chunks = [orjson.loads(e) for e in stream.events()[:-1]]
    per_choice = {0: "", 1: "", 2: ""}
    for chunk in chunks:
        for choice in chunk["choices"]:
            per_choice[choice["index"]] += choice["text"]
    assert per_choice == {i: expected_text(2) for i in range(3)}


async def test_generate_speaks_sglang_native_unary_and_cumulative_stream() -> None:
    worker = FakeWorker(FakeWorkerSettings())
    body = {"text": "a b c d", "sampling_params": {"max_new_tokens": 3}}
    unary = (await call(worker, "POST", "/generate", body)).json()
    assert isinstance(unary, dict)
    assert unary["text"] == expected_text(3)
    meta = unary["meta_info"]
    assert meta["prompt_tokens"] == 4 and meta["completion_tokens"] == 3
    assert meta["finish_reason"] == {"type": "length", "length": 3}
    stream = await call(worker, "POST", "/generate", {**body, "stream": True})
    events = stream.events()
    assert events[-1] == b"[DONE]"
    texts = [orjson.loads(e)["text"] for e in events[:-1]]
    assert texts == [expected_text(1), expected_text(2), expected_text(3)]
    ids = {"input_ids": [1, 2, 3, 4, 5], "sampling_params": {}}
    by_ids = (await call(worker, "POST", "/generate", ids)).json()
    assert isinstance(by_ids, dict)
    assert by_ids["meta_info"]["prompt_tokens"] == 5
    assert by_ids["meta_info"]["completion_tokens"] == 16


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", b"{not json"),
        ("/v1/chat/completions", {"messages": "hi"}),
        ("/v1/chat/completions", chat(max_tokens=-1)),
        ("/v1/chat/completions", chat(n=0)),
        ("/v1/chat/completions", chat(stream="yes")),
        ("/v1/completions", {"prompt": {"a": 1}}),
        ("/generate", {"sampling_params": {"max_new_tokens": 2}}),
    ],
)
async def test_malformed_generation_requests_get_400_and_still_count(
    path: str, body: object
) -> None:
    worker = FakeWorker(FakeWorkerSettings())
    reply = await call(worker, "POST", path, body)
    assert reply.status == 400
    assert "error" in reply.json()  # type: ignore[operator]
    assert worker.routing.dispatches == 1
    assert worker.routing.inflight == 0


async def test_unknown_path_is_404_and_wrong_method_is_405() -> None:
    worker = FakeWorker(FakeWorkerSettings())
    assert (await call(worker, "GET", "/nope")).status == 404
    wrong = await call(worker, "GET", "/v1/chat/completions")
    assert wrong.status == 405
    assert wrong.headers[b"allow"] == b"POST, PUT"
    assert worker.routing.dispatches == 0


async def test_each_engine_answers_the_routes_that_tell_engines_apart_as_it_does() -> None:
    sglang = FakeWorker(FakeWorkerSettings(engine="sglang"))
    for path in ("/get_server_info", "/server_info"):
        info = await call(sglang, "GET", path)
        assert info.status == 200 and is_sglang_server_info(info.json())
    assert (await call(sglang, "GET", "/kv_event_sources")).status == 404  # vLLM's only

    vllm = FakeWorker(FakeWorkerSettings(engine="vllm"))
    for path in ("/get_server_info", "/server_info"):
        assert (await call(vllm, "GET", path)).status == 404  # vLLM serves neither
    version = await call(vllm, "GET", "/version")
    assert version.status == 200 and is_vllm_version(version.json())
    # vLLM 0.32 with KV events off: the route answers, with no publisher
    sources = await call(vllm, "GET", "/kv_event_sources")
    assert sources.status == 200 and sources.json() == {}
    models = (await call(vllm, "GET", "/v1/models")).json()
    assert isinstance(models, dict)
    assert [(m["id"], m["max_model_len"], m["owned_by"]) for m in models["data"]] == [
        ("fake-model", vllm.settings.max_model_len, "vllm")
    ]


async def test_stream_pace_follows_ttft_and_token_latency(autojump_clock: object) -> None:
    worker = FakeWorker(FakeWorkerSettings(ttft_ms=100, token_latency_ms=10))
    start = trio.current_time()
    reply = await call(
        worker, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 4, "stream": True}
    )
    times = [round(t - start, 9) for t in reply.write_times]
    # First write: token 0; one write per later token; the tail rides with the last one.
    assert times == [0.1, 0.11, 0.12, 0.13]
    assert trio.current_time() - start == pytest.approx(0.13, abs=1e-9)
    unary_start = trio.current_time()
    await call(worker, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 4})
    assert trio.current_time() - unary_start == pytest.approx(0.13, abs=1e-9)


# -- scripted failures ---------------------------------------------------------------------


async def test_status_failures_answer_the_code_with_retry_after_then_recover() -> None:
    worker = FakeWorker(FakeWorkerSettings(fail_first=2, fail_status=503))
    first = await call(worker, "POST", "/v1/chat/completions", chat())
    assert first.status == 503
    assert first.headers[b"retry-after"] == b"1"
    assert first.json()["error"]["type"] == "server_error"  # type: ignore[index]
    assert (await call(worker, "POST", "/v1/chat/completions", chat())).status == 503
    assert (await call(worker, "POST", "/v1/chat/completions", chat())).status == 200
    assert worker.routing.dispatches == 3
    assert worker.routing.failures == 2
    worker.behaviour.update({"fail_first": 1, "fail_status": 500})
    no_retry_after = await call(worker, "POST", "/generate", {"text": "x"})
    assert no_retry_after.status == 500
    assert b"retry-after" not in no_retry_after.headers


async def test_garbage_is_a_200_that_is_not_json() -> None:
    worker = FakeWorker(FakeWorkerSettings(fail_first=2, fail_mode=FailMode.GARBAGE))
    unary = await call(worker, "POST", "/v1/chat/completions", chat())
    assert unary.status == 200
    with pytest.raises(orjson.JSONDecodeError):
        unary.json()
    stream = await call(worker, "POST", "/v1/chat/completions", chat(stream=True))
    assert stream.status == 200
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(stream.events()[0])


async def test_midstream_writes_exactly_k_events_then_drops_the_connection() -> None:
    worker = FakeWorker(
        FakeWorkerSettings(fail_first=1, fail_mode=FailMode.MIDSTREAM, fail_after_chunks=3)
    )
    request = make_request("POST", "/v1/chat/completions", chat(stream=True))
    writer = RecordingWriter()
    await worker.handler(request, writer)
    assert writer.status == 200
    assert len(writer.events()) == 3
    assert b"[DONE]" not in writer.body
    assert not writer.finished
    assert writer.aborted is False  # the connection is dropped (a close, not a reset)
    assert worker.routing.failures == 1
    assert worker.routing.disconnects == 0


async def test_hang_never_answers_and_a_leaving_client_is_counted() -> None:
    worker = FakeWorker(FakeWorkerSettings(fail_first=-1, fail_mode=FailMode.HANG))
    request = make_request("POST", "/v1/chat/completions", chat())
    writer = RecordingWriter()
    with trio.move_on_after(1) as scope:
        await worker.handler(request, writer)
    assert scope.cancelled_caught
    assert not writer.started
    assert worker.routing.inflight == 0
    assert worker.routing.disconnects == 0  # a timeout is not a client leaving

    async def leave_after(delay: float, cancel: trio.CancelScope) -> None:
        await trio.sleep(delay)
        request.client_gone = True  # what the server does when the socket closes
        cancel.cancel()

    async with trio.open_nursery() as nursery:
        with trio.CancelScope() as handler_scope:
            nursery.start_soon(leave_after, 0.5, handler_scope)
            await worker.handler(request, writer)
    assert worker.routing.disconnects == 1
    assert worker.routing.inflight == 0


async def test_a_failed_send_stops_the_stream_and_counts_a_disconnect(
    autojump_clock: object,
) -> None:
    worker = FakeWorker(FakeWorkerSettings(token_latency_ms=10, tokens=100))
    writer = RecordingWriter(disconnect_after_writes=3)
    await call(worker, "POST", "/v1/chat/completions", chat(stream=True), writer=writer)
    assert len(writer.chunks) == 3
    assert worker.routing.disconnects == 1
    assert worker.routing.inflight == 0
    assert worker.routing.loads[0].running == 0
    # Generation stopped at once: tokens 0..2 went out, token 3 was made but never sent.
    assert worker.routing.loads[0].generation_tokens == 4


# -- routing counters and metrics ----------------------------------------------------------


async def test_routing_counts_paths_ranks_and_pd_handoffs_and_reset_zeroes_them() -> None:
    worker = FakeWorker(FakeWorkerSettings(dp_size=2, role="decode"))
    handoff = {"bootstrap_host": "10.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 7}
    await call(worker, "POST", "/v1/chat/completions", chat(), rank(0))
    await call(worker, "POST", "/v1/chat/completions", chat(**handoff), rank(1))
    decode = {**handoff, "disagg_prefill_dp_rank": 1, "text": "x"}
    await call(worker, "POST", "/generate", decode, rank(1))
    bad = await call(worker, "POST", "/generate", decode, rank(2))
    assert bad.status == 400  # rank 2 does not exist on a dp_size=2 worker
    await call(worker, "GET", "/v1/models")
    await call(worker, "GET", "/debug/routing")
    routing = (await call(worker, "GET", "/debug/routing")).json()
    assert isinstance(routing, dict)
    assert routing["dispatches"] == 4
    assert routing["failures"] == 0
    assert routing["ranks"] == {"0": 1, "1": 2, "2": 1}
    assert routing["paths"] == {"/v1/chat/completions": 2, "/generate": 2, "/v1/models": 1}
    assert routing["inflight"] == 0
    assert routing["handoffs"][0] == {
        **handoff,
        "disagg_prefill_dp_rank": None,
        "path": "/v1/chat/completions",
        "dp_rank_header": "1",
    }
    assert routing["handoffs"][1]["disagg_prefill_dp_rank"] == 1
    assert len(routing["handoffs"]) == 3
    assert (await call(worker, "POST", "/debug/reset")).status == 200
    cleared = (await call(worker, "GET", "/debug/routing")).json()
    assert isinstance(cleared, dict)
    assert (cleared["dispatches"], cleared["paths"], cleared["ranks"], cleared["handoffs"]) == (
        0,
        {},
        {},
        [],
    )


def _samples(text: str) -> dict[str, dict[str, float]]:
    """metric sample name -> {rank label value: value}."""
    found: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            label = sample.labels.get("dp_rank", sample.labels.get("engine", ""))
            found.setdefault(sample.name, {})[label] = sample.value
    return found


async def test_metrics_report_real_running_and_queued_per_rank(autojump_clock: object) -> None:
    settings = FakeWorkerSettings(dp_size=2, max_concurrency=1, ttft_ms=1000, tokens=2)
    worker = FakeWorker(settings)
    async with trio.open_nursery() as nursery:
        for r in (0, 1, 1):
            nursery.start_soon(
                call, worker, "POST", "/v1/chat/completions", chat(stream=True), rank(r)
            )
        await trio.sleep(0.5)  # all three arrived; one is in its first-token wait
        during = _samples((await call(worker, "GET", "/metrics")).body.decode())
        running = during["sglang:num_running_reqs"]
        queued = during["sglang:num_queue_reqs"]
        assert sum(running.values()) == 1
        assert sum(queued.values()) == 2
        per_rank = {r: running[r] + queued[r] for r in ("0", "1")}
        assert per_rank == {"0": 1, "1": 2}
        assert sum(during["sglang:token_usage"].values()) == 1.0  # 1 running of capacity 1
        loads = (await call(worker, "GET", "/v1/loads")).json()
        assert isinstance(loads, dict)
        assert [(s["num_running_reqs"], s["num_waiting_reqs"]) for s in loads["loads"]] == [
            (int(running["0"]), int(queued["0"])),
            (int(running["1"]), int(queued["1"])),
        ]
    # One after another through the single slot: 3 x 1 s to the first token.
    assert trio.current_time() == pytest.approx(3.0)
    after = _samples((await call(worker, "GET", "/metrics")).body.decode())
    assert sum(after["sglang:num_running_reqs"].values()) == 0
    assert sum(after["sglang:num_queue_reqs"].values()) == 0
    assert after["sglang:generation_tokens_total"] == {"0": 2.0, "1": 4.0}
    assert after["sglang:prompt_tokens_total"] == {"0": 3.0, "1": 6.0}


async def test_metrics_names_follow_engine_and_role() -> None:
    prefill = FakeWorker(FakeWorkerSettings(role="prefill"))
    names = set(_samples((await call(prefill, "GET", "/metrics")).body.decode()))
    assert {
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:token_usage",
        "sglang:num_prefill_bootstrap_queue_reqs",
        "sglang:num_prefill_inflight_queue_reqs",
    } <= names
    assert "sglang:num_decode_prealloc_queue_reqs" not in names
    decode = FakeWorker(FakeWorkerSettings(role="decode"))
    decode_samples = _samples((await call(decode, "GET", "/metrics")).body.decode())
    assert decode_samples["sglang:num_decode_transfer_queue_reqs"] == {"": 0.0}
    assert decode_samples["sglang:num_decode_prealloc_queue_reqs"] == {"": 0.0}
    vllm = FakeWorker(FakeWorkerSettings(engine="vllm", dp_size=2))
    await call(vllm, "POST", "/v1/completions", {"prompt": "a b"}, rank(1))
    vllm_samples = _samples((await call(vllm, "GET", "/metrics")).body.decode())
    assert vllm_samples["vllm:num_requests_running"] == {"0": 0.0, "1": 0.0}
    assert vllm_samples["vllm:num_requests_waiting"] == {"0": 0.0, "1": 0.0}
    assert vllm_samples["vllm:kv_cache_usage_perc"] == {"0": 0.0, "1": 0.0}
    assert vllm_samples["vllm:generation_tokens_total"] == {"0": 0.0, "1": 16.0}
    assert not any(name.startswith("sglang:") for name in vllm_samples)


async def test_a_queued_request_that_is_cancelled_leaves_no_trace(autojump_clock: object) -> None:
    worker = FakeWorker(FakeWorkerSettings(max_concurrency=1, ttft_ms=1000))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(call, worker, "POST", "/v1/chat/completions", chat())
        await trio.sleep(0.1)  # the first request holds the only slot
        with trio.move_on_after(0.5):
            await call(worker, "POST", "/v1/chat/completions", chat())
        assert worker.routing.loads[0].queued == 0
        assert worker.routing.loads[0].running == 1
    assert worker.routing.loads[0].running == 0
    assert worker.routing.inflight == 0


# -- engine info ------------------------------------------------------------------------------


async def test_engine_info_endpoints_describe_the_worker() -> None:
    settings = FakeWorkerSettings(
        model="m1",
        dp_size=4,
        role="prefill",
        pd_protocol="nixl",
        bootstrap_port=9100,
        max_concurrency=8,
    )
    worker = FakeWorker(settings)
    models = (await call(worker, "GET", "/v1/models")).json()
    assert isinstance(models, dict)
    assert [(m["id"], m["owned_by"]) for m in models["data"]] == [("m1", "sglang")]
    for path in ("/get_server_info", "/server_info"):
        server = (await call(worker, "GET", path)).json()
        assert isinstance(server, dict)
        assert server["dp_size"] == 4
        assert server["served_model_name"] == "m1"
        assert server["disaggregation_mode"] == "prefill"
        assert server["disaggregation_transfer_backend"] == "nixl"
        assert server["disaggregation_bootstrap_port"] == 9100
        assert server["max_running_requests"] == 8
    for path in ("/get_model_info", "/model_info"):
        model = (await call(worker, "GET", path)).json()
        assert isinstance(model, dict)
        assert model["model_path"] == "m1" and model["is_generation"] is True
    loads = (await call(worker, "GET", "/v1/loads")).json()
    assert isinstance(loads, dict)
    assert loads["dp_rank_count"] == 4
    assert [s["dp_rank"] for s in loads["loads"]] == [0, 1, 2, 3]
    assert (await call(worker, "GET", "/version")).status == 200
    legacy = (await call(worker, "GET", "/get_load")).json()
    assert isinstance(legacy, list) and len(legacy) == 4


# -- vLLM's rules and shapes (tests/engine/test_fake_fidelity.py holds them to vLLM) -------


async def test_a_stream_of_n_choices_sends_one_choice_per_event() -> None:
    for engine in ("sglang", "vllm"):
        worker = FakeWorker(FakeWorkerSettings(engine=engine))
        reply = await call(
            worker, "POST", "/v1/chat/completions", chat(max_tokens=2, n=2, stream=True)
        )
        chunks = [orjson.loads(e) for e in reply.events()[:-1]]
        assert all(len(c["choices"]) == 1 for c in chunks)
        choices = [c["choices"][0] for c in chunks]
        kinds = [
            (c["index"], "role" if "role" in c["delta"] else c["finish_reason"] or "token")
            for c in choices
        ]
        tokens = [(0, "token"), (1, "token")] * 2
        assert kinds == [(0, "role"), (1, "role"), *tokens, (0, "length"), (1, "length")]


async def test_vllm_answers_404_for_a_model_it_does_not_serve_and_sglang_serves_it() -> None:
    vllm = FakeWorker(FakeWorkerSettings(engine="vllm"))
    reply = await call(vllm, "POST", "/v1/chat/completions", chat(model="other"))
    assert reply.status == 404
    assert reply.json() == {
        "error": {
            "message": "The model `other` does not exist. Valid aliases: fake-model.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }
    assert (await call(vllm, "POST", "/v1/completions", {"prompt": "a"})).status == 200
    sglang = FakeWorker(FakeWorkerSettings(engine="sglang"))
    assert (await call(sglang, "POST", "/v1/chat/completions", chat(model="other"))).status == 200


@pytest.mark.parametrize(
    ("limit", "message"),
    [
        (0, "max_tokens must be at least 1, got 0."),
        (-1, "max_tokens must be at least 1, got -1."),
        (9, "max_tokens=9 cannot be greater than max_model_len=8."),
    ],
)
async def test_vllm_refuses_max_tokens_outside_one_to_max_model_len(
    limit: int, message: str
) -> None:
    vllm = FakeWorker(FakeWorkerSettings(engine="vllm", max_model_len=8))
    reply = await call(vllm, "POST", "/v1/completions", {"prompt": "a", "max_tokens": limit})
    assert reply.status == 400
    error = reply.json()["error"]  # type: ignore[call-overload, index]
    assert error["message"].startswith(message)
    assert (error["type"], error["param"], error["code"]) == ("BadRequestError", "max_tokens", 400)
    ok = await call(vllm, "POST", "/v1/completions", {"prompt": "a", "max_tokens": 8})
    assert ok.status == 200
    sglang = FakeWorker(FakeWorkerSettings(engine="sglang"))
    assert (
        await call(sglang, "POST", "/v1/completions", {"prompt": "a", "max_tokens": 0})
    ).status == 200


async def test_vllm_schema_errors_are_bad_request_naming_the_body_field() -> None:
    vllm = FakeWorker(FakeWorkerSettings(engine="vllm"))
    not_json = (await call(vllm, "POST", "/v1/chat/completions", b"{not json")).json()
    assert not_json["error"]["type"] == "Bad Request"  # type: ignore[call-overload, index]
    assert not_json["error"]["param"] == "body.1"  # type: ignore[call-overload, index]
    bad = (await call(vllm, "POST", "/v1/chat/completions", {"messages": "hi"})).json()
    assert bad["error"]["param"] == "body.messages"  # type: ignore[call-overload, index]
    sglang = FakeWorker(FakeWorkerSettings(engine="sglang"))
    old = (await call(sglang, "POST", "/v1/chat/completions", b"{not json")).json()
    assert old["error"]["type"] == "invalid_request_error"  # type: ignore[call-overload, index]


async def test_vllm_info_routes_and_metrics_have_vllms_keys_and_labels() -> None:
    vllm = FakeWorker(FakeWorkerSettings(engine="vllm", max_model_len=512))
    health = await call(vllm, "GET", "/health")
    assert (health.status, health.headers, health.body) == (200, {}, b"")
    (model,) = (await call(vllm, "GET", "/v1/models")).json()["data"]  # type: ignore[call-overload, index]
    assert model["parent"] is None and model["max_model_len"] == 512
    assert [p["object"] for p in model["permission"]] == ["model_permission"]
    tokens = (await call(vllm, "POST", "/tokenize", {"prompt": "a b"})).json()
    assert tokens["max_model_len"] == 512 and tokens["token_strs"] is None  # type: ignore[call-overload, index]
    metrics = (await call(vllm, "GET", "/metrics")).body.decode()
    assert 'vllm:num_requests_running{engine="0",model_name="fake-model"} 0.0' in metrics
    unary = (await call(vllm, "POST", "/v1/chat/completions", chat())).json()
    assert unary["system_fingerprint"] and unary["choices"][0]["stop_reason"] is None  # type: ignore[call-overload, index]
