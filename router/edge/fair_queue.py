"""Who gets the next admission slot: priority classes first, fair shares within a class.

The admission gate (`router.edge.admission`) owns the waiting and the clock; this module
only decides, synchronously, and in constant time per decision:

- **Classes** are served highest first (rank 0 is the highest). A lower class waits while
  a higher one has an eligible waiter, except that the lowest class can be given a share
  (`lowest_share`) of the slots handed out while it waits, so it is never starved: each
  slot given to a higher class while the lowest one waits earns it `share / (1 - share)`
  of a slot, and a whole one earned is taken at the next hand-out.
- **Tenants** within a class share by deficit round robin (Shreedhar and Varghese, 1995)
  with a quantum of `weight` requests: each request costs one, so a tenant of weight w is
  served w requests per turn, then goes to the back of its class's ring. A tenant that
  floods the line gets its turn like everyone else, no more often.
- **Caps per tenant**: at most `max_inflight` of its requests hold a slot at once (its
  waiters stay in line, out of the ring, until one of them finishes), and at most
  `max_queued` wait (one more is refused).

A slot is handed out only when no eligible waiter is left behind: after every call either
every slot is taken or nobody eligible waits. So a newcomer is admitted at once only when
nobody it could overtake is waiting, and a tenant at its cap never holds up the others.

Tenant state exists only while the tenant has a request waiting or holding a slot, so a
tenant named by a header costs memory only while its requests are here (bounded by the
queue size plus the concurrency limit). A tenant's limits are those its first request
brought; new ones (a reloaded keys file) apply once its requests here are done.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

Waiter = TypeVar("Waiter", bound=Hashable)
TenantId = tuple[str, str]
"""(client key name, the tenant within it named by a header, or "")."""


@dataclass(frozen=True, slots=True)
class TenantLimits:
    weight: int = 1
    """Requests served per turn of the tenant's class ring (its quantum)."""
    max_inflight: int = 0
    """Requests of the tenant holding a slot at once; 0: no cap of its own."""
    max_queued: int = 0
    """Requests of the tenant waiting at once; 0: only the queue's own bound."""


class Arrival(enum.Enum):
    ADMITTED = "admitted"
    QUEUED = "queued"
    QUEUE_FULL = "queue_full"
    TENANT_QUEUE_FULL = "tenant_queue_full"


class Blocker(enum.Enum):
    """What kept a waiter waiting: the router's limit, or its tenant's own in-flight cap."""

    CONCURRENCY = "concurrency"
    TENANT_INFLIGHT = "tenant_inflight"


class _Tenant(Generic[Waiter]):
    __slots__ = ("id", "inflight", "limits", "lines", "queued")

    def __init__(self, tenant_id: TenantId, limits: TenantLimits) -> None:
        self.id = tenant_id
        self.limits = limits
        self.inflight = 0
        self.queued = 0
        self.lines: dict[int, _Line[Waiter]] = {}
        """Its line in each class it has waiters in, by rank."""

    @property
    def capped(self) -> bool:
        cap = self.limits.max_inflight
        return cap > 0 and self.inflight >= cap


class _Line(Generic[Waiter]):
    """One tenant's waiters in one class, in arrival order, and its DRR deficit."""

    __slots__ = ("deficit", "rank", "tenant", "waiters")

    def __init__(self, tenant: _Tenant[Waiter], rank: int) -> None:
        self.tenant = tenant
        self.rank = rank
        self.waiters: dict[Waiter, None] = {}
        self.deficit = 0


class _Class(Generic[Waiter]):
    __slots__ = ("ring", "waiting")

    def __init__(self) -> None:
        # Lines with an eligible waiter, in turn order; a dict so a line leaves in O(1).
        self.ring: dict[_Line[Waiter], None] = {}
        self.waiting = 0


@dataclass(frozen=True, slots=True)
class FairQueueStatistics:
    active: int
    waiting: int
    waiting_by_class: tuple[int, ...]
    tenants: int


class FairQueue(Generic[Waiter]):
    """Slots under a limit, and the line before them, for `classes` priority classes.

    `limit` 0 means no limit of slots (tenant caps may still make requests wait);
    `queue_size` bounds the waiters of every class and tenant together.
    """

    def __init__(
        self, classes: int = 1, limit: int = 0, queue_size: int = 0, lowest_share: float = 0.0
    ) -> None:
        if classes < 1:
            raise ValueError("at least one class")
        if not 0 <= lowest_share < 1:
            raise ValueError("lowest_share must be in [0, 1)")
        self.limit = limit
        self.queue_size = queue_size
        self._classes: list[_Class[Waiter]] = [_Class() for _ in range(classes)]
        self._lowest = self._classes[-1] if classes > 1 and lowest_share > 0 else None
        self._lowest_rate = lowest_share / (1 - lowest_share)
        self._lowest_credit = 0.0
        self._tenants: dict[TenantId, _Tenant[Waiter]] = {}
        self._where: dict[Waiter, _Line[Waiter]] = {}
        self.active = 0

    @property
    def waiting(self) -> int:
        return len(self._where)

    def statistics(self) -> FairQueueStatistics:
        return FairQueueStatistics(
            self.active,
            len(self._where),
            tuple(cls.waiting for cls in self._classes),
            len(self._tenants),
        )

    def tenant_counts(self) -> dict[TenantId, tuple[int, int]]:
        """(in flight, waiting) of every tenant with a request here (read at scrape time)."""
        return {tid: (tenant.inflight, tenant.queued) for tid, tenant in self._tenants.items()}

    def arrive(
        self, waiter: Waiter, rank: int, tenant_id: TenantId, limits: TenantLimits
    ) -> Arrival:
        """A request of `tenant_id` in class `rank` asks for a slot.

        ADMITTED: it holds one now (the caller must `finish` it). QUEUED: it waits; a later
        `finish` names it when it is admitted, `leave` takes it out. A full queue (the
        whole one or the tenant's share of it) refuses it and remembers nothing.
        """
        tenant = self._tenants.get(tenant_id)
        if tenant is None:
            tenant = self._tenants[tenant_id] = _Tenant(tenant_id, limits)
        if not tenant.capped and (self.limit == 0 or self.active < self.limit):
            # Nobody eligible is waiting (every slot would have been handed out): no one
            # is overtaken.
            self._take_slot(tenant)
            return Arrival.ADMITTED
        verdict = None
        if len(self._where) >= self.queue_size:
            verdict = Arrival.QUEUE_FULL
        elif tenant.limits.max_queued and tenant.queued >= tenant.limits.max_queued:
            verdict = Arrival.TENANT_QUEUE_FULL
        if verdict is not None:
            self._forget_if_idle(tenant)
            return verdict
        line = tenant.lines.get(rank)
        if line is None:
            line = tenant.lines[rank] = _Line(tenant, rank)
        line.waiters[waiter] = None
        tenant.queued += 1
        cls = self._classes[rank]
        cls.waiting += 1
        self._where[waiter] = line
        if not tenant.capped and line not in cls.ring:
            cls.ring[line] = None
        return Arrival.QUEUED

    def leave(self, waiter: Waiter) -> Blocker | None:
        """Take a waiter out of the line (its client left, or it waited too long): what
        held it there, or None when it is not waiting (it was admitted meanwhile)."""
        line = self._where.pop(waiter, None)
        if line is None:
            return None
        tenant = line.tenant
        blocker = Blocker.TENANT_INFLIGHT if tenant.capped else Blocker.CONCURRENCY
        del line.waiters[waiter]
        self._line_shrank(line)
        return blocker

    def finish(self, tenant_id: TenantId) -> list[Waiter]:
        """A request of `tenant_id` gave its slot back: the waiters admitted in its place
        (usually none or one), each now holding a slot."""
        tenant = self._tenants[tenant_id]
        was_capped = tenant.capped
        tenant.inflight -= 1
        self.active -= 1
        if was_capped and not tenant.capped:
            for rank, line in tenant.lines.items():
                self._classes[rank].ring[line] = None
        admitted = self._hand_out()
        self._forget_if_idle(tenant)
        return admitted

    def _hand_out(self) -> list[Waiter]:
        admitted: list[Waiter] = []
        while self.limit == 0 or self.active < self.limit:
            cls = self._next_class()
            if cls is None:
                break
            admitted.append(self._serve(cls))
        return admitted

    def _next_class(self) -> _Class[Waiter] | None:
        """The class whose turn it is: the highest with an eligible waiter, unless the
        lowest one has earned a slot of its share."""
        lowest = self._lowest
        if lowest is not None and lowest.ring and self._lowest_credit >= 1:
            self._lowest_credit -= 1
            return lowest
        for cls in self._classes:
            if cls.ring:
                if lowest is not None and cls is not lowest and lowest.ring:
                    self._lowest_credit += self._lowest_rate
                return cls
        return None

    def _serve(self, cls: _Class[Waiter]) -> Waiter:
        """One waiter of the line whose DRR turn it is."""
        line = next(iter(cls.ring))
        if line.deficit < 1:
            line.deficit += line.tenant.limits.weight  # its turn begins
        line.deficit -= 1
        waiter = next(iter(line.waiters))
        del line.waiters[waiter]
        del self._where[waiter]
        tenant = line.tenant
        self._take_slot(tenant)
        self._line_shrank(line)
        if line.waiters and line in cls.ring and line.deficit < 1:
            # Its turn is over: to the back of the ring.
            del cls.ring[line]
            cls.ring[line] = None
        return waiter

    def _take_slot(self, tenant: _Tenant[Waiter]) -> None:
        tenant.inflight += 1
        self.active += 1
        if tenant.capped:
            for rank, line in tenant.lines.items():
                self._classes[rank].ring.pop(line, None)

    def _line_shrank(self, line: _Line[Waiter]) -> None:
        tenant = line.tenant
        tenant.queued -= 1
        cls = self._classes[line.rank]
        cls.waiting -= 1
        if not line.waiters:
            cls.ring.pop(line, None)
            del tenant.lines[line.rank]
            self._forget_if_idle(tenant)

    def _forget_if_idle(self, tenant: _Tenant[Waiter]) -> None:
        if tenant.inflight == 0 and tenant.queued == 0:
            self._tenants.pop(tenant.id, None)
