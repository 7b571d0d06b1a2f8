"""The fake's LoRA adapters, as vLLM serves them: listed with their parent, a 404 for an
adapter it lacks, `--max-loras` slots that make other adapters wait, the slots on
`/metrics` as `vllm:lora_requests_info`, adapters loaded and unloaded at run time, and
an adapter's cached blocks published under its name."""

from __future__ import annotations

import pytest
import trio

from router.engines.lora_activity import adapter_activity
from router.engines.models import parse_model_list
from router.fake_worker.engine import FakeWorker
from router.fake_worker.prefix_cache import PrefixCache, ids_prompt
from router.fake_worker.settings import FakeWorkerSettings
from router.fleet.adapters import AdapterActivity
from tests.fake_worker.test_engine import call


def lora_worker(**fields: object) -> FakeWorker:
    settings = FakeWorkerSettings(
        model="base",
        engine="vllm",
        lora_adapters=("a", "b"),
        **fields,  # type: ignore[arg-type]
    )
    return FakeWorker(settings)


def completion(model: str) -> dict[str, object]:
    return {"model": model, "prompt": "hi", "max_tokens": 1}


async def test_adapters_are_listed_with_their_parent_and_served_by_name() -> None:
    worker = lora_worker()
    listing = parse_model_list((await call(worker, "GET", "/v1/models")).json())
    served = await call(worker, "POST", "/v1/completions", completion("a"))
    lacking = await call(worker, "POST", "/v1/completions", completion("c"))
    assert listing.models == ("base",) and listing.adapters == {"a": "base", "b": "base"}
    assert served.status == 200
    assert lacking.status == 404
    assert lacking.json()["error"] == {
        "message": "The model `c` does not exist. Valid aliases: base.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }


async def test_another_adapter_waits_for_the_one_slot_and_the_gauge_says_so() -> None:
    worker = lora_worker(ttft_ms=50)
    worker.hold_answers()
    async with trio.open_nursery() as nursery:
        for model in ("a", "a", "b", "base"):  # in this order (trio may run tasks in any)
            nursery.start_soon(call, worker, "POST", "/v1/completions", completion(model))
            await trio.testing.wait_all_tasks_blocked()
        page = (await call(worker, "GET", "/metrics")).body.decode()
        loads = worker.routing.loads[0]
        assert (loads.running, loads.queued) == (3, 1)  # two of a and the base model run
        # As vLLM 0.32 says it: b, not scheduled yet, is in neither set.
        assert adapter_activity(page) == AdapterActivity(1, frozenset({"a"}), frozenset({"a"}))
        worker.release_answers()
    page = (await call(worker, "GET", "/metrics")).body.decode()
    assert adapter_activity(page) == AdapterActivity(1, frozenset(), frozenset())
    # The state shown at the first reading stays a series of its own, as vLLM's do.
    assert page.count("vllm:lora_requests_info{") == 2


async def test_a_request_waiting_for_a_slot_leaves_nothing_behind_when_cancelled() -> None:
    worker = lora_worker()
    worker.hold_answers()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(call, worker, "POST", "/v1/completions", completion("a"))
        await trio.testing.wait_all_tasks_blocked()
        with trio.move_on_after(0.01):
            await call(worker, "POST", "/v1/completions", completion("b"))
        assert worker.adapter_slots is not None and worker.adapter_slots.waiting == {}
        worker.release_answers()
    assert worker.adapter_slots.running == {}
    assert worker.routing.loads[0].queued == 0


async def test_adapters_load_and_unload_at_run_time_when_the_engine_allows_it() -> None:
    worker = lora_worker(runtime_lora_updating=True)
    loaded = await call(
        worker, "POST", "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": "/adapters/c"}
    )
    again = await call(
        worker, "POST", "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": "/adapters/c"}
    )
    served = await call(worker, "POST", "/v1/completions", completion("c"))
    listing = (await call(worker, "GET", "/v1/models")).json()["data"]
    unloaded = await call(worker, "POST", "/v1/unload_lora_adapter", {"lora_name": "a"})
    missing = await call(worker, "POST", "/v1/unload_lora_adapter", {"lora_name": "a"})
    gone = await call(worker, "POST", "/v1/completions", completion("a"))
    assert loaded.status == 200 and b"added successfully" in loaded.body
    assert again.status == 400 and served.status == 200
    assert {entry["id"]: entry["root"] for entry in listing}["c"] == "/adapters/c"
    assert (unloaded.status, missing.status, gone.status) == (200, 404, 404)
    assert worker.behaviour.lora_adapters == ("b", "c")
    fixed = lora_worker()
    assert (await call(fixed, "POST", "/v1/load_lora_adapter", {"lora_name": "c"})).status == 404


def test_adapters_need_the_vllm_engine_and_a_slot() -> None:
    with pytest.raises(ValueError, match="engine vllm"):
        FakeWorkerSettings(engine="sglang", lora_adapters=("a",))
    with pytest.raises(ValueError, match="max_loras"):
        FakeWorkerSettings(engine="vllm", lora_adapters=("a",), max_loras=0)


def test_an_adapters_blocks_are_its_own_and_stored_under_its_name() -> None:
    stored: list[tuple[int | None, str | None]] = []

    class Listener:
        def stored(self, parent, keys, blocks, lora_name=None):  # type: ignore[no-untyped-def]
            stored.append((parent, lora_name))

        def removed(self, keys):  # type: ignore[no-untyped-def]
            pass

        def cleared(self) -> None:
            pass

    cache = PrefixCache(1024)
    cache.listener = Listener()
    prompt = ids_prompt(list(range(40)))
    assert cache.serve(prompt) == 0
    assert cache.serve(prompt, "a") == 0  # the base model's blocks are not the adapter's
    assert cache.serve(prompt, "a") == 32
    assert stored == [(None, None), (None, "a")]
