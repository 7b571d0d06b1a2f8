"""What the real-engine tests share: the router and fake worker as a user runs them (the
`router` console script as a subprocess), answer shapes, SSE events and Prometheus text."""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import trio

from conformance.engines import EngineSettings
from conformance.processes import Child, free_port, open_process

# The console script of the venv running the tests, as an operator runs it; ROUTER_CLI
# (a command line) runs another build instead, e.g. `python -m router.cli` of a checkout.
ROUTER_CLI = shlex.split(
    os.environ.get("ROUTER_CLI") or str(Path(sys.executable).with_name("router"))
)
START_TIMEOUT_S = 30.0


@dataclass(slots=True)
class RouterProcess:
    url: str
    child: Child

    def log(self, lines: int = 60) -> str:
        return self.child.output.tail(lines)


@asynccontextmanager
async def open_router(*args: str, name: str = "router") -> AsyncIterator[RouterProcess]:
    """`router serve --port 0 ARGS` until the block exits (then SIGTERM, SIGKILL after 5 s)."""
    argv = [*ROUTER_CLI, "serve", "--host", "127.0.0.1", "--port", "0", *args]
    async with open_process(argv, name, stop_grace_s=5.0) as child:
        with trio.fail_after(START_TIMEOUT_S):
            match = await child.output.wait_for(re.compile(r"router listening on (http://\S+)"))
        yield RouterProcess(match.group(1), child)


@asynccontextmanager
async def open_fake_worker(*args: str) -> AsyncIterator[RouterProcess]:
    """`router fake-worker --port 0 ARGS` until the block exits."""
    argv = [*ROUTER_CLI, "fake-worker", "--host", "127.0.0.1", "--port", "0", *args]
    async with open_process(argv, "fake-worker", stop_grace_s=5.0) as child:
        with trio.fail_after(START_TIMEOUT_S):
            match = await child.output.wait_for(re.compile(r"listening on (http://\S+)"))
        yield RouterProcess(match.group(1), child)


def shape(value: Any) -> Any:
    """The structure of a JSON value without its content: keys (recursively) and types.

    A list's shape is the shapes of its items with duplicates merged, so two answers
    with a different number of equal-shaped items (tokens, choices) still compare equal
    where the item structure matches.
    """
    if isinstance(value, dict):
        return {key: shape(item) for key, item in sorted(value.items())}
    if isinstance(value, list):
        merged: list[Any] = []
        for item in value:
            item_shape = shape(item)
            if item_shape not in merged:
                merged.append(item_shape)
        return merged
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    return type(value).__name__


def shape_diff(left: Any, right: Any, path: str = "$") -> list[str]:
    """Where two shapes differ, one line per difference (`path: left vs right`)."""
    if isinstance(left, dict) and isinstance(right, dict):
        out = []
        for key in sorted(set(left) | set(right)):
            if key not in right:
                out.append(f"{path}.{key}: only in the first ({left[key]!r})")
            elif key not in left:
                out.append(f"{path}.{key}: only in the second ({right[key]!r})")
            else:
                out += shape_diff(left[key], right[key], f"{path}.{key}")
        return out
    if isinstance(left, list) and isinstance(right, list):
        if len(left) == len(right) == 1:
            return shape_diff(left[0], right[0], f"{path}[]")
        if left != right:
            return [f"{path}: {left!r} vs {right!r}"]
        return []
    if left != right:
        return [f"{path}: {left!r} vs {right!r}"]
    return []


@dataclass(frozen=True, slots=True)
class SSE:
    """A streamed body cut into events: each event's `data` payloads, and the raw text."""

    raw: bytes
    events: list[bytes]

    @classmethod
    def parse(cls, raw: bytes) -> SSE:
        events = []
        for block in re.split(rb"\r\n\r\n|\n\n|\r\r", raw):
            if not block.strip():
                continue
            data = [
                line[5:].lstrip(b" ") for line in block.splitlines() if line.startswith(b"data:")
            ]
            events.append(b"\n".join(data))
        return cls(raw, events)

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1] == b"[DONE]"

    def payloads(self) -> list[Any]:
        return [orjson.loads(event) for event in self.events if event != b"[DONE]"]

    def kinds(self) -> list[str]:
        """Each event named by what it carries, consecutive repeats merged: the order to compare."""
        out: list[str] = []
        for event in self.events:
            kind = "[DONE]" if event == b"[DONE]" else event_kind(orjson.loads(event))
            if not out or out[-1] != kind:
                out.append(kind)
        return out


def event_kind(payload: dict[str, Any]) -> str:
    if "error" in payload:
        return "error"
    choices = payload.get("choices") or []
    if not choices:
        return "usage" if payload.get("usage") else "empty"
    choice = choices[0]
    if choice.get("finish_reason"):
        return "finish"
    delta = choice.get("delta")
    if delta is not None and delta.get("role"):
        return "role"
    return "token"


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True, slots=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def parse_metrics(text: str) -> list[Sample]:
    samples = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        labels = dict(_LABEL.findall(match.group(2) or ""))
        samples.append(Sample(match.group(1), labels, float(match.group(3))))
    return samples


def metric_sum(samples: Sequence[Sample], name: str, **labels: str) -> float | None:
    """The sum over every series of `name` whose labels include `labels`; None when absent."""
    values = [
        s.value
        for s in samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    return sum(values) if values else None


async def scrape(client: httpx.AsyncClient, url: str) -> list[Sample]:
    response = await client.get(f"{url}/metrics")
    response.raise_for_status()
    return parse_metrics(response.text)


def chat_body(content: str = "hello there", **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "temperature": 0, **extra}


class RawStream:
    """A streaming POST over a plain socket, so a test can leave mid-stream by closing it."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self._stream = stream
        self.received = b""

    async def read_events(self, count: int) -> int:
        """Read until `count` SSE data events have arrived (or the stream ended)."""
        while self.received.count(b"data: ") < count:
            chunk = await self._stream.receive_some(65536)
            if not chunk:
                break
            self.received += chunk
        assert self.received.startswith(b"HTTP/1.1 200"), self.received[:300]
        return self.received.count(b"data: ")


@asynccontextmanager
async def open_raw_stream(url: str, path: str, body: dict[str, Any]) -> AsyncIterator[RawStream]:
    """POST `body` to `url` + `path`; leaving the block closes the connection at once."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    payload = orjson.dumps(body)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nAccept: text/event-stream\r\n\r\n"
    ).encode()
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        await stream.send_all(head + payload)
        yield RawStream(stream)


def kv_events_engine(
    model: str,
    block_size: int,
    *,
    endpoint: str = "",
    replay_endpoint: str = "",
    protocol: str = "http",
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> EngineSettings:
    """An engine with prefix caching whose KV events go out over ZMQ with a replay socket:
    its publisher on `endpoint` and its replay socket on `replay_endpoint` (default
    wildcard TCP ports; vLLM binds its PUB socket only for a wildcard or ipc endpoint, and
    connects to any other; the replay socket always binds)."""
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": endpoint or f"tcp://*:{free_port()}",
        "replay_endpoint": replay_endpoint or f"tcp://*:{free_port()}",
    }
    return EngineSettings(
        served_model_name=model,
        protocol=protocol,
        extra_args=(
            "--block-size",
            str(block_size),
            "--enable-prefix-caching",
            "--kv-events-config",
            json.dumps(config),
            *extra_args,
        ),
        env=env or {},
    )
