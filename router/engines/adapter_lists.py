"""The fleet's reader of the LoRA adapters each engine holds: its model list, refreshed.

One task per worker while it is in the fleet asks the engine's `/v1/models` every
`interval_s` (adapters are loaded and unloaded at run time: vLLM's
`/v1/load_lora_adapter`, its resolvers) and lands the adapters it names
(`router.engines.models`: entries with a `parent`) in the fleet
(`Fleet.learn_adapters`), which plans an adapter's requests over the engines that hold it.
A routing miss (an engine that answered 404 for an adapter it was thought to hold) asks
for that engine's list at once (`refresh`), at most once per `min_refresh_s`.

A read that fails, times out or answers garbage changes nothing: the adapters last read
stay held (a 404 still moves a request elsewhere), and the outcome is counted. The tasks
follow the fleet as the engine load readers do: reconciled when the fleet changes, a
worker that leaves or changes URL has its task cancelled.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import httpx
import orjson
import trio

from router.engines.models import parse_model_list
from router.fleet.registry import Fleet, Worker
from router.http.capped_reads import StreamTooLarge, read_capped

log = logging.getLogger("router.engine_adapters")

OUTCOMES = ("ok", "failed", "timeout", "bad_answer")
"""How a read ended: a model list read (`ok`); no answer or a status other than 200
(`failed`); none within the timeout (`timeout`); an answer that is not a model list
(`bad_answer`)."""


@dataclass(frozen=True, slots=True)
class AdapterListSettings:
    interval_s: float = 5.0
    """Seconds between reads of one engine's model list."""
    timeout_s: float = 2.0
    min_refresh_s: float = 0.5
    """Reads asked for by routing misses are at least this far apart per engine."""
    reconcile_s: float = 0.2
    max_answer_bytes: int = 4 * 1024 * 1024
    worker_api_key: str = field(default="", repr=False)
    """Sent to engines whose records carry no key of their own (`--worker-api-key`)."""

    def __post_init__(self) -> None:
        for name in ("interval_s", "timeout_s", "reconcile_s"):
            if not getattr(self, name) > 0:
                raise ValueError(
                    f"adapter list {name} must be above 0, not {getattr(self, name)!r}"
                )
        if not self.min_refresh_s >= 0:
            raise ValueError(
                f"adapter list min_refresh_s must be 0 or more, not {self.min_refresh_s!r}"
            )


@dataclass(slots=True)
class _Task:
    worker: Worker
    url: str
    scope: trio.CancelScope
    wake: trio.Event = field(default_factory=trio.Event)


class AdapterLists:
    """The running readers of a fleet; `statistics()` counts reads by outcome."""

    def __init__(self, fleet: Fleet, settings: AdapterListSettings) -> None:
        self.fleet = fleet
        self.settings = settings
        self.reads: dict[str, int] = dict.fromkeys(OUTCOMES, 0)
        self.refreshes = 0
        """Reads asked for by routing misses."""
        self.misses = 0
        """Routing misses: an engine answered 404 for an adapter it was thought to hold."""
        self._tasks: dict[str, _Task] = {}
        self._seen_generation = -1

    def readers(self) -> int:
        return len(self._tasks)

    def statistics(self) -> dict[str, int]:
        stats = {f"reads_{outcome}": count for outcome, count in self.reads.items()}
        stats["refreshes"] = self.refreshes
        stats["misses"] = self.misses
        return stats

    def missed(self, worker: Worker, adapter: str) -> None:
        """`worker`'s engine answered 404 for `adapter`, which it was thought to hold: a
        routing miss. The fleet plans the adapter elsewhere from now on, and the engine's
        list is read again at once (it may have been unloaded, or reloaded under another
        name)."""
        self.misses += 1
        log.info(
            "worker %s answered 404 for adapter %s: planned elsewhere, its list read again",
            worker.id,
            adapter,
        )
        self.fleet.adapter_missed(worker, adapter)
        task = self._tasks.get(worker.id)
        if task is not None and task.worker is worker:
            self.refreshes += 1
            task.wake.set()

    def reconcile(self, nursery: trio.Nursery, http: httpx.AsyncClient) -> None:
        """Start a reader for each worker that has none, and restart or stop those whose
        worker changed URL, left, or left and came back. O(workers), run only when the fleet changed."""
        if self.fleet.generation == self._seen_generation:
            return
        self._seen_generation = self.fleet.generation
        # A grpc:// worker has no HTTP model list: its adapters are not read (docs/grpc.md).
        wanted = {worker.id: worker for worker in self.fleet.workers() if not worker.record.is_grpc}
        for worker_id, task in list(self._tasks.items()):
            worker = wanted.get(worker_id)
            if worker is not task.worker or worker.url != task.url:
                task.scope.cancel()
                del self._tasks[worker_id]
        for worker_id, worker in wanted.items():
            if worker_id not in self._tasks:
                task = self._tasks[worker_id] = _Task(worker, worker.url, trio.CancelScope())
                nursery.start_soon(self._run, worker, task, http)

    async def _run(self, worker: Worker, task: _Task, http: httpx.AsyncClient) -> None:
        settings = self.settings
        with task.scope:
            while True:
                task.wake = trio.Event()
                read_at = trio.current_time()
                await self._read_once(worker, http)
                with trio.move_on_at(read_at + settings.interval_s):
                    await task.wake.wait()
                # Misses in a burst share one read.
                await trio.sleep_until(read_at + settings.min_refresh_s)

    async def _read_once(self, worker: Worker, http: httpx.AsyncClient) -> None:
        settings = self.settings
        api_key = worker.record.api_key or settings.worker_api_key
        headers = {"authorization": f"Bearer {api_key}"} if api_key else None
        outcome = "ok"
        try:
            with trio.fail_after(settings.timeout_s):
                async with http.stream(
                    "GET", worker.url + "/v1/models", headers=headers
                ) as response:
                    if response.status_code != 200:
                        outcome = "failed"
                    else:
                        body = await read_capped(response, settings.max_answer_bytes)
            if outcome == "ok":
                listing = parse_model_list(orjson.loads(body))
        except trio.TooSlowError:
            outcome = "timeout"
        except (httpx.HTTPError, OSError):
            outcome = "failed"
        except (StreamTooLarge, ValueError):
            outcome = "bad_answer"  # orjson.JSONDecodeError is a ValueError
        self.reads[outcome] += 1
        if outcome != "ok":
            return
        before = dict(worker.adapters.held)
        self.fleet.learn_adapters(worker, listing.adapters)
        if worker.adapters.held != before:
            log.info(
                "worker %s holds adapters %s", worker.id, ", ".join(worker.adapters.held) or "none"
            )


async def serve_adapter_lists(
    lists: AdapterLists, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Keep one adapter list reader per worker of `lists.fleet` running until cancelled.
    Reports `started()` once the readers of the fleet as it is are started (not read yet:
    until its first reading a worker holds the adapters its record declares).

    Cancellation: every reader stops; the adapters last read stay held.
    """
    settings = lists.settings
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with (
        httpx.AsyncClient(limits=limits, timeout=settings.timeout_s) as http,
        trio.open_nursery() as nursery,
    ):
        lists.reconcile(nursery, http)
        task_status.started()
        while True:
            await trio.sleep(settings.reconcile_s)
            lists.reconcile(nursery, http)
