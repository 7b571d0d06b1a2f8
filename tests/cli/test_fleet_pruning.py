"""The fleet tells its listeners what to let go of, and not before it is safe to."""

from __future__ import annotations

from router.fleet.records import WorkerRecord
from router.fleet.registry import Fleet, Worker


class Recorder:
    def __init__(self) -> None:
        self.left: list[str] = []
        self.dropped: list[str] = []

    def worker_left(self, worker: Worker) -> None:
        self.left.append(worker.id)

    def url_dropped(self, url: str) -> None:
        self.dropped.append(url)


def setup(*records: WorkerRecord) -> tuple[Fleet, Recorder]:
    fleet = Fleet()
    recorder = Recorder()
    fleet.add_listener(recorder)
    for record in records:
        fleet.upsert(record)
    return fleet, recorder


def test_a_worker_leaving_idle_drops_its_url_at_once() -> None:
    fleet, recorder = setup(WorkerRecord(id="a", url="http://a"))
    worker = fleet.remove("a")
    assert worker is not None and worker.departed
    assert (recorder.left, recorder.dropped) == (["a"], ["http://a"])


def test_a_url_in_use_is_dropped_only_when_its_last_request_ends() -> None:
    fleet, recorder = setup(WorkerRecord(id="a", url="http://a"))
    worker = fleet.get("a")
    assert worker is not None
    worker.begin()
    worker.begin()
    fleet.replace_all([])
    assert (recorder.left, recorder.dropped) == (["a"], [])
    worker.end()
    fleet.lease_ended(worker)
    assert recorder.dropped == []
    worker.end()
    fleet.lease_ended(worker)
    assert recorder.dropped == ["http://a"]
    fleet.lease_ended(worker)
    assert recorder.dropped == ["http://a"]  # once


def test_a_url_another_worker_still_has_is_kept() -> None:
    fleet, recorder = setup(
        WorkerRecord(id="a", url="http://same"), WorkerRecord(id="b", url="http://same")
    )
    fleet.remove("a")
    assert (recorder.left, recorder.dropped) == (["a"], [])
    fleet.remove("b")
    assert recorder.dropped == ["http://same"]


def test_a_worker_that_moves_drops_its_old_url_and_stays() -> None:
    fleet, recorder = setup(WorkerRecord(id="a", url="http://old"))
    fleet.upsert(WorkerRecord(id="a", url="http://new"))
    assert (recorder.left, recorder.dropped) == ([], ["http://old"])


def test_a_url_that_returns_before_its_requests_end_is_not_dropped() -> None:
    fleet, recorder = setup(WorkerRecord(id="a", url="http://a"))
    worker = fleet.get("a")
    assert worker is not None
    worker.begin()
    fleet.remove("a")
    fleet.upsert(WorkerRecord(id="a", url="http://a"))  # back, a new Worker on the same URL
    worker.end()
    fleet.lease_ended(worker)
    assert recorder.dropped == []
