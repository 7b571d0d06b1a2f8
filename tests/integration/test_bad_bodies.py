"""Hypothesis-generated bad request bodies: never a 500, always a 4xx, never a dispatch.

How hypothesis meets trio here: `@given` drives a plain sync test, and the fleet and the
router run in one `trio.run` on a background thread, started once per module. Each example
is one HTTP request from a sync client over loopback, so a hundred examples take well under
a second. The alternatives were worse: a `trio.run` per example would start a fleet and a
router a hundred times, and hypothesis cannot drive an async test body itself. The
worker counters are read inside the trio thread (`trio.from_thread.run_sync`), so the
test never races the event loop.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest
import trio
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from router.fake_worker.settings import FakeWorkerSettings
from tests.support.fake_fleet import FakeWorkerHandle, open_fake_fleet
from tests.support.router_instance import open_router

MAX_BODY_BYTES = 256 * 1024
# Two models, so a body without `model` cannot be completed by the router and is a 400.
MODELS = ("model-a", "model-b")
EXPECTED_CODES = {400: "invalid_request", 404: "model_not_found", 413: "payload_too_large"}
VALID: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": "model-a", "messages": [{"role": "user", "content": "hi"}]},
    "/v1/completions": {"model": "model-a", "prompt": "hi"},
    "/generate": {"model": "model-a", "text": "hi"},
}
REQUIRED = {
    "/v1/chat/completions": ("model", "messages"),
    "/v1/completions": ("model", "prompt"),
    "/generate": ("model", "text"),
}


@dataclass(frozen=True, slots=True)
class LiveRouter:
    url: str
    token: trio.lowlevel.TrioToken
    fleet: list[FakeWorkerHandle]
    stop: trio.Event

    def dispatches(self) -> int:
        return trio.from_thread.run_sync(
            lambda: sum(handle.worker.routing.dispatches for handle in self.fleet),
            trio_token=self.token,
        )


async def _serve(ready: queue.Queue[LiveRouter | BaseException]) -> None:
    workers = [FakeWorkerSettings(model=model) for model in MODELS]
    with trio.fail_after(600):  # a guard: the module's tests end long before
        async with (
            open_fake_fleet(workers) as fleet,
            open_router([handle.url for handle in fleet], max_body_bytes=MAX_BODY_BYTES) as router,
        ):
            stop = trio.Event()
            ready.put(LiveRouter(router.url, trio.lowlevel.current_trio_token(), fleet, stop))
            await stop.wait()


@pytest.fixture(scope="module")
def live_router() -> Iterator[LiveRouter]:
    ready: queue.Queue[LiveRouter | BaseException] = queue.Queue()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            trio.run(_serve, ready)
        except BaseException as exc:  # handed to the test thread, which raises it
            failure.append(exc)
            ready.put(exc)

    thread = threading.Thread(target=run, name="router-under-test")
    thread.start()
    started = ready.get(timeout=30)
    if isinstance(started, BaseException):
        thread.join()
        raise started
    try:
        yield started
    finally:
        trio.from_thread.run_sync(started.stop.set, trio_token=started.token)
        thread.join(timeout=30)
    if failure:
        raise failure[0]


@pytest.fixture(scope="module")
def client(live_router: LiveRouter) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live_router.url, timeout=10) as http:
        yield http


# -- strategies ------------------------------------------------------------------------

_TEXT = st.text(
    st.characters(exclude_categories=["Cs"]), max_size=20
)  # JSON cannot carry lone surrogates
_HUGE = st.tuples(st.sampled_from("x\u00e9\u4e2d\U0001f600"), st.integers(10_000, 400_000)).map(
    lambda pair: pair[0] * pair[1]
)
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    _TEXT,
)
_JSON = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(_TEXT, inner, max_size=4)),
    max_leaves=12,
)


def _not(*allowed: type) -> st.SearchStrategy[Any]:
    """JSON values of none of the `allowed` types (bool is not an int here)."""

    def wrong(value: Any) -> bool:
        if isinstance(value, bool):
            return bool not in allowed
        return not isinstance(value, allowed)

    values = _JSON if str in allowed else st.one_of(_JSON, _HUGE)
    return values.filter(wrong)


_NEGATIVE = st.integers(-(2**63), -1)
# Field -> values the router must refuse in it, per route; each replaces one valid field.
_WRONG_COMMON = {
    "model": st.one_of(_not(str, type(None)), st.just("")),
    "stream": _not(bool),
    "max_tokens": st.one_of(_not(int, type(None)), _NEGATIVE),
    "max_completion_tokens": st.one_of(_not(int, type(None)), _NEGATIVE),
    "n": st.one_of(_not(int, type(None)), _NEGATIVE, st.just(0)),
    "temperature": _not(int, float, type(None)),
    "top_p": _not(int, float, type(None)),
}
_WRONG_BY_PATH = {
    "/v1/chat/completions": {
        "messages": st.one_of(
            _not(list),
            st.just([]),
            st.lists(_not(dict), min_size=1, max_size=3),
            st.builds(lambda role: [{"role": role, "content": "hi"}], _not(str)),
            st.builds(
                lambda content: [{"role": "user", "content": content}], _not(str, list, type(None))
            ),
        ),
    },
    "/v1/completions": {
        "prompt": st.one_of(
            _not(str, list),
            st.just([]),
            st.lists(_not(str, int, list), min_size=1, max_size=3),
            st.just([1, "mixed"]),
        ),
    },
    "/generate": {
        "text": st.one_of(_not(str, list), st.lists(_not(str), min_size=1, max_size=3)),
        "input_ids": st.one_of(
            _not(list, type(None)), st.lists(_not(int, list), min_size=1, max_size=3)
        ),
        "sampling_params": _not(dict, type(None)),
    },
}


@st.composite
def _wrong_type(draw: st.DrawFn, path: str) -> bytes:
    fields = {**_WRONG_COMMON, **_WRONG_BY_PATH[path]}
    name = draw(st.sampled_from(sorted(fields)))
    return orjson.dumps({**VALID[path], name: draw(fields[name])})


@st.composite
def _missing_field(draw: st.DrawFn, path: str) -> bytes:
    body = dict(VALID[path])
    del body[draw(st.sampled_from(REQUIRED[path]))]
    # Unrelated extra fields, a huge one among them, change nothing about what is missing.
    extra = draw(
        st.dictionaries(
            st.sampled_from(["user", "seed", "x" * 50]), st.one_of(_JSON, _HUGE), max_size=2
        )
    )
    return orjson.dumps({**extra, **body})


def _parses_to_object(raw: bytes) -> bool:
    try:
        return isinstance(orjson.loads(raw), dict)
    except orjson.JSONDecodeError:
        return False


_INVALID_JSON = st.one_of(
    st.binary(max_size=64),
    _TEXT.map(str.encode),
    st.sampled_from(
        [b"", b"{", b'{"model": "model-a",}', b'{"model": NaN}', b'"\\ud800"', b"[" * 5000]
    ),
    st.builds(
        lambda body, cut: orjson.dumps(body)[: cut % len(orjson.dumps(body))],
        st.sampled_from(list(VALID.values())),
        st.integers(0, 200),
    ),
).filter(lambda raw: not _parses_to_object(raw))
_NON_OBJECT = st.one_of(_SCALARS, st.lists(_JSON, max_size=4), _HUGE).map(orjson.dumps)


@st.composite
def _unknown_model(draw: st.DrawFn, path: str) -> bytes:
    """A well-formed body for a model nobody serves (its name huge or not): a 404."""
    name = st.text(st.characters(exclude_categories=["Cs"]), min_size=1, max_size=20)
    model = draw(st.one_of(_HUGE, name.filter(lambda name: name not in MODELS)))
    return orjson.dumps({**VALID[path], "model": model})


KINDS = {
    "invalid JSON": lambda path: _INVALID_JSON,
    "not an object": lambda path: _NON_OBJECT,
    "wrong type": _wrong_type,
    "missing field": _missing_field,
    "unknown model": _unknown_model,
}


@st.composite
def bad_requests(draw: st.DrawFn) -> tuple[str, str, bytes]:
    """(kind, path, body); the kind is drawn first so every kind gets its share."""
    kind = draw(st.sampled_from(sorted(KINDS)))
    path = draw(st.sampled_from(sorted(VALID)))
    return kind, path, draw(KINDS[kind](path))


# -- tests -----------------------------------------------------------------------------


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(bad=bad_requests())
def test_bad_bodies_are_4xx_and_never_reach_a_worker(
    live_router: LiveRouter, client: httpx.Client, bad: tuple[str, str, bytes]
) -> None:
    kind, path, body = bad
    before = live_router.dispatches()
    response = client.post(path, content=body, headers={"content-type": "application/json"})
    assert response.status_code in EXPECTED_CODES, (response.status_code, response.text[:300])
    error = response.json()["error"]
    assert error["code"] == EXPECTED_CODES[response.status_code]
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == "invalid_request_error"
    assert live_router.dispatches() == before
    event(f"{kind}: {response.status_code}")


def test_a_good_body_on_the_same_router_is_dispatched(
    live_router: LiveRouter, client: httpx.Client
) -> None:
    """The control: the counter the property test watches does count dispatches."""
    before = live_router.dispatches()
    for path, body in VALID.items():
        response = client.post(path, json=body)
        assert response.status_code == 200, response.text
    assert live_router.dispatches() == before + len(VALID)
