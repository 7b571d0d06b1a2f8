"""The admission scheduler's decisions, with no clock and no tasks: class order, deficit
round robin among tenants, weights, the lowest class's share, per-tenant caps, and the
invariant that no slot stays free while an eligible request waits."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from router.edge.fair_queue import Arrival, Blocker, FairQueue, TenantLimits

PLAIN = TenantLimits()
A = ("a", "")
B = ("b", "")


def _serve_all(queue: FairQueue[str], holders: list[tuple[str, str]]) -> list[str]:
    """Finish the requests in slots one at a time (oldest first), and each admitted waiter
    after them: the order in which the waiters were admitted."""
    order: list[str] = []
    while holders:
        tenant = holders.pop(0)
        for waiter in queue.finish(tenant):
            order.append(waiter)
            holders.append(("a", "") if waiter.startswith("a") else ("b", ""))
    return order


def test_one_tenant_in_one_class_is_first_in_first_out() -> None:
    queue: FairQueue[str] = FairQueue(limit=1, queue_size=10)
    assert queue.arrive("holder", 0, A, PLAIN) is Arrival.ADMITTED
    for number in range(5):
        assert queue.arrive(f"a{number}", 0, A, PLAIN) is Arrival.QUEUED
    assert _serve_all(queue, [A]) == ["a0", "a1", "a2", "a3", "a4"]
    assert queue.statistics().tenants == 0


def test_a_flooding_tenant_takes_turns_with_a_light_one() -> None:
    queue: FairQueue[str] = FairQueue(limit=1, queue_size=100)
    assert queue.arrive("holder", 0, A, PLAIN) is Arrival.ADMITTED
    for number in range(20):
        queue.arrive(f"a{number}", 0, A, PLAIN)
    for number in range(3):
        queue.arrive(f"b{number}", 0, B, PLAIN)
    order = _serve_all(queue, [A])
    # The light tenant arrived behind twenty of the flood's requests and waits for two.
    assert order[:6] == ["a0", "b0", "a1", "b1", "a2", "b2"]
    assert order[6:] == [f"a{number}" for number in range(3, 20)]


def test_weights_share_the_slots_in_proportion() -> None:
    queue: FairQueue[str] = FairQueue(limit=1, queue_size=100)
    heavy = TenantLimits(weight=3)
    queue.arrive("holder", 0, A, heavy)
    for number in range(30):
        queue.arrive(f"a{number}", 0, A, heavy)
        queue.arrive(f"b{number}", 0, B, PLAIN)
    order = _serve_all(queue, [A])[:40]
    assert sum(1 for name in order if name.startswith("a")) == 30
    assert sum(1 for name in order if name.startswith("b")) == 10


def test_a_higher_class_is_always_served_first_without_a_share() -> None:
    queue: FairQueue[str] = FairQueue(classes=2, limit=1, queue_size=100)
    queue.arrive("holder", 1, B, PLAIN)
    for number in range(5):
        queue.arrive(f"b{number}", 1, B, PLAIN)
    for number in range(3):
        queue.arrive(f"a{number}", 0, A, PLAIN)
    assert _serve_all(queue, [B]) == ["a0", "a1", "a2", "b0", "b1", "b2", "b3", "b4"]


def test_the_lowest_class_gets_its_share_while_a_higher_one_floods() -> None:
    queue: FairQueue[str] = FairQueue(classes=2, limit=1, queue_size=1000, lowest_share=0.25)
    queue.arrive("holder", 0, A, PLAIN)
    for number in range(300):
        queue.arrive(f"a{number}", 0, A, PLAIN)
    for number in range(100):
        queue.arrive(f"b{number}", 1, B, PLAIN)
    order = _serve_all(queue, [A])[:400]
    low = [index for index, name in enumerate(order) if name.startswith("b")]
    # One slot in four, evenly: every fourth hand-out while both classes wait.
    assert len(low) == 100
    assert low[:5] == [3, 7, 11, 15, 19]


def test_a_tenant_at_its_inflight_cap_waits_and_does_not_hold_up_others() -> None:
    queue: FairQueue[str] = FairQueue(limit=4, queue_size=10)
    capped = TenantLimits(max_inflight=1)
    assert queue.arrive("a0", 0, A, capped) is Arrival.ADMITTED
    assert queue.arrive("a1", 0, A, capped) is Arrival.QUEUED
    # Slots are free, the tenant is not: the next tenant is admitted at once.
    assert queue.arrive("b0", 0, B, PLAIN) is Arrival.ADMITTED
    assert queue.statistics().active == 2
    assert queue.leave("a1") is Blocker.TENANT_INFLIGHT
    assert queue.arrive("a2", 0, A, capped) is Arrival.QUEUED
    assert queue.finish(A) == ["a2"]
    assert queue.statistics().active == 2


def test_full_queues_refuse_and_remember_nothing() -> None:
    queue: FairQueue[str] = FairQueue(limit=1, queue_size=3)
    queue.arrive("holder", 0, A, PLAIN)
    limited = TenantLimits(max_queued=2)
    assert queue.arrive("b0", 0, B, limited) is Arrival.QUEUED
    assert queue.arrive("b1", 0, B, limited) is Arrival.QUEUED
    assert queue.arrive("b2", 0, B, limited) is Arrival.TENANT_QUEUE_FULL
    assert queue.arrive("a0", 0, A, PLAIN) is Arrival.QUEUED
    assert queue.arrive("c0", 0, ("c", ""), PLAIN) is Arrival.QUEUE_FULL
    stats = queue.statistics()
    assert (stats.active, stats.waiting, stats.tenants) == (1, 3, 2)


def test_a_waiter_that_leaves_is_never_admitted_and_its_tenant_is_forgotten() -> None:
    queue: FairQueue[str] = FairQueue(limit=1, queue_size=10)
    queue.arrive("holder", 0, A, PLAIN)
    for number in range(3):
        queue.arrive(f"b{number}", 0, B, PLAIN)
    for number in range(3):
        assert queue.leave(f"b{number}") is Blocker.CONCURRENCY
    assert queue.leave("b0") is None
    assert queue.tenant_counts() == {A: (1, 0)}
    assert queue.finish(A) == []
    assert queue.statistics() == queue.statistics().__class__(0, 0, (0,), 0)


def test_sub_tenants_of_one_key_are_tenants_of_their_own() -> None:
    queue: FairQueue[str] = FairQueue(limit=1, queue_size=10)
    queue.arrive("holder", 0, ("gw", "x"), PLAIN)
    queue.arrive("x1", 0, ("gw", "x"), PLAIN)
    queue.arrive("x2", 0, ("gw", "x"), PLAIN)
    queue.arrive("y1", 0, ("gw", "y"), PLAIN)
    admitted = []
    holder = ("gw", "x")
    while True:
        got = queue.finish(holder)
        if not got:
            break
        admitted += got
        holder = ("gw", got[0][0])
    assert admitted == ["x1", "y1", "x2"]


# A random run: arrivals (class, tenant, cap), departures of waiters, finishes of holders.
_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("arrive"), st.integers(0, 2), st.integers(0, 2), st.integers(0, 2)),
        st.tuples(st.just("leave"), st.integers(0, 50)),
        st.tuples(st.just("finish"), st.integers(0, 50)),
    ),
    max_size=120,
)


@settings(max_examples=400)
@given(_OPS, st.integers(0, 3), st.integers(0, 6), st.sampled_from([0.0, 0.2, 0.5]))
def test_no_slot_stays_free_while_an_eligible_request_waits(
    ops: list[tuple[object, ...]], limit: int, queue_size: int, share: float
) -> None:
    queue: FairQueue[int] = FairQueue(
        classes=3, limit=limit, queue_size=queue_size, lowest_share=share
    )
    holding: list[tuple[int, tuple[str, str]]] = []
    waiting: dict[int, tuple[tuple[str, str], int]] = {}
    seen_admitted: set[int] = set()
    caps = {t: TenantLimits(max_inflight=t) for t in range(3)}
    for number, op in enumerate(ops):
        if op[0] == "arrive":
            _, rank, tenant_number, _ = op
            assert isinstance(rank, int) and isinstance(tenant_number, int)
            tenant = (f"t{tenant_number}", "")
            verdict = queue.arrive(number, rank, tenant, caps[tenant_number])
            if verdict is Arrival.ADMITTED:
                holding.append((number, tenant))
                seen_admitted.add(number)
            elif verdict is Arrival.QUEUED:
                waiting[number] = (tenant, caps[tenant_number].max_inflight)
        elif op[0] == "leave" and waiting:
            index = op[1]
            assert isinstance(index, int)
            waiter = sorted(waiting)[index % len(waiting)]
            assert queue.leave(waiter) is not None
            del waiting[waiter]
        elif op[0] == "finish" and holding:
            index = op[1]
            assert isinstance(index, int)
            _, tenant = holding.pop(index % len(holding))
            for admitted in queue.finish(tenant):
                assert admitted not in seen_admitted
                seen_admitted.add(admitted)
                admitted_tenant, _ = waiting.pop(admitted)
                holding.append((admitted, admitted_tenant))
        stats = queue.statistics()
        assert stats.active == len(holding)
        assert stats.waiting == len(waiting)
        assert limit == 0 or stats.active <= limit
        assert stats.waiting <= queue_size
        inflight: dict[tuple[str, str], int] = {}
        for _, tenant in holding:
            inflight[tenant] = inflight.get(tenant, 0) + 1
        for tenant, cap in ((t, c) for t, c in waiting.values()):
            assert cap == 0 or inflight.get(tenant, 0) <= cap
        # Nobody eligible waits beside a free slot.
        if limit == 0 or stats.active < limit:
            for tenant, cap in waiting.values():
                assert cap > 0 and inflight.get(tenant, 0) >= cap
    for waiter in list(waiting):
        queue.leave(waiter)
    while holding:
        _, tenant = holding.pop()
        assert queue.finish(tenant) == []
    assert queue.statistics().tenants == 0
