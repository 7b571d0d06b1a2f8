"""Helpers for fleet churn tests: one stub server that is many workers, and scrape reading."""

from __future__ import annotations

import orjson

from tests.support.raw_upstream import Exchange

OK = orjson.dumps({"choices": [{"message": {"content": "hello"}}]})


async def answer_by_path(exchange: Exchange) -> None:
    """Worker `i` is the path prefix `/w{i}`: 200 when `i` is even, 500 (a fault, which
    trips a threshold-1 breaker) when it is odd."""
    index = int(exchange.request.target.split(b"/")[1][1:])
    await exchange.respond(500 if index % 2 else 200, [(b"content-type", b"application/json")], OK)


def worker_series(text: str, metric: str) -> set[str]:
    """The `worker` label of every sample of `metric` in a Prometheus scrape."""
    found = set()
    for line in text.splitlines():
        if line.startswith(metric + "{"):
            labels = line[len(metric) + 1 : line.index("}")]
            for pair in labels.split(","):
                name, _, value = pair.partition("=")
                if name == "worker":
                    found.add(value.strip('"'))
    return found
