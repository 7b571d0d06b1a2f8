"""Aliases and fallbacks as the pure resolver sees them: the canary's share within binomial
bounds, the order a request tries models in, what is refused at start-up (an alias of an
alias, a fallback chain that comes back), and the writer that names the model answering."""

from __future__ import annotations

import math
import random

import pytest
import trio

from router.http.server.messages import Headers
from router.pipeline.model_names import ModelNames, ModelNamesError, ModelNameWriter, ModelRoute

CANARY = {"chat": [("llama-v1", 95.0), ("llama-v2", 5.0)]}


def test_a_canary_at_5_percent_stays_within_binomial_bounds_over_10000_requests() -> None:
    names = ModelNames(CANARY)
    draw = random.Random(20261204).random
    requests = 10_000
    canary = sum(
        1
        for _ in range(requests)
        if (route := names.resolve("chat", draw)) is not None and route.models[0] == "llama-v2"
    )
    # Mean 500, standard deviation sqrt(10000 * 0.05 * 0.95) = 21.8; 3.29 deviations on
    # each side hold 99.9% of runs: 428 to 572.
    mean = requests * 0.05
    bound = 3.29 * math.sqrt(requests * 0.05 * 0.95)
    assert mean - bound <= canary <= mean + bound, canary


def test_the_draw_lands_on_weights_by_their_running_sums() -> None:
    names = ModelNames({"m": [("a", 1.0), ("b", 2.0), ("c", 1.0)]})

    def first(value: float) -> str:
        route = names.resolve("m", lambda: value)
        assert route is not None
        return route.models[0]

    assert [first(v) for v in (0.0, 0.2499, 0.25, 0.7499, 0.75, 0.9999)] == [
        "a",
        "a",
        "b",
        "b",
        "c",
        "c",
    ]


def test_a_name_without_alias_or_fallback_resolves_to_nothing_and_draws_nothing() -> None:
    names = ModelNames(CANARY, {"big": ["small"]})

    def no_draw() -> float:
        raise AssertionError("drew for a name that is no alias")

    assert names.resolve("other", no_draw) is None
    assert names.resolve("big", no_draw) == ModelRoute("big", ("big", "small"))
    assert ModelNames().empty
    assert names.aliases == ("chat",)


def test_an_alias_tries_its_draw_then_its_other_targets_then_its_fallbacks() -> None:
    names = ModelNames(
        {"chat": [("v1", 90.0), ("v2", 5.0), ("v3", 5.0)]},
        {"chat": ["small"], "v2": ["v2-lite"], "small": ["tiny"]},
    )
    route = names.resolve("chat", lambda: 0.92)
    assert route == ModelRoute("chat", ("v2", "v2-lite", "v1", "v3", "small", "tiny"), "chat")


def test_fallbacks_chain_depth_first_and_name_each_model_once() -> None:
    names = ModelNames({}, {"a": ["b", "c"], "b": ["c", "d"]})
    assert names.resolve("a", random.random) == ModelRoute("a", ("a", "b", "c", "d"))


def test_a_fallback_to_an_alias_takes_its_targets_by_weight() -> None:
    names = ModelNames({"small": [("s1", 1.0), ("s2", 3.0)]}, {"big": ["small"]})
    assert names.resolve("big", random.random) == ModelRoute("big", ("big", "s2", "s1"))


@pytest.mark.parametrize(
    ("aliases", "fallbacks", "problem"),
    [
        ({"a": [("a", 1.0)]}, {}, "alias 'a' names itself"),
        ({"a": [("b", 1.0)], "b": [("a", 1.0)]}, {}, "alias 'a' names the alias 'b'"),
        ({}, {"big": ["big"]}, "model fallbacks loop: big -> big"),
        ({}, {"a": ["b"], "b": ["c"], "c": ["a"]}, "model fallbacks loop: a -> b -> c -> a"),
        ({"chat": [("v1", 1.0)]}, {"v1": ["chat"]}, "model fallbacks loop: v1 -> chat -> v1"),
        ({"chat": [("v1", 0.0)]}, {}, "the weight of 'v1' must be a positive number"),
        ({"chat": [("v1", float("nan"))]}, {}, "must be a positive number"),
        ({"chat": [("v1", 1.0), ("v1", 2.0)]}, {}, "names 'v1' twice"),
        ({"chat": []}, {}, "names no model"),
        ({}, {"big": []}, "names no fallback"),
        ({"bad name": [("v1", 1.0)]}, {}, "without spaces"),
    ],
)
def test_names_that_cannot_work_are_refused_at_start_up(
    aliases: dict[str, list[tuple[str, float]]], fallbacks: dict[str, list[str]], problem: str
) -> None:
    with pytest.raises(ModelNamesError, match=problem):
        ModelNames(aliases, fallbacks)


class RecordingWriter:
    def __init__(self) -> None:
        self.head: tuple[int, list[tuple[bytes, bytes]]] | None = None
        self.chunks: list[bytes] = []

    @property
    def started(self) -> bool:
        return self.head is not None

    async def respond(self, status: int, headers: Headers, body: bytes) -> None:
        self.head = (status, list(headers))
        self.chunks.append(body)

    async def start(self, status: int, headers: Headers, first: bytes = b"") -> None:
        self.head = (status, list(headers))
        if first:
            self.chunks.append(first)

    async def write(self, data: bytes) -> None:
        self.chunks.append(data)

    async def finish(self, last: bytes = b"") -> None:
        if last:
            self.chunks.append(last)

    async def abort(self, *, reset: bool = False) -> None:
        pass


async def test_the_answer_names_the_served_model_unless_told_to_name_the_alias() -> None:
    inner = RecordingWriter()
    writer = ModelNameWriter(inner)
    writer.mark("llama-v2")
    writer.rename("llama-v2", 'chat "x"')
    await writer.start(200, [(b"content-type", b"text/event-stream")])
    events = (
        b'data: {"id":"1","model":"llama-v2","choices":[{"delta":{"content":'
        b'"\\"model\\":\\"llama-v2\\""}}]}\n\n'
        b'data: {"id":"1", "model" : "llama-v2","choices":[]}\n\n'
    )
    await writer.write(events)
    assert inner.head == (
        200,
        [(b"content-type", b"text/event-stream"), (b"x-router-model", b"llama-v2")],
    )
    assert inner.chunks == [
        b'data: {"id":"1","model":"chat \\"x\\"","choices":[{"delta":{"content":'
        b'"\\"model\\":\\"llama-v2\\""}}]}\n\n'
        b'data: {"id":"1", "model" : "chat \\"x\\"","choices":[]}\n\n'
    ]


async def test_a_fallback_is_marked_and_its_answer_keeps_the_model_that_served() -> None:
    inner = RecordingWriter()
    writer = ModelNameWriter(inner)
    writer.rename("big", "chat")
    writer.mark("small", "big")
    writer.rename(None, "chat")
    await writer.respond(200, [], b'{"model":"small"}')
    assert inner.head == (200, [(b"x-router-model", b"small"), (b"x-router-fallback-from", b"big")])
    assert inner.chunks == [b'{"model":"small"}']


def test_the_writer_passes_everything_else_through() -> None:
    async def run() -> None:
        inner = RecordingWriter()
        writer = ModelNameWriter(inner)
        await writer.respond(404, [(b"a", b"b")], b'{"model":"x"}')
        assert inner.head == (404, [(b"a", b"b")])
        assert inner.chunks == [b'{"model":"x"}']

    trio.run(run)
