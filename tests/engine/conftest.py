"""Real vLLM engines for the tests in this folder, started once per module.

Every test here is marked `engine` (`make test` leaves them out; `make engine-test` builds
the engine environment and runs them). An engine takes about a minute and 1-2 GB to
start, so a module starts its engines once: pytest-trio runs each test in a trio loop of
its own and accepts only function-scoped async fixtures, so the engines live in a trio
loop on a thread of their own (`EngineHost`), from the module's first test to its last.
`kill`, `stop` and `resume` only send signals and may be called from any thread;
`restart` runs in the host's loop (`await host.restart(engine)`).
"""

from __future__ import annotations

import atexit
import os
import signal
import threading
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path

import pytest
import trio

from conformance.engines import Engine, EngineSettings, open_engines

HOST_EXIT_TIMEOUT_S = 30.0


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.engine)


# Process groups of engines alive right now, killed at interpreter exit whatever happened
# to the host thread (a pytest killed by a second Ctrl-C still runs atexit handlers).
_LIVE_GROUPS: set[int] = set()


@atexit.register
def _kill_live_groups() -> None:
    for pgid in list(_LIVE_GROUPS):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class EngineHost:
    """Engines held by a trio loop on a thread of their own, for module-scoped fixtures.

    Entering starts every engine (concurrently) and returns once all are healthy, or
    raises what went wrong; leaving kills every process group and joins the thread.
    """

    def __init__(self, settings: Sequence[EngineSettings], *, name: str) -> None:
        self.settings = list(settings)
        self.name = name
        self.engines: list[Engine] = []
        self.startup_s = 0.0
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._done: trio.Event | None = None
        self._thread = threading.Thread(target=self._main, name=f"engine-host-{name}", daemon=True)

    def __enter__(self) -> EngineHost:
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join(HOST_EXIT_TIMEOUT_S)
            raise self._error
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._token is not None and self._done is not None:
            try:
                trio.from_thread.run_sync(self._done.set, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        self._thread.join(HOST_EXIT_TIMEOUT_S)

    def _main(self) -> None:
        try:
            trio.run(self._serve)
        except BaseException as exc:  # reported to the fixture's thread by __enter__
            self._error = exc
        finally:
            self._ready.set()

    async def _serve(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._done = trio.Event()
        started = trio.current_time()
        async with open_engines(self.settings, name=self.name) as engines:
            self.engines = engines
            self.startup_s = trio.current_time() - started
            for engine in engines:
                _LIVE_GROUPS.add(engine.pid)
            print(f"\n{self.name}: {len(engines)} engines healthy in {self.startup_s:.1f} s")
            self._ready.set()
            try:
                await self._done.wait()
            finally:
                for engine in engines:
                    _LIVE_GROUPS.discard(engine.pid)

    def _in_host(self, function: Callable[[], Awaitable[None]]) -> None:
        assert self._token is not None
        trio.from_thread.run(function, trio_token=self._token)

    async def restart(self, engine: Engine) -> float:
        """Kill `engine` (if it runs) and start it again on its port; the seconds it took."""
        started = trio.current_time()
        _LIVE_GROUPS.discard(engine.pid)
        await trio.to_thread.run_sync(self._in_host, engine.restart)
        _LIVE_GROUPS.add(engine.pid)
        return trio.current_time() - started

    async def ensure_running(self, engine: Engine) -> None:
        """Restart `engine` if an earlier test killed it; resume it if one stopped it."""
        engine.resume()
        if engine.exited:
            await self.restart(engine)


def host_engines(settings: Sequence[EngineSettings], *, name: str) -> Iterator[EngineHost]:
    """The body of a module-scoped engine fixture."""
    with EngineHost(settings, name=name) as host:
        yield host
