"""What the gRPC fake refuses to be: each setting it cannot serve is named."""

from __future__ import annotations

import dataclasses

import pytest

from router.fake_worker.grpc_engine.main import unsupported
from router.fake_worker.settings import FakeWorkerSettings


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"role": "prefill"}, "--role prefill"),
        ({"cache_tokens": 1024}, "--cache-tokens"),
        ({"engine": "vllm", "lora_adapters": ("x",)}, "--lora-adapters"),
        ({"engine": "vllm", "runtime_lora_updating": True}, "--runtime-lora-updating"),
    ],
)
def test_what_it_cannot_serve_is_named(changes: dict[str, object], words: str) -> None:
    settings = dataclasses.replace(FakeWorkerSettings(engine="vllm"), **changes)  # type: ignore[arg-type]
    problem = unsupported(settings)
    assert problem is not None and words in problem


def test_a_plain_vllm_engine_is_served() -> None:
    assert unsupported(FakeWorkerSettings(engine="vllm")) is None
