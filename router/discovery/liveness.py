"""Telling a live etcd from a silent one.

A stopped etcd process, a stalled disk or a partition that drops packets keeps the
watch's TCP connection open and says nothing: no error ever arrives. So silence itself is
the signal. Every sign of life (a watch message, a progress notification, an answered
call) resets the clock; after half the window without one a cheap probe is sent (etcd's
default progress-notify interval is 10 minutes, so a quiet watch alone says nothing for
that long); after the whole window without one, the source is reported silent until it
is heard again.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio


class SilenceWatch:
    """Reports silence after `silence_s` without a sign of life, and the voice after it.

    `probe` is the cheapest call that proves the source answers; it may raise any
    `probe_errors` (they are the watch loop's to judge, not this one's). `on_silent(quiet_s)`
    and `on_voice()` are called once per silence, in turn.
    """

    def __init__(
        self,
        silence_s: float,
        probe: Callable[[], Awaitable[object]],
        probe_errors: tuple[type[Exception], ...],
        on_silent: Callable[[float], None],
        on_voice: Callable[[], None],
    ) -> None:
        self._silence_s = silence_s
        self._probe = probe
        self._probe_errors = probe_errors
        self._on_silent = on_silent
        self._on_voice = on_voice
        self._last_heard = trio.current_time()
        self._silent = False
        self._voice = trio.Event()

    @property
    def silent(self) -> bool:
        return self._silent

    def heard(self) -> None:
        """A sign of life: an event, a progress notification, an answer. O(1)."""
        self._last_heard = trio.current_time()
        if self._silent:
            self._silent = False
            self._voice.set()
            self._on_voice()

    async def serve(self) -> None:
        """Watch for silence and probe a quiet source, until cancelled.

        Cancellation: a probe in flight is cancelled; nothing is reported.
        """
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._report_silence)
            nursery.start_soon(self._probe_when_quiet)

    async def _report_silence(self) -> None:
        while True:
            await trio.sleep_until(self._last_heard + self._silence_s)
            # Compared as the same sum it slept until: `now - last < window` can be true
            # by one rounding step at the very deadline, and would spin.
            if trio.current_time() < self._last_heard + self._silence_s:
                continue  # heard meanwhile
            quiet_s = trio.current_time() - self._last_heard
            self._silent = True
            self._voice = trio.Event()
            self._on_silent(quiet_s)
            await self._voice.wait()

    async def _probe_when_quiet(self) -> None:
        """At most one probe per half window, each bounded by it."""
        half_s = self._silence_s / 2
        while True:
            await trio.sleep_until(self._last_heard + half_s)
            started = trio.current_time()
            if started < self._last_heard + half_s:
                continue  # heard meanwhile
            with trio.move_on_after(half_s):
                try:
                    await self._probe()
                except self._probe_errors:
                    pass
                else:
                    self.heard()
            await trio.sleep_until(started + half_s)
