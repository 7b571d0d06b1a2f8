"""A worker's own record in etcd: registering it, keeping it alive, and leaving cleanly.

`router agent` and `router fake-worker --register` both run `run_registered`, so the
fake exercises the exact code a production engine's agent runs: register under a lease,
heartbeat at a third of its TTL, register again when the lease is lost, and on SIGTERM
announce DRAINING -> wait until the engine holds no work -> stop heartbeats -> revoke.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial

import orjson
import trio

from router.agent.drain import DrainReport, DrainSettings, wait_engine_idle
from router.discovery.etcd_client import EtcdClient, EtcdError, EtcdUnavailable, open_etcd_client
from router.engines.metrics import EngineLoad
from router.fleet.records import Status, WorkerRecord
from router.http.backoff import Backoff

log = logging.getLogger("router.agent.registration")

DEFAULT_PREFIX = "/router/workers/"
DEFAULT_LEASE_TTL_S = 30
CLEANUP_TIMEOUT_S = 5.0

ReadLoad = Callable[[], Awaitable[EngineLoad]]


def registration_key(prefix: str, worker_id: str) -> str:
    """The key a worker's record lives at: `prefix` (as a folder) then the worker id."""
    return (prefix if prefix.endswith("/") else prefix + "/") + worker_id


@dataclass(frozen=True, slots=True)
class RegistrationStatistics:
    lease_id: int | None
    grants: int
    writes: int
    heartbeats: int
    lease_losses: int


class Registration:
    """One worker's record at `key`, attached to a lease that heartbeats keep alive.

    Made by `serve_registration`, which runs the heartbeat; this handle announces the
    drain and deregisters. Writes (registering, re-registering, announcing) are serialized,
    and none happens once deregistration began.
    """

    def __init__(
        self, client: EtcdClient, key: str, record: WorkerRecord, lease_ttl_s: int
    ) -> None:
        self._client = client
        self.key = key
        self.record = record
        self.lease_ttl_s = lease_ttl_s
        self.heartbeat_interval_s = lease_ttl_s / 3
        self.lease_id: int | None = None
        self._grants = self._writes = self._heartbeats = self._lease_losses = 0
        self._write_lock = trio.Lock()
        self._closed = False
        self._serving = True
        self._heartbeat_scope = trio.CancelScope()
        self._heartbeat_stopped = trio.Event()
        self._deregistered = trio.Event()

    def statistics(self) -> RegistrationStatistics:
        return RegistrationStatistics(
            lease_id=self.lease_id,
            grants=self._grants,
            writes=self._writes,
            heartbeats=self._heartbeats,
            lease_losses=self._lease_losses,
        )

    async def announce_draining(self, timeout_s: float = CLEANUP_TIMEOUT_S) -> bool:
        """Rewrite the record with status DRAINING under the same lease (a new one if it
        was lost), retrying for up to `timeout_s`. False, logged as an error, when etcd did
        not take it: routers then keep sending new work until the worker deregisters.

        Cancellation: the write may or may not have landed.
        """
        self.record = dataclasses.replace(self.record, status=Status.DRAINING)
        with trio.move_on_after(timeout_s):
            return await self._write_with_retry("announcing DRAINING")
        log.error(
            "could not announce DRAINING for %s within %.1fs: routers keep sending it new "
            "work until it deregisters",
            self.key,
            timeout_s,
        )
        return False

    async def deregister(self, timeout_s: float = CLEANUP_TIMEOUT_S) -> bool:
        """Stop the heartbeat first, then revoke the lease, which deletes the key.

        Runs shielded and bounded by `timeout_s`, so it completes even while the caller is
        being cancelled. True when etcd confirmed the revoke; otherwise an error is logged
        and the key stays until its lease expires (at most the TTL).
        """
        started = trio.current_time()
        revoked = False
        try:
            with trio.move_on_after(timeout_s, shield=True):
                self._closed = True
                # A heartbeat running after the revoke would register the worker again.
                self._heartbeat_scope.cancel()
                await self._heartbeat_stopped.wait()
                async with self._write_lock:
                    revoked = await self._revoke_with_retry()
        finally:
            self._deregistered.set()
        if revoked:
            log.info(
                "deregistered %s: heartbeat stopped, lease revoked, key deleted (%.3fs)",
                self.key,
                trio.current_time() - started,
            )
        else:
            log.error(
                "could not revoke the lease of %s within %.1fs: the key stays until the lease "
                "expires (TTL %ds)",
                self.key,
                timeout_s,
                self.lease_ttl_s,
            )
        return revoked

    async def _revoke_with_retry(self) -> bool:
        lease = self.lease_id
        if lease is None:
            return True  # lost and not granted again: the key is already gone
        if not self._serving:
            return False  # the etcd client closed with `serve_registration`
        backoff = Backoff()
        while True:
            try:
                await self._client.revoke_lease(lease)
            except EtcdError as exc:
                delay = backoff.failure()
                log.warning("revoking the lease of %s failed (%s); retrying", self.key, exc.message)
                await trio.sleep(delay)
                continue
            self.lease_id = None
            return True

    async def _write_once(self) -> None:
        """Put the record under the current lease, granting one first when there is none;
        a lease etcd no longer knows (it expired while etcd was out of reach) is replaced."""
        value = orjson.dumps(self.record.to_json())
        if self.lease_id is None:
            self.lease_id = await self._client.grant_lease(self.lease_ttl_s)
            self._grants += 1
        try:
            await self._client.put(self.key, value, lease=self.lease_id)
        except EtcdUnavailable:
            raise
        except EtcdError as exc:
            log.warning(
                "writing %s under lease %x failed (%s); granting a new lease",
                self.key,
                self.lease_id,
                exc.message,
            )
            self.lease_id = await self._client.grant_lease(self.lease_ttl_s)
            self._grants += 1
            await self._client.put(self.key, value, lease=self.lease_id)
        self._writes += 1

    async def _write_with_retry(self, what: str) -> bool:
        """Write the record until etcd takes it (True), retrying every etcd error with
        backoff; False, without writing, once deregistration began."""
        backoff = Backoff()
        while True:
            try:
                async with self._write_lock:
                    if self._closed:
                        return False
                    await self._write_once()
                return True
            except EtcdError as exc:
                delay = backoff.failure()
                log.warning(
                    "%s of %s failed (%s); retrying in %.1fs", what, self.key, exc.message, delay
                )
                await trio.sleep(delay)

    async def _heartbeat_forever(self) -> None:
        """Keep the lease alive every third of its TTL; register again when it is gone.

        Failed keepalives are retried with backoff capped at the heartbeat interval, so a
        short etcd outage costs no registration.
        """
        backoff = Backoff(min(0.1, self.heartbeat_interval_s), self.heartbeat_interval_s)
        delay = self.heartbeat_interval_s
        failing = False
        while True:
            await trio.sleep(delay)
            lease = self.lease_id
            try:
                ttl = None if lease is None else await self._client.keepalive_once(lease)
            except EtcdError as exc:
                delay = backoff.failure()
                if not failing:
                    log.warning(
                        "heartbeat of %s failed (%s); retrying while the lease lasts",
                        self.key,
                        exc.message,
                    )
                failing = True
                continue
            if failing:
                log.info("heartbeat of %s works again", self.key)
            failing = False
            backoff.reset()
            delay = self.heartbeat_interval_s
            if ttl is not None:
                self._heartbeats += 1
                continue
            self._lease_losses += 1
            log.warning("the lease of %s is gone (expired); registering again", self.key)
            async with self._write_lock:
                if self.lease_id == lease:
                    self.lease_id = None
            await self._write_with_retry("registering again")


async def serve_registration(
    etcd_endpoint: str,
    prefix: str,
    record: WorkerRecord,
    *,
    lease_ttl_s: int = DEFAULT_LEASE_TTL_S,
    task_status: trio.TaskStatus[Registration] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Register `record` at `prefix` + its id under a lease, and keep it registered.

    Reports the `Registration` once the record is in etcd; until then every etcd error is
    retried with backoff, indefinitely. Returns after `Registration.deregister()`.

    Cancellation: heartbeats stop and nothing is revoked, so the key vanishes when the
    lease expires, exactly as after a crash.
    """
    if lease_ttl_s < 1:
        raise ValueError(f"lease_ttl_s must be >= 1, got {lease_ttl_s}")
    timeout_s = min(CLEANUP_TIMEOUT_S, max(1.0, lease_ttl_s / 3))
    async with open_etcd_client(etcd_endpoint, timeout_s=timeout_s) as client:
        registration = Registration(
            client, registration_key(prefix, record.id), record, lease_ttl_s
        )
        try:
            try:
                await registration._write_with_retry("registration")
                log.info(
                    "registered %s at %s (lease %x, TTL %ds, heartbeat every %.1fs)",
                    record.url,
                    registration.key,
                    registration.lease_id,
                    lease_ttl_s,
                    registration.heartbeat_interval_s,
                )
                task_status.started(registration)
                with registration._heartbeat_scope:
                    await registration._heartbeat_forever()
            finally:
                registration._heartbeat_stopped.set()
            # Only deregister() cancels the heartbeat scope; it revokes through this client,
            # so the client stays open until it is done (deregister is bounded).
            with trio.CancelScope(shield=True):
                await registration._deregistered.wait()
        finally:
            registration._serving = False


@dataclass(frozen=True, slots=True)
class DrainOutcome:
    announced: bool
    announce_s: float
    drain: DrainReport
    deregistered: bool
    deregister_s: float
    total_s: float


async def drain_and_deregister(
    registration: Registration, read_load: ReadLoad, drain_settings: DrainSettings
) -> DrainOutcome:
    """The SIGTERM sequence: announce DRAINING -> wait until the engine holds no work (see
    `wait_engine_idle`) -> stop heartbeats -> revoke the lease. Logs each step's timing.

    The engine keeps serving throughout; stopping it is the caller's next step.
    Cancellation (a second signal): the wait stops, the worker still deregisters (shielded,
    bounded), then the cancellation goes on.
    """
    started = trio.current_time()
    worker = registration.record.id
    try:
        log.info("drain of %s: announcing DRAINING", worker)
        announced = await registration.announce_draining()
        announced_at = trio.current_time()
        if announced:
            log.info(
                "drain of %s: DRAINING announced in %.3fs; waiting for the engine to hold no "
                "work (settle %.1fs, timeout %.0fs)",
                worker,
                announced_at - started,
                drain_settings.settle_s,
                drain_settings.timeout_s,
            )
        report = await wait_engine_idle(read_load, drain_settings)
    finally:
        deregister_started = trio.current_time()
        deregistered = await registration.deregister()
        finished = trio.current_time()
    log.info(
        "drain of %s finished in %.2fs: announce %.3fs, engine %s after %.2fs, deregister %.3fs",
        worker,
        finished - started,
        announced_at - started,
        report.result.value,
        report.waited_s,
        finished - deregister_started,
    )
    return DrainOutcome(
        announced=announced,
        announce_s=announced_at - started,
        drain=report,
        deregistered=deregistered,
        deregister_s=finished - deregister_started,
        total_s=finished - started,
    )


async def _cancel_when_set(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


async def run_registered(
    etcd_endpoint: str,
    prefix: str,
    record: WorkerRecord,
    *,
    lease_ttl_s: int,
    read_load: ReadLoad,
    drain_settings: DrainSettings,
    signals: AsyncIterator[int],
    before_registering: Callable[[], Awaitable[WorkerRecord | None]] | None = None,
) -> DrainOutcome | None:
    """Register `record` (after `before_registering`, e.g. the engine's health, which may
    return the record to register instead: say, with the engine's kind it learned), keep
    it registered, and on the first signal from `signals` drain and deregister it.

    Returns the drain's outcome, or None when it did not complete: a signal arrived before
    the worker was registered (nothing to drain), or a second signal cut the drain's wait
    short (the worker still deregistered). The engine is left running either way.

    Cancellation: as for `serve_registration`, the lease is left to expire.
    """
    signalled = trio.Event()
    cut_short = trio.CancelScope()

    async def watch_signals() -> None:
        async for signum in signals:
            name = signal.Signals(signum).name
            if signalled.is_set():
                log.warning("%s again: the drain of %s stops waiting", name, record.id)
                cut_short.cancel()
            else:
                log.info("%s: draining %s before it leaves", name, record.id)
            signalled.set()

    outcome: DrainOutcome | None = None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch_signals)
        registration: Registration | None = None
        with trio.CancelScope() as registering:
            nursery.start_soon(_cancel_when_set, signalled, registering)
            if before_registering is not None:
                record = await before_registering() or record
            registration = await nursery.start(
                partial(serve_registration, etcd_endpoint, prefix, record, lease_ttl_s=lease_ttl_s)
            )
        if registration is None:
            log.info("%s was not registered yet: nothing to drain", record.id)
        else:
            await signalled.wait()
            with cut_short:
                outcome = await drain_and_deregister(registration, read_load, drain_settings)
        nursery.cancel_scope.cancel()
    return outcome
