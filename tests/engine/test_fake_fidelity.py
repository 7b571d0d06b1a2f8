"""The fake worker held to a real vLLM engine: the same requests to both, compared in
structure, never in generated text: status codes, the recursive shape of every JSON answer
(keys and types), error bodies, the order of SSE events per choice and their terminator,
and the metric names, types and label names that the router and `router agent` read.

Each case is a test of its own, so every difference fails by name. The table of what was
compared (same / differs, and how) is printed and written to `build/fake-fidelity.md`;
docs/fake-worker.md ("Fidelity against vLLM") keeps the reviewed copy.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest
import trio

from conformance.engines import REPO, Engine, EngineSettings
from tests.engine.conftest import EngineHost, host_engines
from tests.engine.helpers import (
    SSE,
    RouterProcess,
    chat_body,
    event_kind,
    open_fake_worker,
    open_raw_stream,
    shape,
    shape_diff,
)

MODEL = "tiny"
MAX_MODEL_LEN = 2048
TABLE_PATH = REPO / "build" / "fake-fidelity.md"
# The names the router (load, cache-aware routing) and `router agent` (drain) read.
READ_METRICS = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
)

ROWS: list[tuple[str, str, str]] = []


@pytest.fixture(scope="module")
def host() -> Iterator[EngineHost]:
    settings = EngineSettings(
        served_model_name=MODEL,
        extra_args=("--max-model-len", str(MAX_MODEL_LEN), "--enable-server-load-tracking"),
    )
    yield from host_engines([settings], name="fidelity")


@pytest.fixture(scope="module", autouse=True)
def fidelity_table() -> Iterator[None]:
    yield
    lines = ["| case | verdict | detail |", "|---|---|---|"]
    lines += [f"| {case} | {verdict} | {detail} |" for case, verdict, detail in ROWS]
    table = "\n".join(lines) + "\n"
    TABLE_PATH.parent.mkdir(parents=True, exist_ok=True)
    TABLE_PATH.write_text(table)
    print(f"\nfidelity against vLLM ({TABLE_PATH}):\n{table}")


@pytest.fixture
def engine(host: EngineHost) -> Engine:
    return host.engines[0]


@pytest.fixture
async def fake() -> AsyncIterator[RouterProcess]:
    async with open_fake_worker("--engine", "vllm", "--model", MODEL) as process:
        yield process


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    method: str
    path: str
    body: Any = None  # a JSON value, or bytes sent as they are
    stream: bool = False


def _chat(**extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 5,
        **extra,
    }


def _completion(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 5, **extra}


USAGE = {"stream_options": {"include_usage": True}}
CASES = [
    Case("chat", "POST", "/v1/chat/completions", _chat()),
    Case("completions", "POST", "/v1/completions", _completion()),
    Case("chat n=2", "POST", "/v1/chat/completions", _chat(n=2)),
    Case("completions n=2", "POST", "/v1/completions", _completion(n=2)),
    Case("chat stream", "POST", "/v1/chat/completions", _chat(stream=True), stream=True),
    Case(
        "chat stream + usage",
        "POST",
        "/v1/chat/completions",
        _chat(stream=True, **USAGE),
        stream=True,
    ),
    Case(
        "chat stream n=2 + usage",
        "POST",
        "/v1/chat/completions",
        _chat(stream=True, n=2, **USAGE),
        stream=True,
    ),
    Case("completions stream", "POST", "/v1/completions", _completion(stream=True), stream=True),
    Case(
        "completions stream + usage",
        "POST",
        "/v1/completions",
        _completion(stream=True, **USAGE),
        stream=True,
    ),
    Case("body not JSON", "POST", "/v1/chat/completions", b"{not json"),
    Case("messages not a list", "POST", "/v1/chat/completions", {"model": MODEL, "messages": "hi"}),
    Case("max_tokens negative", "POST", "/v1/completions", _completion(max_tokens=-1)),
    Case(
        "max_tokens above max_model_len",
        "POST",
        "/v1/completions",
        _completion(max_tokens=MAX_MODEL_LEN + 10),
    ),
    Case("unknown model", "POST", "/v1/chat/completions", {**_chat(), "model": "no-such-model"}),
    Case("tokenize", "POST", "/tokenize", {"model": MODEL, "prompt": "hello world"}),
    Case(
        "tokenize chat",
        "POST",
        "/tokenize",
        {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]},
    ),
    Case("models", "GET", "/v1/models"),
    Case("health", "GET", "/health"),
]


async def _send(client: httpx.AsyncClient, url: str, case: Case) -> httpx.Response:
    if isinstance(case.body, bytes):
        return await client.request(
            case.method,
            url + case.path,
            content=case.body,
            headers={"content-type": "application/json"},
        )
    if case.body is None:
        return await client.request(case.method, url + case.path)
    return await client.request(case.method, url + case.path, json=case.body)


def _event_order(sse: SSE) -> dict[str, list[str]]:
    """The order of events per choice (each choice's own role, tokens, finish) and of the
    events that carry no choice (usage, `[DONE]`). How vLLM interleaves the choices of
    `n>1` depends on its scheduling from one run to the next, so it is not compared."""
    order: dict[str, list[str]] = {}
    for event in sse.events:
        if event == b"[DONE]":
            key, kind = "no choice", "[DONE]"
        else:
            payload = orjson.loads(event)
            choices = payload.get("choices") or [{}]
            key, kind = f"choice {choices[0].get('index')}", event_kind(payload)
            if kind in ("usage", "empty", "error"):
                key = "no choice"
        kinds = order.setdefault(key, [])
        if not kinds or kinds[-1] != kind:
            kinds.append(kind)
    return order


def _compare(case: Case, real: httpx.Response, fake: httpx.Response) -> list[str]:
    """Every structural difference between the engine's answer and the fake's."""
    out = []
    if real.status_code != fake.status_code:
        out.append(f"status: vLLM {real.status_code}, fake {fake.status_code}")
    real_type = real.headers.get("content-type", "").split(";")[0]
    fake_type = fake.headers.get("content-type", "").split(";")[0]
    if real_type != fake_type:
        out.append(f"content-type: vLLM {real_type!r}, fake {fake_type!r}")
    if case.stream and real.status_code == 200:
        real_sse, fake_sse = SSE.parse(real.content), SSE.parse(fake.content)
        if _event_order(real_sse) != _event_order(fake_sse):
            out.append(f"event order: vLLM {_event_order(real_sse)}, fake {_event_order(fake_sse)}")
        if real_sse.done != fake_sse.done:
            out.append(f"[DONE] terminator: vLLM {real_sse.done}, fake {fake_sse.done}")
        framing = [
            (name, bool(re.fullmatch(rb"(data: [^\n]*\n\n)+", sse.raw)))
            for name, sse in (("vLLM", real_sse), ("fake", fake_sse))
        ]
        if framing[0][1] != framing[1][1]:
            out.append(f"framing (`data: ...` LF LF only): {framing}")
        by_kind: dict[str, list[Any]] = {}
        for label, sse in (("real", real_sse), ("fake", fake_sse)):
            for payload in sse.payloads():
                by_kind.setdefault(f"{label}:{event_kind(payload)}", []).append(payload)
        for kind in sorted({key.split(":", 1)[1] for key in by_kind}):
            real_events = by_kind.get(f"real:{kind}", [])
            fake_events = by_kind.get(f"fake:{kind}", [])
            if real_events and fake_events:
                diff = shape_diff(shape(real_events), shape(fake_events), f"{kind} event")
                out += [line.replace("first", "vLLM").replace("second", "fake") for line in diff]
        per_event = [
            max((len(p.get("choices") or []) for p in sse.payloads()), default=0)
            for sse in (real_sse, fake_sse)
        ]
        if per_event[0] != per_event[1]:
            out.append(f"choices per event (at most): vLLM {per_event[0]}, fake {per_event[1]}")
        real_choices = {c["index"] for p in real_sse.payloads() for c in p.get("choices") or []}
        fake_choices = {c["index"] for p in fake_sse.payloads() for c in p.get("choices") or []}
        if real_choices != fake_choices:
            out.append(f"choice indices: vLLM {sorted(real_choices)}, fake {sorted(fake_choices)}")
        return out
    if not real.content or not fake.content:
        if bool(real.content) != bool(fake.content):
            out.append(f"body: vLLM {real.content[:80]!r}, fake {fake.content[:80]!r}")
        return out
    try:
        real_json, fake_json = orjson.loads(real.content), orjson.loads(fake.content)
    except orjson.JSONDecodeError:
        out.append(f"body: vLLM {real.content[:80]!r}, fake {fake.content[:80]!r}")
        return out
    diff = shape_diff(shape(real_json), shape(fake_json))
    out += [line.replace("first", "vLLM").replace("second", "fake") for line in diff]
    if isinstance(real_json, dict) and isinstance(real_json.get("choices"), list):
        if len(real_json["choices"]) != len(fake_json.get("choices", [])):
            out.append(
                f"choices: vLLM {len(real_json['choices'])}, fake {len(fake_json.get('choices', []))}"
            )
    if isinstance(real_json, dict) and "error" in real_json:
        real_error, fake_error = real_json["error"], (fake_json.get("error") or {})
        for key in ("type", "code"):
            if real_error.get(key) != fake_error.get(key):
                out.append(
                    f"error.{key}: vLLM {real_error.get(key)!r}, fake {fake_error.get(key)!r}"
                )
    return out


def _record(case: str, differences: list[str], same_detail: str) -> None:
    if differences:
        ROWS.append((case, "differs", "<br>".join(d.replace("|", "\\|") for d in differences)))
    else:
        ROWS.append((case, "same", same_detail))


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
async def test_the_fake_answers_like_vllm(engine: Engine, fake: RouterProcess, case: Case) -> None:
    with trio.fail_after(60):
        async with httpx.AsyncClient(timeout=30) as client:
            real = await _send(client, engine.url, case)
            faked = await _send(client, fake.url, case)
    differences = _compare(case, real, faked)
    _record(
        f"`{case.method} {case.path}` {case.name}",
        differences,
        f"status {real.status_code}, keys and types"
        + (", event order, [DONE]" if case.stream else ""),
    )
    print(
        f"\n{case.name}: vLLM {real.status_code} {real.text[:400]}\nfake {faked.status_code} {faked.text[:400]}"
    )
    assert differences == []


_TYPE = re.compile(r"^# TYPE (\S+) (\S+)$", re.MULTILINE)
_SERIES = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})? ", re.MULTILINE)


def _metric_facts(text: str) -> dict[str, tuple[str, frozenset[str]]]:
    """Per metric family the router reads: its TYPE and the label names of its series."""
    types = dict(_TYPE.findall(text))
    labels: dict[str, set[str]] = {}
    for name, raw in _SERIES.findall(text):
        labels.setdefault(name, set()).update(re.findall(r'([a-zA-Z_]\w*)="', raw))
    facts = {}
    for name in READ_METRICS:
        family = name.removesuffix("_total")
        kind = types.get(family) or types.get(name) or "absent"
        facts[name] = (kind, frozenset(labels.get(name, set())))
    return facts


async def test_the_fakes_metrics_have_the_names_types_and_labels_vllm_has(
    engine: Engine, fake: RouterProcess
) -> None:
    with trio.fail_after(60):
        async with httpx.AsyncClient(timeout=30) as client:
            # One request each first, so every counter has a series.
            for url in (engine.url, fake.url):
                await client.post(f"{url}/v1/completions", json=_completion())
            real = (await client.get(f"{engine.url}/metrics")).text
            faked = (await client.get(f"{fake.url}/metrics")).text
    real_facts, fake_facts = _metric_facts(real), _metric_facts(faked)
    differences = []
    for name in READ_METRICS:
        (real_kind, real_labels), (fake_kind, fake_labels) = real_facts[name], fake_facts[name]
        row = []
        if real_kind != fake_kind:
            row.append(f"type: vLLM {real_kind}, fake {fake_kind}")
        if real_labels != fake_labels:
            row.append(f"labels: vLLM {sorted(real_labels)}, fake {sorted(fake_labels)}")
        _record(f"`/metrics` {name}", row, f"{real_kind}, labels {sorted(real_labels)}")
        differences += [f"{name}: {line}" for line in row]
    assert differences == []


async def _server_load_while_streaming(url: str) -> tuple[Any, Any]:
    """`/load` while one stream is half read, and once it is gone (the engine forgets a
    request after its answer's end: polled for up to 5 s)."""
    body = chat_body(model=MODEL, max_tokens=1500, stream=True, ignore_eos=True)
    async with httpx.AsyncClient(timeout=30) as client:
        async with open_raw_stream(url, "/v1/chat/completions", body) as stream:
            await stream.read_events(3)
            during = (await client.get(f"{url}/load")).json()
        with trio.move_on_after(5):
            while (after := (await client.get(f"{url}/load")).json()) != {"server_load": 0}:  # noqa: ASYNC110 - the engine's own counter
                await trio.sleep(0.05)
    return during, after


async def test_the_fakes_load_counts_what_vllms_counts_with_server_load_tracking(
    engine: Engine,
) -> None:
    with trio.fail_after(60):
        async with open_fake_worker(
            "--engine", "vllm", "--model", MODEL, "--enable-server-load-tracking",
            "--token-latency-ms", "20",
        ) as fake:  # fmt: skip
            real = await _server_load_while_streaming(engine.url)
            faked = await _server_load_while_streaming(fake.url)
    _record("`/load` during a stream, then after", [] if real == faked else [f"{faked}"], f"{real}")
    assert real == ({"server_load": 1}, {"server_load": 0})
    assert faked == real
