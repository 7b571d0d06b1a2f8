"""etcd discovery: the fleet is the set of worker records under a key prefix.

The router lists the prefix, then watches it from the next revision. A watch that breaks
resumes from the last revision seen, so a blip costs one small request, not a relist; a
watch whose revision was compacted away relists. While etcd does not answer, the router
keeps routing to the last fleet it knew and says so on `/health` and in
`router_discovery_up`: an unreachable etcd never empties the fleet. A frozen etcd (the
connection open, nothing answering) is caught by silence: every message on the watch
(events, progress notifications) and every answered call is a sign of life, a probe is sent
after half of `--discovery-silence-s` without one, and the whole window without one
reports discovery down until etcd is heard again.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from contextlib import aclosing
from dataclasses import dataclass

import orjson
import trio

from router.discovery import DiscoveryHealth
from router.discovery.etcd_client import (
    EtcdClient,
    EtcdError,
    KeyValue,
    WatchCompacted,
    WatchEvent,
    open_etcd_client,
)
from router.discovery.liveness import SilenceWatch
from router.fleet.records import InvalidWorkerRecord, WorkerRecord
from router.fleet.registry import Fleet
from router.http.backoff import Backoff
from router.observability.metrics import DiscoveryMetrics

log = logging.getLogger("router.discovery.etcd")

# A range under the prefix that no worker id starts with: reading it is the cheapest call
# that proves etcd answers, without relisting the fleet.
_PROBE_SUFFIX = "\x00probe"


@dataclass(frozen=True, slots=True)
class EtcdDiscoveryTiming:
    """Retry delays and the watch's silence bound.

    `watch_idle_timeout_s` should be a few of etcd's progress-notify intervals: a watch
    that hears nothing for that long is taken for a half-open connection and resumed.
    """

    backoff_initial_s: float = 0.1
    backoff_max_s: float = 5.0
    watch_idle_timeout_s: float = 30.0
    request_timeout_s: float = 5.0
    silence_s: float = 15.0
    """No sign of life for this long (watch message, progress notification, answered
    call) reports discovery down; half of it without one sends a probe."""


def parse_record(value: bytes) -> WorkerRecord:
    """A worker record from an etcd value; InvalidWorkerRecord says why it cannot be used."""
    try:
        data = orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        raise InvalidWorkerRecord(f"the value is not JSON ({exc})") from None
    return WorkerRecord.from_json(data)


class FleetMirror:
    """Keeps the fleet equal to the valid records under the prefix, and knows which key
    holds which worker (a DELETE event names only the key).

    A malformed value is logged (once per key and value, however many relists see it)
    and skipped; when it overwrites a valid record, that worker leaves the fleet, as it
    would on a relist. Two keys claiming one worker id are an operator error: the latest
    write wins and a warning names both keys.
    """

    def __init__(self, fleet: Fleet, metrics: DiscoveryMetrics) -> None:
        self._fleet = fleet
        self._metrics = metrics
        self._records: dict[str, WorkerRecord] = {}
        # The refused value per key: a relist (after compaction or a lost watch) finds
        # the same bad record again, and the operator was already told about it.
        self._refused: dict[str, bytes] = {}

    def relist(self, kvs: Iterable[KeyValue], revision: int) -> None:
        """Make the fleet exactly the valid records of a listing taken at `revision`."""
        records: dict[str, WorkerRecord] = {}
        refused: dict[str, bytes] = {}
        for kv in kvs:
            try:
                records[kv.key] = parse_record(kv.value)
            except InvalidWorkerRecord as exc:
                if self._refused.get(kv.key) != kv.value:
                    log.warning("skipping the malformed worker record at %s: %s", kv.key, exc)
                refused[kv.key] = kv.value
        self._refused = refused
        before = {worker.id for worker in self._fleet.workers()}
        self._records = records
        self._fleet.replace_all(records.values())
        after = {worker.id for worker in self._fleet.workers()}
        log.info(
            "listed %d worker(s) at revision %d (%d joined, %d left)",
            len(after),
            revision,
            len(after - before),
            len(before - after),
        )

    def apply(self, event: WatchEvent) -> None:
        """Apply one PUT or DELETE to the fleet."""
        kind = "put" if event.type == "PUT" else "delete"
        self._metrics.count_event(kind)
        if event.type == "DELETE":
            self._refused.pop(event.key, None)
            self._forget(event.key)
            return
        try:
            record = parse_record(event.value)
        except InvalidWorkerRecord as exc:
            self._refuse(event.key, event.value, exc)
            self._forget(event.key)
            return
        self._refused.pop(event.key, None)
        previous = self._records.get(event.key)
        if previous is not None and previous.id != record.id:
            self._forget(event.key)
        for key, other in self._records.items():
            if other.id == record.id and key != event.key:
                log.warning(
                    "worker id %s is claimed by %s and %s; the latest write wins",
                    record.id,
                    key,
                    event.key,
                )
                break
        self._records[event.key] = record
        known = self._fleet.get(record.id)
        self._fleet.upsert(record)
        if known is None:
            log.info(
                "worker %s joined: %s, model %s, role %s, %s",
                record.id,
                record.url,
                "+".join(record.models),
                record.role.value,
                record.status.value,
            )
        elif known.record.status is not record.status:
            log.info("worker %s is now %s", record.id, record.status.value)

    def _refuse(self, key: str, value: bytes, exc: InvalidWorkerRecord) -> None:
        """Logs a record that cannot be used, once per key and value."""
        if self._refused.get(key) != value:
            self._refused[key] = value
            log.warning("skipping the malformed worker record at %s: %s", key, exc)

    def _forget(self, key: str) -> None:
        record = self._records.pop(key, None)
        if record is None:
            return
        # Another key may still describe the same worker; only the last one removes it.
        survivor = next((r for r in self._records.values() if r.id == record.id), None)
        if survivor is not None:
            self._fleet.upsert(survivor)
        elif self._fleet.remove(record.id) is not None:
            log.info("worker %s left (%s)", record.id, key)


class _Link:
    """What the router says about its link to etcd, on `/health` and in the metric."""

    def __init__(self, health: DiscoveryHealth, metrics: DiscoveryMetrics, fleet: Fleet) -> None:
        self.health = health
        self._metrics = metrics
        self._fleet = fleet
        self._lost = False

    def up(self, detail: str) -> None:
        if self._lost:
            log.info("etcd answers again: %s", detail)
            self._lost = False
        self.health.up = True
        self.health.detail = detail
        self._metrics.report_up(True)

    @property
    def lost(self) -> bool:
        return self._lost

    def silent(self, quiet_s: float) -> None:
        """etcd said nothing for `quiet_s`: a frozen etcd or a half-open connection."""
        detail = (
            f"etcd silent for {quiet_s:.1f}s (no watch event, progress notification or "
            f"answered probe); routing to the last known fleet of {len(self._fleet)} worker(s)"
        )
        if not self._lost:
            log.warning("%s", detail)
        self._lost = True
        self.health.up = False
        self.health.detail = detail
        self._metrics.report_up(False)

    def down(self, reason: str, retry_in_s: float) -> None:
        detail = (
            f"etcd unreachable ({reason}); routing to the last known fleet of "
            f"{len(self._fleet)} worker(s)"
        )
        if not self._lost:
            log.warning("%s; retrying with backoff", detail)
        else:
            log.debug("%s; retrying in %.1fs", detail, retry_in_s)
        self._lost = True
        self.health.up = False
        self.health.detail = detail
        self._metrics.report_up(False)


async def serve_etcd_discovery(
    endpoint: str,
    prefix: str,
    fleet: Fleet,
    metrics: DiscoveryMetrics,
    *,
    timing: EtcdDiscoveryTiming = EtcdDiscoveryTiming(),
    task_status: trio.TaskStatus[DiscoveryHealth] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Follow the worker records under `prefix` at etcd `endpoint` until cancelled.

    Ready after the first successful listing; when etcd cannot be reached at start, ready
    at once with an empty fleet and `up=False`, and the listing is retried. Failures are
    retried with backoff (`timing`), resuming the watch from the last revision seen; a
    compacted revision relists. The fleet is only ever changed by what etcd says, never
    emptied because etcd is silent.

    Cancellation: the watch stream is closed; the fleet keeps its last state.
    """
    health = DiscoveryHealth(source="etcd", up=False, detail=f"connecting to {endpoint}")
    metrics.report_up(False)
    async with open_etcd_client(endpoint, timeout_s=timing.request_timeout_s) as client:
        follower = _Follower(client, prefix, fleet, metrics, health, timing)
        await follower.run(task_status)


class _Follower:
    """The list-then-watch loop and the little state it carries between attempts."""

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        fleet: Fleet,
        metrics: DiscoveryMetrics,
        health: DiscoveryHealth,
        timing: EtcdDiscoveryTiming,
    ) -> None:
        self._client = client
        self._prefix = prefix
        self._metrics = metrics
        self._timing = timing
        self._health = health
        self._link = _Link(health, metrics, fleet)
        self._mirror = FleetMirror(fleet, metrics)
        self._backoff = Backoff(timing.backoff_initial_s, timing.backoff_max_s)
        self.revision: int | None = None
        """The revision the fleet reflects; None until the prefix is listed."""
        self._confirmed = False
        """etcd answered a unary call since the last failure."""
        self._silence = SilenceWatch(
            timing.silence_s,
            lambda: client.get_prefix(prefix + _PROBE_SUFFIX),
            (EtcdError,),
            self._went_silent,
            self._spoke_again,
        )

    async def run(self, task_status: trio.TaskStatus[DiscoveryHealth]) -> None:
        """Follow etcd, with the silence watch (and its probe) beside the watch.

        Cancellation: the watch and any probe in flight are closed; the fleet stays.
        """
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._silence.serve)
            await self._follow(task_status)

    def _went_silent(self, quiet_s: float) -> None:
        if not self._link.lost:  # an unreachable etcd already says so, more precisely
            self._link.silent(quiet_s)

    def _spoke_again(self) -> None:
        if self._link.lost:
            self._link.up(f"watching {self._prefix} after revision {self.revision}")

    async def _follow(self, task_status: trio.TaskStatus[DiscoveryHealth]) -> None:
        reported = False
        while True:
            watch_opened: float | None = None
            try:
                await self._confirm()
                if not reported:
                    task_status.started(self._health)
                    reported = True
                watch_opened = trio.current_time()
                await self._watch()
            except WatchCompacted as exc:
                self._metrics.count_relist()
                log.warning(
                    "watch from revision %s is compacted (etcd keeps history from %d): relisting",
                    None if self.revision is None else self.revision + 1,
                    exc.compact_revision,
                )
                self.revision = None
            except EtcdError as exc:
                self._confirmed = False
                if watch_opened is not None and (
                    trio.current_time() - watch_opened >= self._timing.backoff_max_s
                ):
                    self._backoff.reset()  # the watch was healthy for a while
                delay = self._backoff.failure()
                if watch_opened is not None:
                    # A broken watch alone proves nothing (an idle timeout, a stream etcd
                    # dropped): the probe before the next watch decides whether etcd is down.
                    log.debug("watch ended (%s); resuming after revision %s", exc, self.revision)
                else:
                    self._link.down(exc.message, delay)
                    if not reported:
                        log.warning(
                            "etcd is unreachable at start: serving an empty fleet and "
                            "retrying until it answers"
                        )
                        task_status.started(self._health)
                        reported = True
                await trio.sleep(delay)

    async def _confirm(self) -> None:
        """List the prefix when the fleet reflects no revision yet; otherwise, after a
        failure, prove etcd answers with the cheapest read before watching again."""
        if self.revision is None:
            listing = await self._client.get_prefix(self._prefix)
            self._mirror.relist(listing.kvs, listing.revision)
            self.revision = listing.revision
            self._backoff.reset()
        elif not self._confirmed:
            await self._client.get_prefix(self._prefix + _PROBE_SUFFIX)
        self._confirmed = True
        self._silence.heard()
        self._link.up(f"watching {self._prefix} after revision {self.revision}")

    async def _watch(self) -> None:
        """Apply events after `self.revision`, advancing it, until the watch fails."""
        assert self.revision is not None
        watch = self._client.watch_prefix(
            self._prefix,
            self.revision + 1,
            idle_timeout_s=self._timing.watch_idle_timeout_s,
            on_alive=self._silence.heard,
        )
        async with aclosing(watch):
            async for batch in watch:
                for event in batch:
                    self._mirror.apply(event)
                self.revision = max(self.revision, batch[-1].mod_revision)
                self._backoff.reset()
