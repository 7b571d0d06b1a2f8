"""What the gRPC fake refuses to be: each setting it cannot serve is named; a prefix
cache and its KV events are served."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from router.fake_worker.cli import main
from router.fake_worker.grpc_engine.main import unsupported
from router.fake_worker.settings import FakeWorkerSettings


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"role": "prefill"}, "--role prefill"),
        ({"cache_tokens": 1024, "kv_events_port": 5557}, "--kv-events-port"),
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


def test_a_prefix_cache_and_its_kv_events_are_served() -> None:
    settings = FakeWorkerSettings(engine="vllm", cache_tokens=1024, kv_events=True)
    assert unsupported(settings) is None


def test_a_models_tokenizer_is_refused(tmp_path: Path) -> None:
    settings = FakeWorkerSettings(engine="vllm", cache_tokens=1024, tokenizer=str(tmp_path))
    assert "--tokenizer" in (unsupported(settings) or "")


def test_kv_events_without_a_cache_are_refused_at_start(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--protocol", "grpc", "--kv-events"])
    assert exited.value.code == 2
    assert "kv_events needs a prefix cache: set cache_tokens" in capsys.readouterr().err
