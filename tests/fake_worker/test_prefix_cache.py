"""The fake worker's prefix cache: tokenisation, LRU blocks, reporting, and the prefill time."""

from __future__ import annotations

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from router.fake_worker.engine import FakeWorker
from router.fake_worker.prefix_cache import BLOCK_TOKENS, PrefixCache, tokenize
from router.fake_worker.settings import FakeWorkerSettings
from tests.fake_worker.test_engine import call

SYSTEM = {"role": "system", "content": "s" * 252}  # "<|system|>" + 252 + "\n" = 263 bytes


def conversation(*turns: str) -> list[dict[str, str]]:
    return [SYSTEM, *({"role": "user", "content": turn} for turn in turns)]


def test_one_token_per_four_bytes_and_ids_are_their_own_tokens() -> None:
    assert tokenize("completions", {"prompt": "abcdefghi"}).tokens == 3
    assert tokenize("completions", {"prompt": "\u00e9" * 4}).tokens == 2  # 8 bytes of UTF-8
    assert tokenize("generate", {"text": "x" * 64}).blocks == (b"x" * 64,)
    ids = list(range(40))
    prompt = tokenize("generate", {"input_ids": ids})
    assert prompt.tokens == 40 and len(prompt.blocks) == 40 // BLOCK_TOKENS
    chat = tokenize(
        "chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    )
    assert chat.tokens == len(b"<|user|>hi\n") // 4 + 1


def test_a_prefix_hits_only_whole_blocks_and_never_the_last_token() -> None:
    cache = PrefixCache(capacity_tokens=10_000)
    first = tokenize("completions", {"prompt": "a" * 640})  # 160 tokens, 10 blocks
    assert cache.serve(first) == 0
    assert cache.serve(first) == 159  # the last token is always computed
    longer = tokenize("completions", {"prompt": "a" * 640 + "b" * 100})
    assert cache.serve(longer) == 160
    other = tokenize("completions", {"prompt": "b" + "a" * 639})
    assert cache.serve(other) == 0  # same blocks after the first, different prefix: no hit


def test_capacity_evicts_the_oldest_tails_before_a_shared_prefix() -> None:
    cache = PrefixCache(capacity_tokens=4 * BLOCK_TOKENS)
    shared = "p" * 128  # two blocks
    cache.serve(tokenize("completions", {"prompt": shared + "x" * 128}))
    cache.serve(tokenize("completions", {"prompt": shared + "y" * 128}))  # 6 blocks > 4
    assert len(cache) == 4 * BLOCK_TOKENS
    # The shared prefix and the newest tail survive; the older tail went.
    assert (
        cache.serve(tokenize("completions", {"prompt": shared + "y" * 128 + "z"}))
        == 4 * BLOCK_TOKENS
    )
    assert (
        cache.serve(tokenize("completions", {"prompt": shared + "x" * 128 + "z"}))
        == 2 * BLOCK_TOKENS
    )


async def test_cached_tokens_are_reported_in_usage_meta_info_metrics_and_debug_routing() -> None:
    worker = FakeWorker(FakeWorkerSettings(cache_tokens=100_000))
    first = await call(worker, "POST", "/v1/chat/completions", {"messages": conversation("hello")})
    again = await call(
        worker, "POST", "/v1/chat/completions", {"messages": conversation("hello", "more")}
    )
    usage_first = first.json()["usage"]  # type: ignore[index]
    usage_again = again.json()["usage"]  # type: ignore[index]
    assert usage_first["prompt_tokens_details"] == {"cached_tokens": 0}
    cached = usage_again["prompt_tokens_details"]["cached_tokens"]
    assert cached == 4 * BLOCK_TOKENS  # 263 + 12 shared bytes: four whole 64-byte blocks
    generated = await call(worker, "POST", "/generate", {"text": "q" * 300})
    generated_again = await call(worker, "POST", "/generate", {"text": "q" * 300})
    assert generated.json()["meta_info"]["cached_tokens"] == 0  # type: ignore[index]
    assert generated_again.json()["meta_info"]["cached_tokens"] == 64  # type: ignore[index]
    routing = (await call(worker, "GET", "/debug/routing")).json()
    prompt_total = usage_first["prompt_tokens"] + usage_again["prompt_tokens"] + 75 + 75
    assert routing["prompt_tokens"] == prompt_total  # type: ignore[index]
    assert routing["cached_tokens"] == cached + 64  # type: ignore[index]
    scrape = (await call(worker, "GET", "/metrics")).body.decode()
    samples = {s.name: s.value for f in text_string_to_metric_families(scrape) for s in f.samples}
    assert samples["sglang:cache_hit_rate"] == pytest.approx((cached + 64) / prompt_total)
    await call(worker, "POST", "/flush_cache")
    flushed = await call(worker, "POST", "/generate", {"text": "q" * 300})
    assert flushed.json()["meta_info"]["cached_tokens"] == 0  # type: ignore[index]


async def test_vllm_reports_prefix_cache_queries_and_hits() -> None:
    worker = FakeWorker(FakeWorkerSettings(engine="vllm", cache_tokens=1000))
    for _ in range(2):
        await call(worker, "POST", "/v1/completions", {"prompt": "w" * 128})
    scrape = (await call(worker, "GET", "/metrics")).body.decode()
    samples = {s.name: s.value for f in text_string_to_metric_families(scrape) for s in f.samples}
    assert samples["vllm:prefix_cache_queries_total"] == 64
    assert samples["vllm:prefix_cache_hits_total"] == 31


async def test_without_a_cache_nothing_is_reported_as_cached() -> None:
    worker = FakeWorker(FakeWorkerSettings())
    reply = await call(worker, "POST", "/v1/completions", {"prompt": "three word prompt"})
    assert "prompt_tokens_details" not in reply.json()["usage"]  # type: ignore[index]


async def test_time_to_first_token_grows_with_the_uncached_tokens_only(
    autojump_clock: object,
) -> None:
    worker = FakeWorker(
        FakeWorkerSettings(cache_tokens=100_000, prefill_us_per_token=1000, ttft_ms=5)
    )
    prompt = {"prompt": "c" * 4000, "max_tokens": 1, "stream": True}  # 1000 tokens

    async def first_token_after() -> float:
        start = trio.current_time()
        reply = await call(worker, "POST", "/v1/completions", prompt)
        return round(reply.write_times[0] - start, 6)

    assert await first_token_after() == pytest.approx(
        0.005 + 1.0, abs=1e-9
    )  # cold: every token is prefilled
    # Warm: 62 whole blocks (992 tokens) are cached; the 8 tokens of the partial block are not.
    assert await first_token_after() == pytest.approx(0.005 + 0.008, abs=1e-9)
    unary_start = trio.current_time()
    await call(
        worker, "POST", "/v1/completions", {"prompt": "c" * 4000 + "d" * 400, "max_tokens": 1}
    )
    # 1100 tokens, 1000 of them cached (62 whole blocks = 992, the rest recomputed).
    assert trio.current_time() - unary_start == pytest.approx(
        0.005 + (1100 - 992) * 0.001, abs=1e-9
    )


def test_settings_refuse_a_negative_cache_or_prefill() -> None:
    with pytest.raises(ValueError, match="cache_tokens"):
        FakeWorkerSettings(cache_tokens=-1)
    with pytest.raises(ValueError, match="prefill_us_per_token"):
        FakeWorkerSettings(prefill_us_per_token=-0.5)
