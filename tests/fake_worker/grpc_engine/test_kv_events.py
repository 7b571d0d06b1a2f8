"""The fake gRPC engine's prefix cache and its KV events over `SubscribeKvEvents`, as a
router's subscriber meets them: stores, hits, evictions, flushes, the numbering, and
the ways a stream ends."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated.vllm_engine_pb2_grpc import VllmEngineStub

from router.fake_worker.grpc_engine import kv_events
from router.fake_worker.grpc_engine.kv_events import fold_hash
from router.fake_worker.grpc_engine.service import KV_EVENTS_OFF, REPLAY_REFUSED
from router.fake_worker.grpc_engine.tokenizer_files import output_token_id
from router.fake_worker.settings import FakeWorkerSettings
from tests.support.grpc_engine import Served, run_scenario, serving

READ_TIMEOUT_S = 5.0
# A prompt of 40 ids: two full blocks of 16 and 8 ids no block holds.
PROMPT = list(range(10, 50))


def _settings(cache_tokens: int = 1024) -> FakeWorkerSettings:
    return FakeWorkerSettings(model="m", tokens=2, cache_tokens=cache_tokens, kv_events=True)


async def _generate(
    served: Served, ids: list[int], *, stream: bool = False
) -> list[pb.GenerateResponse]:
    request = pb.GenerateRequest(
        request_id="r", tokenized=pb.TokenizedInput(input_ids=ids), stream=stream
    )
    return [reply async for reply in served.stub.Generate(request)]


async def _subscribe(served: Served, channel: grpc.aio.Channel | None = None) -> Any:
    """A SubscribeKvEvents call (on `channel`, else the test's own), returned once the
    fake has taken the subscription: its headers come after."""
    stub = served.stub if channel is None else VllmEngineStub(channel)
    call = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest())
    async with asyncio.timeout(READ_TIMEOUT_S):
        await call.initial_metadata()
    return call


async def _read(call: Any, count: int) -> list[common_pb2.KvEventBatch]:
    """The call's next `count` batches."""
    batches = []
    async with asyncio.timeout(READ_TIMEOUT_S):
        for _ in range(count):
            batch = await call.read()
            assert batch is not grpc.aio.EOF
            batches.append(batch)
    return batches


async def _ending(call: Any) -> tuple[int, grpc.StatusCode, str]:
    """Read the call to its end: the batches it still got, its code and details."""
    got = 0
    async with asyncio.timeout(READ_TIMEOUT_S):
        try:
            while await call.read() is not grpc.aio.EOF:
                got += 1
        except grpc.aio.AioRpcError as exc:
            return got, exc.code(), exc.details() or ""
    return got, grpc.StatusCode.OK, ""


def _blocks(batch: common_pb2.KvEventBatch) -> list[common_pb2.KvBlock]:
    (event,) = batch.events
    assert event.WhichOneof("data") == "stored"
    return list(event.stored.blocks)


def test_stores_hits_chaining_and_a_flush_stream_in_order(tmp_path: Path) -> None:
    async def scenario() -> tuple[list[common_pb2.KvEventBatch], list[int], dict[str, object]]:
        async with serving(tmp_path, _settings()) as served:
            call = await _subscribe(served)
            first = await _generate(served, PROMPT)
            again = await _generate(served, PROMPT, stream=True)
            # Its first two blocks are the first prompt's: served from cache, the rest stored.
            longer = await _generate(served, PROMPT[:32] + list(range(100, 132)))
            flushed = await served.stub.FlushCache(common_pb2.FlushCacheRequest())
            assert flushed.success
            batches = await _read(call, 3)
            call.cancel()
            cached = [
                first[-1].complete.cached_tokens,
                *(reply.chunk.cached_tokens for reply in again[:-1]),
                again[-1].complete.cached_tokens,
                longer[-1].complete.cached_tokens,
            ]
            return batches, cached, served.engine.routing_json()

    batches, cached, routing = run_scenario(scenario)
    # Served from cache: the leading full blocks; the first prompt found none.
    assert cached == [0, 32, 32, 32, 32]
    assert routing["cached_tokens"] == 64
    # Three batches, numbered from the engine's first: the repeated prompt stored nothing.
    assert [b.sequence_number for b in batches] == [0, 1, 2]
    assert [e.event_id for b in batches for e in b.events] == [1, 2, 3]
    assert all(b.HasField("dp_rank") and b.dp_rank == 0 and b.timestamp > 0 for b in batches)
    stored, extended, cleared = batches
    blocks = _blocks(stored)
    assert [list(block.token_ids) for block in blocks] == [PROMPT[:16], PROMPT[16:32]]
    assert [block.block_size for block in blocks] == [16, 16]
    assert len({block.block_hash for block in blocks}) == 2
    run = stored.events[0].stored
    assert not run.HasField("parent_block_hash")  # the prompt's start
    assert (run.tier, run.locality, run.medium) == (
        common_pb2.KV_CACHE_TIER_DEVICE,
        common_pb2.KV_CACHE_LOCALITY_LOCAL,
        "GPU",
    )
    tail = extended.events[0].stored
    assert tail.parent_block_hash == blocks[-1].block_hash
    assert [list(block.token_ids) for block in tail.blocks] == [
        list(range(100, 116)),
        list(range(116, 132)),
    ]
    assert cleared.events[0].WhichOneof("data") == "cleared"


def test_an_eviction_removes_the_hashes_its_blocks_were_stored_with(tmp_path: Path) -> None:
    async def scenario() -> list[common_pb2.KvEventBatch]:
        async with serving(tmp_path, _settings(cache_tokens=32)) as served:
            call = await _subscribe(served)
            await _generate(served, PROMPT[:32])
            await _generate(served, list(range(200, 232)))  # two new blocks: the old go
            batches = await _read(call, 3)
            call.cancel()
            return batches

    stored, replacing, removed = run_scenario(scenario)
    assert [b.sequence_number for b in (stored, replacing, removed)] == [0, 1, 2]
    assert [list(block.token_ids) for block in _blocks(replacing)] == [
        list(range(200, 216)),
        list(range(216, 232)),
    ]
    (event,) = removed.events
    assert event.WhichOneof("data") == "removed"
    assert sorted(event.removed.block_hashes) == sorted(b.block_hash for b in _blocks(stored))
    assert (event.removed.tier, event.removed.medium) == (common_pb2.KV_CACHE_TIER_DEVICE, "GPU")


def test_a_text_prompt_is_cached_as_its_words_ids(tmp_path: Path) -> None:
    async def scenario() -> tuple[common_pb2.KvEventBatch, int]:
        text = " ".join(f"tok{k}" for k in range(20))
        request = pb.GenerateRequest(request_id="t", text=text)
        async with serving(tmp_path, _settings()) as served:
            call = await _subscribe(served)
            [_ async for _ in served.stub.Generate(request)]
            (again,) = [reply async for reply in served.stub.Generate(request)]
            (batch,) = await _read(call, 1)
            call.cancel()
            return batch, again.complete.cached_tokens

    batch, cached = run_scenario(scenario)
    assert [list(block.token_ids) for block in _blocks(batch)] == [
        [output_token_id(k) for k in range(16)]
    ]
    assert cached == 16


def test_a_later_subscriber_gets_only_later_batches_under_engine_wide_numbers(
    tmp_path: Path,
) -> None:
    async def scenario() -> tuple[list[common_pb2.KvEventBatch], list[common_pb2.KvEventBatch]]:
        async with serving(tmp_path, _settings()) as served:
            await _generate(served, [1] * 16)  # batch 0: nobody listens, it still counts
            early = await _subscribe(served)
            await _generate(served, [2] * 16)
            late = await _subscribe(served)
            await _generate(served, [3] * 16)
            seen = await _read(early, 2), await _read(late, 1)
            early.cancel()
            late.cancel()
            return seen

    early, late = run_scenario(scenario)
    assert [b.sequence_number for b in early] == [1, 2]
    assert [b.sequence_number for b in late] == [2]
    assert [list(_blocks(b)[0].token_ids) for b in late] == [[3] * 16]
    assert late[0].events[0].event_id == 1  # event ids count each call's own events
    assert early[1].events[0].event_id == 2


async def _refused(
    tmp_path: Path, settings: FakeWorkerSettings, request: common_pb2.SubscribeKvEventsRequest
) -> tuple[grpc.aio.AioRpcError, Any]:
    """A subscription the fake refuses: its error, and its `kv_events` figures after."""
    async with serving(tmp_path, settings) as served:
        try:
            async for _ in served.stub.SubscribeKvEvents(request):
                pass
        except grpc.aio.AioRpcError as exc:
            return exc, served.engine.routing_json()["kv_events"]
        raise AssertionError("the subscription was served")


def test_a_nonzero_start_is_out_of_range(tmp_path: Path) -> None:
    request = common_pb2.SubscribeKvEventsRequest(start_sequence_number=5)
    error, counts = run_scenario(lambda: _refused(tmp_path, _settings(), request))
    assert error.code() is grpc.StatusCode.OUT_OF_RANGE
    assert error.details() == REPLAY_REFUSED
    assert counts["subscriptions_opened"] == 0


@pytest.mark.parametrize("cache_tokens", [0, 1024])
def test_without_kv_events_the_subscription_is_unimplemented(
    tmp_path: Path, cache_tokens: int
) -> None:
    settings = FakeWorkerSettings(model="m", cache_tokens=cache_tokens)
    request = common_pb2.SubscribeKvEventsRequest()
    error, counts = run_scenario(lambda: _refused(tmp_path, settings, request))
    assert error.code() is grpc.StatusCode.UNIMPLEMENTED
    assert error.details() == KV_EVENTS_OFF
    assert counts is None


def test_without_a_cache_nothing_is_cached_and_a_flush_has_nothing_to_do(tmp_path: Path) -> None:
    async def scenario() -> tuple[int, common_pb2.FlushCacheResponse]:
        async with serving(tmp_path, FakeWorkerSettings(model="m", tokens=1)) as served:
            await _generate(served, PROMPT)
            (reply,) = await _generate(served, PROMPT)
            flushed = await served.stub.FlushCache(common_pb2.FlushCacheRequest())
            return reply.complete.cached_tokens, flushed

    cached, flushed = run_scenario(scenario)
    assert cached == 0
    assert (flushed.success, flushed.message) == (True, "nothing cached")


def test_a_cancelled_subscription_leaves_nothing_behind(tmp_path: Path) -> None:
    async def scenario() -> tuple[dict[str, int], dict[str, int]]:
        async with serving(tmp_path, _settings()) as served:
            engine = served.engine
            hub = engine.kv_events
            assert hub is not None
            call = await _subscribe(served)
            live = engine.routing_json()["kv_events"]
            call.cancel()
            async with asyncio.timeout(READ_TIMEOUT_S):
                await engine.wait_until(lambda: hub.statistics().live == 0)
            await _generate(served, PROMPT)  # published to nobody
            return live, engine.routing_json()["kv_events"]

    live, after = run_scenario(scenario)
    assert live["subscriptions_live"] == 1
    assert after == {
        "next_sequence": 1,
        "published": 1,
        "subscriptions_opened": 1,
        "subscriptions_live": 0,
        "subscriptions_data_loss": 0,
    }


def test_a_subscriber_that_falls_behind_ends_with_data_loss_and_the_other_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bound = 4
    monkeypatch.setattr(kv_events, "SUBSCRIBER_QUEUE", bound)
    # A client that reads nothing and opens a 1 KiB flow-control window: the fake's
    # first write of a 3 KiB batch to it waits, so its queue fills.
    stingy = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]

    async def scenario() -> tuple[int, list[int], dict[str, int], tuple[int, object, str]]:
        async with (
            serving(tmp_path, _settings(cache_tokens=100_000)) as served,
            grpc.aio.insecure_channel(f"127.0.0.1:{served.port}", options=stingy) as slow_channel,
        ):
            hub = served.engine.kv_events
            assert hub is not None
            slow = await _subscribe(served, slow_channel)
            fast = await _subscribe(served)
            seen: list[int] = []
            read = asyncio.Condition()

            async def keep_reading() -> None:
                while (batch := await fast.read()) is not grpc.aio.EOF:
                    async with read:
                        seen.append(batch.sequence_number)
                        read.notify_all()

            reader = asyncio.ensure_future(keep_reading())
            prompts = 0
            while hub.statistics().data_loss == 0:
                assert prompts < 50, "the slow subscriber never fell behind"
                await _generate(served, [prompts % 900] + [7] * 1023)  # 64 new blocks each
                prompts += 1
            async with asyncio.timeout(READ_TIMEOUT_S), read:
                await read.wait_for(lambda: len(seen) >= prompts)
            counts = served.engine.routing_json()["kv_events"]
            ending = await _ending(slow)
            fast.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            return prompts, seen, counts, ending

    prompts, seen, counts, (got, code, details) = run_scenario(scenario)
    assert prompts >= bound + 1
    assert seen == list(range(prompts))  # the reading subscriber lost nothing
    assert (counts["subscriptions_live"], counts["subscriptions_data_loss"]) == (1, 1)
    assert code is grpc.StatusCode.DATA_LOSS and details == "subscriber fell behind"
    assert got < prompts - bound  # what it had queued went with it


def test_the_block_hash_fold_is_the_low_64_bits_signed() -> None:
    assert fold_hash(5) == 5
    assert fold_hash(-5) == -5
    assert fold_hash(2**63) == -(2**63)
    assert fold_hash(2**64 + 7) == 7
