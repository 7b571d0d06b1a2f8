"""Which DP rank of a rank-multiplexed worker takes the next request (both strategies use it)."""

from __future__ import annotations

from router.fleet.registry import Worker


class RankChooser:
    """Which DP rank of a rank-multiplexed worker takes the next request.

    The least-loaded rank (`Worker.rank_load`: the engine's count for the rank beyond this
    process plus this process's own, or its own alone while unknown); among equally loaded ranks
    the scan starts one place further on each time, so an idle worker's ranks take turns
    instead of rank 0 taking every request that arrives alone.
    """

    __slots__ = ("_start",)

    def __init__(self) -> None:
        # Keyed by worker id: one small int per rank-multiplexed worker in the fleet,
        # never scanned; `forget` drops a worker that left.
        self._start: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._start)

    def forget(self, worker_id: str) -> None:
        """Drop the rotation state of a worker that left the fleet."""
        self._start.pop(worker_id, None)

    def choose(self, worker: Worker) -> int | None:
        """A rank for `worker`, or None when the worker picks its own (one rank, or a
        worker registered as a single rank)."""
        if not worker.record.rank_multiplexed:
            return None
        loads = [worker.rank_load(rank) for rank in range(len(worker.rank_inflight))]
        size = len(loads)
        start = self._start.get(worker.id, 0) % size
        self._start[worker.id] = (start + 1) % size
        best = start
        for offset in range(1, size):
            rank = (start + offset) % size
            if loads[rank] < loads[best]:
                best = rank
        return best
