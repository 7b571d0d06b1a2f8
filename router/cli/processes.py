"""`router serve --processes N`: N router processes sharing one port.

The parent binds nothing: it starts N children, `router serve <same flags> --processes 1
--reuse-port`, and each child binds the port with SO_REUSEPORT, so the kernel spreads new
connections among them. Each child is a whole router: its own upstream pool, breaker
state, health checks and discovery watch; they share nothing but the port. A worker's
breaker may thus be open in one process and closed in another, and `/metrics` answers for
the one process a scrape happens to reach.

Signals: the children run in a session of their own (a terminal's Ctrl-C reaches only the
parent), and the parent forwards SIGTERM and SIGINT to each, so the first signal drains
and a second stops at once, as with one process. When a child exits on its own, the
others are told to drain and the parent exits with the first failing status.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from functools import partial

import trio

from router.cli.config import Settings

log = logging.getLogger("router")


def child_command(argv: Sequence[str]) -> list[str]:
    """The command line of one child: the parent's flags, then the two that override
    `--processes` (the last occurrence of a flag wins) and ask for a shared port.
    """
    return [sys.executable, "-m", "router.cli", "serve", *argv, "--processes", "1", "--reuse-port"]


def run_processes(settings: Settings, argv: Sequence[str]) -> int:
    """Run `settings.processes` children until they stop; returns the exit status.

    Port 0 cannot be shared (each process would get a port of its own), so it is refused
    with status 2.
    """
    if settings.port == 0:
        print(
            f"router serve: --processes {settings.processes} needs an explicit --port "
            "(with port 0 each process would listen on a different port)",
            file=sys.stderr,
        )
        return 2
    log.info(
        "starting %d router processes sharing http://%s:%d",
        settings.processes,
        settings.host,
        settings.port,
    )
    return trio.run(
        partial(
            supervise, child_command(argv), settings.processes, reload=bool(settings.api_keys_file)
        )
    )


async def supervise(command: list[str], count: int, *, reload: bool = False) -> int:
    """Run `count` copies of `command`, forwarding SIGTERM/SIGINT to each (and SIGHUP, the
    keys file's reload, when `reload`: a child without a keys file would die of it).

    Returns 0 when every child exited 0, else the first non-zero status in exit order.
    Cancellation: children still running are killed.
    """
    processes: list[trio.Process] = []
    statuses: list[int] = []
    try:
        watched = (
            (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
            if reload
            else (signal.SIGTERM, signal.SIGINT)
        )
        with trio.open_signal_receiver(*watched) as signals:
            for _ in range(count):
                processes.append(
                    await trio.lowlevel.open_process(
                        command, start_new_session=True, stdin=subprocess.DEVNULL
                    )
                )
            async with trio.open_nursery() as nursery:
                stopping = _Stopping(processes)
                nursery.start_soon(_forward_signals, signals, stopping)
                async with trio.open_nursery() as waits:
                    for process in processes:
                        waits.start_soon(_wait_child, process, stopping, statuses)
                nursery.cancel_scope.cancel()
    finally:
        for process in processes:
            if process.returncode is None:
                process.kill()
    return next((status for status in statuses if status != 0), 0)


_KILLED_BY_FORWARDED_SIGNAL = frozenset({-signal.SIGTERM, -signal.SIGINT})


class _Stopping:
    """Whether the children were already told to drain, so a child that finished its drain
    does not turn the parent's one signal into a second one for its siblings.
    """

    def __init__(self, processes: list[trio.Process]) -> None:
        self.processes = processes
        self.signalled = False

    def send(self, signum: int) -> None:
        self.signalled = True
        for process in self.processes:
            if process.returncode is None:
                process.send_signal(signum)


async def _forward_signals(signals: AsyncIterator[int], stopping: _Stopping) -> None:
    async for signum in signals:
        log.info(
            "%s: passing it to %d router processes",
            signal.Signals(signum).name,
            len(stopping.processes),
        )
        if signum == signal.SIGHUP:
            for process in stopping.processes:  # a reload, not a stop
                if process.returncode is None:
                    process.send_signal(signum)
            continue
        stopping.send(signum)


async def _wait_child(process: trio.Process, stopping: _Stopping, statuses: list[int]) -> None:
    status = await process.wait()
    if stopping.signalled and status in _KILLED_BY_FORWARDED_SIGNAL:
        # A child still starting up has no signal handler yet, so the forwarded signal's
        # default action ends it. It had not begun to listen, so no request was cut:
        # it stopped as it was asked to.
        status = 0
    statuses.append(status)
    if not stopping.signalled:
        log.warning(
            "router process %d exited with status %d; stopping the others", process.pid, status
        )
        stopping.send(signal.SIGTERM)
