"""The load a policy reads: the engine's count plus this process's requests it cannot have
counted yet; this process's own count while the engine's is unknown, never zero."""

from __future__ import annotations

import pytest

from router.fleet.load import MAX_RECENT_DISPATCHES, EngineShare, figure
from router.fleet.records import WorkerRecord
from router.fleet.registry import Fleet, Worker

WINDOW = 0.25


def worker(dp_size: int = 1) -> Worker:
    fleet = Fleet(engine_shares=True)
    added = fleet.upsert(WorkerRecord(id="w", url="http://w:1", models=("m",), dp_size=dp_size))
    assert added is not None
    return added


def test_unknown_is_this_process_own_count_never_zero() -> None:
    w = worker()
    for _ in range(3):
        w.begin(None, now=1.0)
    assert w.shares[0].others is None
    assert w.load == 3.0
    assert figure(None, 0) == 0.0 and figure(None, 5) == 5.0


def test_other_senders_work_adds_to_our_own() -> None:
    w = worker()
    for _ in range(2):
        w.begin(None, now=0.0)
    # Read at 10.0: the engine holds 7; our two (sent long before) are among them.
    w.shares[0].observe(7, taken_at=10.0, own_inflight=w.inflight, window_s=WINDOW)
    assert w.shares[0].others == 5.0
    assert w.load == 7.0
    # One of ours ends: the figure follows at once, other senders' work stays.
    w.end(None)
    assert w.load == 6.0


def test_ours_sent_within_the_window_before_a_reading_are_not_presumed_counted() -> None:
    w = worker()
    w.begin(None, now=0.0)  # long before: counted by the engine
    w.begin(None, now=9.9)  # just before the reading: not in the engine's figure yet
    w.begin(None, now=10.1)  # after it
    # The engine counts only the first one of ours (and 4 of another router's).
    w.shares[0].observe(5, taken_at=10.0, own_inflight=w.inflight, window_s=WINDOW)
    assert w.shares[0].others == 4.0
    assert w.load == 7.0  # 4 elsewhere + our 3


def test_a_reading_that_lags_our_completions_is_never_negative_work_elsewhere() -> None:
    w = worker()
    for _ in range(4):
        w.begin(None, now=0.0)
    w.shares[0].observe(1, taken_at=5.0, own_inflight=w.inflight, window_s=WINDOW)
    assert w.shares[0].others == 0.0
    assert w.load == 4.0


def test_a_lost_reading_falls_back_to_our_own_count() -> None:
    w = worker()
    w.begin(None, now=0.0)
    w.shares[0].observe(10, taken_at=5.0, own_inflight=1, window_s=WINDOW)
    assert w.load == 10.0
    w.shares[0].lose()
    assert (w.shares[0].others, w.shares[0].read_at, w.load) == (None, None, 1.0)
    assert w.engine_share() is None


def test_rank_loads_of_a_multiplexed_worker_and_any_unknown_rank_hides_the_sum() -> None:
    w = worker(dp_size=2)
    assert len(w.shares) == 2
    w.begin(0, now=0.0)
    w.shares[0].observe(3, taken_at=1.0, own_inflight=w.rank_inflight[0], window_s=WINDOW)
    assert w.rank_load(0) == 3.0 and w.rank_load(1) == 0.0
    # Rank 1 unread: the worker's figure is our own count, not a partial sum.
    assert w.load == 1.0
    w.shares[1].observe(6, taken_at=1.0, own_inflight=0, window_s=WINDOW)
    assert w.load == 2.0 + 6.0 + 1.0
    assert w.engine_share() == (8.0, 1.0)


def test_the_dispatch_times_kept_are_bounded() -> None:
    share = EngineShare()
    for n in range(MAX_RECENT_DISPATCHES * 3):
        share.dispatched(float(n))
    assert share.kept_dispatches() == MAX_RECENT_DISPATCHES


def test_a_worker_without_shares_reads_its_own_count_and_a_new_url_forgets_the_reading() -> None:
    plain = Fleet().upsert(WorkerRecord(id="p", url="http://p:1", models=("m",)))
    assert plain is not None and plain.shares == []
    plain.begin(None, now=1.0)
    assert plain.load == 1.0 and plain.engine_share() is None
    fleet = Fleet(engine_shares=True)
    w = fleet.upsert(WorkerRecord(id="w", url="http://w:1", models=("m",)))
    assert w is not None
    w.shares[0].observe(9, taken_at=1.0, own_inflight=0, window_s=WINDOW)
    moved = fleet.upsert(WorkerRecord(id="w", url="http://w:2", models=("m",)))
    assert moved is w and w.shares[0].others is None


@pytest.mark.parametrize("dp_size", [1, 4])
def test_resizing_keeps_one_share_per_view(dp_size: int) -> None:
    fleet = Fleet(engine_shares=True)
    w = fleet.upsert(WorkerRecord(id="w", url="http://w:1", models=("m",), dp_size=dp_size))
    assert w is not None and len(w.shares) == dp_size
    fleet.upsert(WorkerRecord(id="w", url="http://w:1", models=("m",), dp_size=2))
    assert len(w.shares) == 2


def test_ours_that_ended_before_a_reading_are_in_neither_count() -> None:
    w = worker()
    for _ in range(3):
        w.begin(None, now=0.0)  # long ones, counted by the engine
    for sent in (9.8, 9.9):
        w.begin(None, now=sent)  # two fast ones, in and out before the reading
        w.end(None, sent_at=sent)
    # The engine holds our three and nothing else.
    w.shares[0].observe(3, taken_at=10.0, own_inflight=w.inflight, window_s=WINDOW)
    assert w.shares[0].others == 0.0 and w.load == 3.0
    # Held as still in flight, the two would have made ours look uncounted: 2 elsewhere.
    assert w.shares[0].kept_dispatches() == 0
    w.end(None, sent_at=0.0)  # older than the window: never held, nothing to drop
    assert w.inflight == 2 and w.load == 2.0
