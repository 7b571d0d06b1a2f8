"""A stream of requests kept going against a router while a test makes something happen.

A worker drains, discovery changes, an engine is killed: the test runs
`Traffic.keep_sending` in a nursery across the event and asserts on what it tallied. The
loop is bounded twice: it ends when `stop` is set or `until` passes, and after `most`
requests whatever else happens, so a test whose event never comes ends on its count (and
fails on what it counted) rather than spinning until its guard. `repeat` is the bare loop,
for a stream that is not one httpx request at a time (the soak's raw sockets).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial

import httpx
import trio

# A steady flow across a rolling update: this many clients, each a request this often.
STEADY_CLIENTS = 3
STEADY_PACE_S = 0.05


async def repeat(
    action: Callable[[], Awaitable[object]],
    *,
    most: int,
    stop: trio.Event | None = None,
    until: float | None = None,
    pace_s: float = 0.0,
) -> int:
    """Await `action()` again and again; returns how many times it ran.

    Before each run: `most` runs done, `stop` set or `until` (trio time) passed ends the
    loop; a run under way when `stop` is set runs to its end. After each run it waits
    `pace_s` (cut short by `stop`): a steady flow across an event, rather than a flood.
    Cancellation: the run under way is cancelled; nothing else is left behind.
    """
    runs = 0
    while runs < most and not _stopped(stop, until):
        await action()
        runs += 1
        if pace_s > 0 and runs < most:
            await _pause(pace_s, stop)
    return runs


def _stopped(stop: trio.Event | None, until: float | None) -> bool:
    return (stop is not None and stop.is_set()) or (
        until is not None and trio.current_time() >= until
    )


async def _pause(seconds: float, stop: trio.Event | None) -> None:
    if stop is None:
        await trio.sleep(seconds)
        return
    with trio.move_on_after(seconds):
        await stop.wait()


@dataclass(frozen=True, slots=True)
class Answer:
    """One request of the stream: when it went out, what came back and who served it."""

    sent_at: float
    took_s: float
    status: int
    worker: str | None  # the router's `x-router-worker`
    ok: bool


def answered_200(response: httpx.Response) -> bool:
    return response.status_code == 200


@dataclass
class Traffic:
    """Everything a stream of requests got back, in the order the answers came."""

    answers: list[Answer] = field(default_factory=list)
    # Transport errors tolerated by `keep_sending`, by type name.
    errors: Counter[str] = field(default_factory=Counter)
    # Each answer that was not ok and each tolerated error, with enough to tell why.
    failures: list[str] = field(default_factory=list)

    def statuses(self) -> list[int]:
        return [answer.status for answer in self.answers]

    def workers(self) -> list[str | None]:
        return [answer.worker for answer in self.answers]

    def served_by(self, worker: str) -> int:
        return sum(1 for answer in self.answers if answer.worker == worker)

    def tally(self) -> Counter[int | str]:
        """How many answers had each status, and how many requests met each error."""
        found: Counter[int | str] = Counter(self.statuses())
        found.update(self.errors)
        return found

    async def keep_sending(
        self,
        send: Callable[[], Awaitable[httpx.Response]],
        *,
        most: int,
        stop: trio.Event | None = None,
        until: float | None = None,
        pace_s: float = 0.0,
        clients: int = 1,
        ok: Callable[[httpx.Response], bool] = answered_200,
        tolerate: tuple[type[Exception], ...] = (),
    ) -> None:
        """`send` repeated (see `repeat`) in each of `clients` tasks at once, so `most`
        bounds each client; every answer tallied here. Returns when all have ended.

        An answer is ok when `ok(response)` says so. An exception of a `tolerate` type (a
        transport error the test counts rather than fails on) is tallied by its type name;
        any other ends the test.
        Cancellation: the requests under way are dropped untallied.
        """

        async def one() -> None:
            sent_at = trio.current_time()
            try:
                response = await send()
            except tolerate as exc:
                self.errors[type(exc).__name__] += 1
                self.failures.append(repr(exc))
                return
            good = ok(response)
            self.answers.append(
                Answer(
                    sent_at,
                    trio.current_time() - sent_at,
                    response.status_code,
                    response.headers.get("x-router-worker"),
                    good,
                )
            )
            if not good:
                self.failures.append(f"{response.status_code} {response.text[:300]}")

        async with trio.open_nursery() as nursery:
            for _ in range(clients):
                nursery.start_soon(
                    partial(repeat, one, most=most, stop=stop, until=until, pace_s=pace_s)
                )

    async def keep_steady_flow(
        self,
        send: Callable[[], Awaitable[httpx.Response]],
        *,
        stop: trio.Event,
        within_s: float,
    ) -> None:
        """`keep_sending` as a rolling update sees traffic: `STEADY_CLIENTS` clients, each
        a request every `STEADY_PACE_S`, until `stop` is set; each sends at most what fits
        in `within_s` (the test's guard)."""
        await self.keep_sending(
            send,
            clients=STEADY_CLIENTS,
            pace_s=STEADY_PACE_S,
            stop=stop,
            most=math.ceil(within_s / STEADY_PACE_S),
        )
