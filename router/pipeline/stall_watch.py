"""One timer for every relayed stream: a stream whose worker falls silent is ended.

A relay forwards a worker's events one at a time. Giving each read its own trio deadline
(set before the read, lifted before the write to the client, so that a slow client is not
taken for a silent worker) cost two deadline moves per event, a tenth of an event's CPU.
Here a relay only notes when it starts to wait on its worker (`Watched.waiting_since`),
and sets that to infinity while it writes to its client; one task per process looks at
every stream when the earliest of them could be due, and stops each that has been
waiting for `idle_s` or more (`stop`: the relay closes its worker's connection, which
wakes the read; no cancel scope per stream either, whose enter and exit cost a twentieth
of a short stream's instructions). A stream that is writing to its client is never due.

The router runs the watch's task for its whole life (`serve`, started by `run_router`),
so no task is started or ended per stream: at 32 short streams at once, starting a task
whenever the first stream began and ending it with the last cost a tenth of the router's
CPU. A watch used without `serve` (a service embedded in a test) starts a trio system task
with the first stream and ends it with the last. Clock: trio's, so `MockClock` drives it.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from router.http import clock

__all__ = ["StallWatch", "Watched"]


class Watched:
    """One relay's entry: how to stop it, and since when it waits on its worker
    (`math.inf` while it writes to its client)."""

    __slots__ = ("stalled", "stop", "waiting_since")

    def __init__(self, stop: Callable[[], None], now: float) -> None:
        self.stop = stop
        self.waiting_since = now
        # Set when the watch stopped it: the worker was silent for `idle_s`.
        self.stalled = False


class StallWatch:
    """Stops every watched relay that waited on its worker for `idle_s`."""

    __slots__ = ("_entries", "_serving", "_sleep", "idle_s")

    def __init__(self, idle_s: float) -> None:
        self.idle_s = idle_s
        self._entries: set[Watched] = set()
        # True while `serve` runs: then no task is started per stream.
        self._serving = False
        # The on-demand task's current sleep; None while no such task runs.
        self._sleep: trio.CancelScope | None = None

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Watch every stream for as long as this runs (the router's lifetime)."""
        self._serving = True
        task_status.started()
        try:
            while True:
                due = self._expire_due()
                await trio.sleep_until(due)
        finally:
            self._serving = False

    def watch(self, stop: Callable[[], None]) -> Watched:
        """Start watching a relay that `stop()` ends (without a checkpoint); it waits from
        now on."""
        entry = Watched(stop, clock.now())
        self._entries.add(entry)
        if self._sleep is None and not self._serving:
            self._sleep = trio.CancelScope()
            trio.lowlevel.spawn_system_task(
                self._run, self._sleep, name="router.pipeline.stall_watch"
            )
        return entry

    def forget(self, entry: Watched) -> None:
        """The relay ended (any way): stop watching it; the task ends with the last one."""
        self._entries.discard(entry)
        if not self._entries and self._sleep is not None:
            self._sleep.cancel()
            self._sleep = None

    @property
    def watched(self) -> int:
        return len(self._entries)

    async def _run(self, first_sleep: trio.CancelScope) -> None:
        sleep = first_sleep
        try:
            while True:
                due = self._expire_due()
                if not self._entries:
                    return
                with sleep:
                    await trio.sleep_until(due)
                if sleep.cancelled_caught:
                    return
                # A fresh scope for the next sleep: a cancelled one stays cancelled.
                sleep = self._sleep = trio.CancelScope()
        finally:
            if self._sleep is sleep:
                self._sleep = None

    def _expire_due(self) -> float:
        """Cancel every entry that is due; returns when the next one could be."""
        now = clock.now()
        idle_s = self.idle_s
        # An entry not waiting now cannot be due before `idle_s` from now.
        earliest = now
        for entry in list(self._entries):
            since = entry.waiting_since
            if now - since >= idle_s:
                entry.stalled = True
                entry.stop()
                self._entries.discard(entry)
            elif since < earliest:
                earliest = since
        return earliest + idle_s
