"""`consistent_hash`: rendezvous hashing of a request's routing key over the candidates, so
the same session or conversation lands on the same worker while the fleet stays the same,
and only the requests of a worker that leaves move."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from router.fleet.registry import Worker
from router.policies.policy import PolicyKey
from router.policies.simple import RoundRobin


class ConsistentHash:
    """Rendezvous hashing of the request's routing key over the candidates' ids.

    Each candidate scores `blake2b(key, id)` and the highest wins, so removing a worker
    moves only the keys it held, and adding one takes keys only for itself. The hash is
    stable across processes (never Python's salted `hash()`), so every router replica
    sends a session to the same worker. Requests without a key fall back to round robin.
    """

    __slots__ = ("_fallback",)

    def __init__(self) -> None:
        self._fallback = RoundRobin()

    def pick(self, key: PolicyKey, candidates: Sequence[Worker]) -> Worker:
        if key.routing_key is None:
            return self._fallback.pick(key, candidates)
        return max(candidates, key=_RendezvousScore(key.routing_key))


class _RendezvousScore:
    __slots__ = ("_seed",)

    def __init__(self, routing_key: bytes) -> None:
        # The length prefix keeps (key, id) pairs unambiguous: b"ab" + b"c" != b"a" + b"bc".
        self._seed = hashlib.blake2b(len(routing_key).to_bytes(4, "big"), digest_size=8)
        self._seed.update(routing_key)

    def __call__(self, worker: Worker) -> tuple[int, str]:
        digest = self._seed.copy()
        digest.update(worker.id.encode())
        # The id breaks the (astronomically unlikely) tie the same way everywhere.
        return int.from_bytes(digest.digest(), "big"), worker.id
