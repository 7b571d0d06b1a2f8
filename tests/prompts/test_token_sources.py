"""The chain of token sources per model, decided against fake engines on loopback: the
operator's tokenizer, the engine's model directory read here (only when it tokenizes as
the engine does), the engine's /tokenize, or none, said in the log."""

from __future__ import annotations

import logging
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import trio

from router.engines.facts import learn_facts
from router.fleet.records import WorkerRecord, descriptive_facts
from router.fleet.registry import Fleet
from router.prompts.token_sources import (
    PROBE_TEXT,
    TokenSource,
    TokenSources,
    TokenSourceSettings,
    parse_order,
)
from router.prompts.tokenizer import HfTokenizer
from tests.support.fake_fleet import open_fake_fleet
from tests.support.model_dir import write_model

GUARD_S = 20


@asynccontextmanager
async def fleet_of(urls: list[str], engine: str | None = "vllm") -> AsyncIterator[Fleet]:
    """A fleet of `urls` with the facts their engines state (model roots among them)."""
    fleet = Fleet()
    async with httpx.AsyncClient() as http:
        for url in urls:
            record = WorkerRecord(
                id=url,
                url=url,
                models=("fake-model",),
                engine=engine,
                unknown_facts=descriptive_facts(engine),
            )
            fleet.upsert(await learn_facts(http, record, 5.0))
    yield fleet


async def decide(fleet: Fleet, **settings: object) -> TokenSources:
    sources = TokenSources(fleet, TokenSourceSettings(**settings))  # type: ignore[arg-type]
    async with httpx.AsyncClient() as http:
        await sources.reconcile(http)
    return sources


def test_the_order_is_parsed_strictly() -> None:
    assert parse_order("engine, model_dir") == (TokenSource.ENGINE, TokenSource.MODEL_DIR)
    for bad in ("", "engine,engine", "tokenizers", "none"):
        with pytest.raises(ValueError):
            parse_order(bad)


async def test_the_engines_model_directory_read_here_then_its_tokenize(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = write_model(tmp_path / "model")
    with trio.fail_after(GUARD_S):
        async with (
            open_fake_fleet(1, engine="vllm", tokenizer=str(model), cache_tokens=4096) as (fake,),
            fleet_of([fake.url]) as fleet,
        ):
            assert fleet.workers()[0].record.model_roots == {"fake-model": str(model)}
            with caplog.at_level(logging.INFO, "router.token_sources"):
                sources = await decide(fleet)
            chain = sources.chain("fake-model")
            assert chain.first is TokenSource.MODEL_DIR and chain.engine
            assert isinstance(chain.local, HfTokenizer)
            assert sources.sources() == {"fake-model": TokenSource.MODEL_DIR}
            assert (
                f"kv_aware for fake-model: token ids from the engine's model directory {model}, "
                "read here, then the engine's /tokenize for the rest"
            ) in caplog.messages
            # Only what the order allows: the engine alone.
            engine_only = await decide(fleet, order=(TokenSource.ENGINE,))
            assert engine_only.chain("fake-model").first is TokenSource.ENGINE
            assert engine_only.local("fake-model") is None


async def test_a_directory_here_that_holds_another_tokenizer_is_never_used(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = write_model(tmp_path / "model")
    with trio.fail_after(GUARD_S):
        async with open_fake_fleet(1, engine="vllm", tokenizer=str(model), cache_tokens=4096) as (
            fake,
        ):
            # The same path here now holds another model's tokenizer than the engine loaded.
            shutil.rmtree(model)
            other = write_model(model, template=None)
            (other / "tokenizer.json").write_text(
                (other / "tokenizer.json").read_text().replace('"router"', '"routers"')
            )
            async with fleet_of([fake.url]) as fleet:
                with caplog.at_level(logging.INFO, "router.token_sources"):
                    sources = await decide(fleet)
                assert sources.chain("fake-model").first is TokenSource.ENGINE
                assert any("holds another tokenizer" in m for m in caplog.messages)
                original = HfTokenizer(str(write_model(tmp_path / "original")))
                assert HfTokenizer(str(other)).encode(PROBE_TEXT) != original.encode(PROBE_TEXT)


async def test_an_unreadable_root_leaves_the_engine_and_an_engine_of_no_known_kind_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with trio.fail_after(GUARD_S):
        async with open_fake_fleet(1, engine="vllm") as (fake,):
            async with fleet_of([fake.url]) as fleet:
                # The fake's root is its model's id, not a directory: nothing to read here.
                assert fleet.workers()[0].record.model_roots == {}
                sources = await decide(fleet)
                assert sources.chain("fake-model").first is TokenSource.ENGINE
            async with fleet_of([fake.url], engine="other") as fleet:
                with caplog.at_level(logging.INFO, "router.token_sources"):
                    sources = await decide(fleet)
                assert sources.chain("fake-model").first is TokenSource.NONE
                assert any(
                    r.levelno == logging.WARNING and "no source of token ids" in r.message
                    for r in caplog.records
                )


async def test_chains_kept_for_resume_only_speak_of_resume_not_kv_aware(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """A default `router serve` (round robin, resume on) in front of engines whose model
    directory is not here: no warning about kv_aware, which does not run; one INFO line
    saying what a broken stream then does."""
    with trio.fail_after(GUARD_S):
        async with open_fake_fleet(1, engine="sglang") as (fake,):
            async with fleet_of([fake.url], engine="sglang") as fleet:
                with caplog.at_level(logging.INFO, "router.token_sources"):
                    sources = await decide(
                        fleet,
                        order=(TokenSource.TOKENIZER, TokenSource.MODEL_DIR),
                        for_resume_only=True,
                    )
                assert sources.chain("fake-model").local is None
                records = [r for r in caplog.records if r.name == "router.token_sources"]
                assert [r.levelno for r in records] == [logging.INFO]
                assert "resume for fake-model: no tokenizer here" in records[0].message
                assert "kv_aware" not in records[0].message
    operator = HfTokenizer(str(write_model(tmp_path / "model")))
    fleet = Fleet()
    fleet.upsert(WorkerRecord(id="w", url="http://w:1", models=("a",), engine="sglang"))
    caplog.clear()
    sources = TokenSources(
        fleet, TokenSourceSettings(operator_path="DIR", for_resume_only=True), operator
    )
    with caplog.at_level(logging.INFO, "router.token_sources"):
        async with httpx.AsyncClient() as http:
            await sources.reconcile(http)
    assert caplog.messages == ["resume for a: the text after a seam made with --kv-tokenizer DIR"]


async def test_the_operators_tokenizer_comes_first_for_every_model(tmp_path: Path) -> None:
    operator = HfTokenizer(str(write_model(tmp_path / "model")))
    fleet = Fleet()
    fleet.upsert(WorkerRecord(id="w", url="http://w:1", models=("a", "b"), engine="vllm"))
    sources = TokenSources(fleet, TokenSourceSettings(operator_path="DIR"), operator)
    # Before the first decision too: the operator's tokenizer is known at start.
    assert sources.local("a") is operator
    async with httpx.AsyncClient() as http:
        await sources.reconcile(http)
    assert {m: s.value for m, s in sources.sources().items()} == {
        "a": "tokenizer",
        "b": "tokenizer",
    }
    assert (
        sources.chain("b").describe()
        == "token ids from --kv-tokenizer DIR, then the engine's /tokenize for the rest"
    )
