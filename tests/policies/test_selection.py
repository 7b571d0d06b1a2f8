"""Candidate filtering, the policies, routing keys and the failover helper."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from router.fleet.breaker import BreakerSettings, CircuitBreaker, Outcome
from router.fleet.candidates import AllOpenMode, filter_leg
from router.fleet.records import Role, Status, WorkerRecord
from router.fleet.registry import Worker
from router.policies.by_name import POLICY_NAMES, make_policy
from router.policies.policy import PolicyKey, pick_excluding, ranked_pick
from router.policies.routing_keys import routing_key

NOW = 100.0


def make_worker(
    worker_id: str,
    role: Role = Role.MIXED,
    *,
    draining: bool = False,
    healthy: bool = True,
    breaker: CircuitBreaker | None = None,
    inflight: int = 0,
) -> Worker:
    record = WorkerRecord(
        id=worker_id,
        url=f"http://{worker_id}.test:8000",
        models=("m",),
        role=role,
        status=Status.DRAINING if draining else Status.ACTIVE,
    )
    return Worker(record=record, breaker=breaker, healthy=healthy, inflight=inflight)


def tripped_breaker(cooldown_s: float, opened_at: float = NOW) -> CircuitBreaker:
    """A breaker that opened at `opened_at` and admits a probe `cooldown_s` later."""
    breaker = CircuitBreaker(
        BreakerSettings(failure_threshold=1, cooldown_s=cooldown_s, max_cooldown_s=600.0)
    )
    permit = breaker.acquire(opened_at)
    assert permit is not None
    breaker.record(permit, Outcome.FAULT, opened_at)
    assert not breaker.available(opened_at)
    return breaker


def key(routing: bytes | None = None, model: str = "m", role: Role = Role.MIXED) -> PolicyKey:
    return PolicyKey(model=model, role=role, routing_key=routing)


# --- filter_leg --------------------------------------------------------------------------


def test_filter_leg_counts_each_worker_under_its_first_reason() -> None:
    workers = [
        make_worker("ok-1", Role.DECODE),
        make_worker("ok-2", Role.DECODE, breaker=tripped_breaker(5.0, opened_at=0.0)),
        make_worker(
            "drain-sick-open",
            Role.DECODE,
            draining=True,
            healthy=False,
            breaker=tripped_breaker(5.0),
        ),
        make_worker("sick-open", Role.DECODE, healthy=False, breaker=tripped_breaker(5.0)),
        make_worker("open", Role.DECODE, breaker=tripped_breaker(5.0)),
        make_worker("prefill", Role.PREFILL),
        make_worker("mixed", Role.MIXED, healthy=False),
    ]
    pool = filter_leg(workers, Role.DECODE, NOW, AllOpenMode.DISPATCH)

    assert [w.id for w in pool.candidates] == ["ok-1", "ok-2"]
    assert [w.id for w in pool.workers] == ["ok-1", "ok-2", "drain-sick-open", "sick-open", "open"]
    assert (pool.total, pool.draining, pool.unhealthy, pool.breaker_open) == (5, 1, 1, 1)
    assert pool.verdict == "ok"
    assert pool.forced is False


def test_filter_leg_empty_and_unavailable_verdicts() -> None:
    workers = [make_worker("d", Role.DECODE, draining=True), make_worker("p", Role.PREFILL)]

    empty = filter_leg(workers, Role.MIXED, NOW, AllOpenMode.DISPATCH, default_retry_after_s=2.0)
    drained = filter_leg(workers, Role.DECODE, NOW, AllOpenMode.DISPATCH, default_retry_after_s=2.0)

    assert (empty.verdict, empty.total, empty.candidates) == ("empty", 0, [])
    assert (drained.verdict, drained.total, drained.draining) == ("unavailable", 1, 1)
    assert drained.retry_after_s == 2.0
    assert drained.forced is False


def test_all_open_dispatch_forces_only_the_workers_held_back_by_their_breaker() -> None:
    workers = [
        make_worker("open-a", breaker=tripped_breaker(5.0)),
        make_worker("open-sick", healthy=False, breaker=tripped_breaker(5.0)),
        make_worker("open-b", breaker=tripped_breaker(9.0)),
        make_worker("draining", draining=True),
    ]
    pool = filter_leg(workers, Role.MIXED, NOW, AllOpenMode.DISPATCH)

    assert pool.forced is True
    assert pool.verdict == "ok"
    assert [w.id for w in pool.candidates] == ["open-a", "open-b"]
    assert (pool.draining, pool.unhealthy, pool.breaker_open) == (1, 1, 2)


def test_all_open_reject_is_unavailable_until_the_earliest_probe() -> None:
    workers = [
        make_worker("slow", breaker=tripped_breaker(9.0, opened_at=NOW)),
        make_worker("soon", breaker=tripped_breaker(5.0, opened_at=NOW - 2.7)),
    ]
    pool = filter_leg(workers, Role.MIXED, NOW, AllOpenMode.REJECT)

    assert (pool.verdict, pool.forced, pool.candidates) == ("unavailable", False, [])
    assert pool.breaker_open == 2
    # "soon" admits a probe in 2.3 s: a client told 2 s would come back too early.
    assert pool.retry_after_s == 3.0


def test_reject_retry_after_is_at_least_one_second() -> None:
    breaker = tripped_breaker(5.0, opened_at=NOW - 4.9)
    pool = filter_leg([make_worker("w", breaker=breaker)], Role.MIXED, NOW, AllOpenMode.REJECT)

    assert breaker.retry_after(NOW) == pytest.approx(0.1)
    assert pool.retry_after_s == 1.0


def test_a_probe_in_flight_keeps_a_half_open_worker_out() -> None:
    breaker = tripped_breaker(5.0, opened_at=NOW - 5.0)
    probe = breaker.acquire(NOW)
    assert probe is not None and probe.probe
    pool = filter_leg([make_worker("w", breaker=breaker)], Role.MIXED, NOW, AllOpenMode.REJECT)

    assert (pool.verdict, pool.breaker_open) == ("unavailable", 1)
    assert pool.retry_after_s == 5.0


def test_filtering_never_takes_the_half_open_probe_slot() -> None:
    breaker = tripped_breaker(5.0, opened_at=NOW - 6.0)
    worker = make_worker("w", breaker=breaker)

    for _ in range(3):
        pool = filter_leg([worker], Role.MIXED, NOW, AllOpenMode.REJECT)
        assert pool.candidates == [worker]
    assert breaker.statistics(NOW).probe_in_flight is False
    permit = breaker.acquire(NOW)
    assert permit is not None and permit.probe


# --- policies ----------------------------------------------------------------------------


def test_round_robin_spreads_exactly_evenly() -> None:
    policy = make_policy("round_robin")
    workers = [make_worker(f"w{i}") for i in range(3)]

    picks = Counter(policy.pick(key(), workers).id for _ in range(30))

    assert picks == {"w0": 10, "w1": 10, "w2": 10}


def test_round_robin_keeps_one_turn_per_model_and_role() -> None:
    policy = make_policy("round_robin")
    workers = [make_worker(f"w{i}") for i in range(2)]

    picks = [
        policy.pick(key(model=model, role=role), workers).id
        for _ in range(2)
        for model, role in (("a", Role.PREFILL), ("a", Role.DECODE), ("b", Role.PREFILL))
    ]

    # Interleaved traffic for other keys does not skip anyone's turn.
    assert picks == ["w0", "w0", "w0", "w1", "w1", "w1"]


def test_random_is_seeded_and_reaches_every_candidate() -> None:
    workers = [make_worker(f"w{i}") for i in range(3)]
    first = make_policy("random", rng=random.Random(7))
    second = make_policy("random", rng=random.Random(7))

    picks = [first.pick(key(), workers).id for _ in range(300)]

    assert picks == [second.pick(key(), workers).id for _ in range(300)]
    assert all(60 < count < 140 for count in Counter(picks).values())
    assert set(picks) == {"w0", "w1", "w2"}


def test_least_load_picks_the_idle_worker() -> None:
    policy = make_policy("least_load")
    workers = [
        make_worker("busy", inflight=4),
        make_worker("idle", inflight=0),
        make_worker("warm", inflight=1),
    ]

    assert [policy.pick(key(), workers).id for _ in range(5)] == ["idle"] * 5


def test_least_load_spreads_equal_loads() -> None:
    policy = make_policy("least_load")
    workers = [make_worker(f"w{i}") for i in range(3)]

    picks = Counter(policy.pick(key(), workers).id for _ in range(30))

    assert picks == {"w0": 10, "w1": 10, "w2": 10}


def test_power_of_two_never_picks_the_most_loaded() -> None:
    policy = make_policy("power_of_two", rng=random.Random(1234))
    workers = [
        make_worker("light", inflight=0),
        make_worker("medium", inflight=10),
        make_worker("heavy", inflight=100),
    ]

    picks = Counter(policy.pick(key(), workers).id for _ in range(300))

    assert picks["heavy"] == 0
    # Two of three: "light" wins whenever it is drawn (2/3 of the time), "medium" otherwise.
    assert picks["light"] + picks["medium"] == 300
    assert 150 < picks["light"] < 250


def test_power_of_two_with_one_candidate() -> None:
    worker = make_worker("only", inflight=50)

    assert make_policy("power_of_two", rng=random.Random(0)).pick(key(), [worker]) is worker


def test_consistent_hash_is_sticky_and_ignores_candidate_order() -> None:
    policy = make_policy("consistent_hash")
    workers = [make_worker(f"w{i}") for i in range(5)]
    shuffler = random.Random(3)

    picks = set()
    for _ in range(20):
        shuffled = workers[:]
        shuffler.shuffle(shuffled)
        picks.add(policy.pick(key(b"session-42"), shuffled).id)

    assert len(picks) == 1


def test_consistent_hash_moves_only_the_removed_workers_keys() -> None:
    policy = make_policy("consistent_hash")
    workers = [make_worker(f"worker-{i}") for i in range(5)]
    keys = [f"session-{n}".encode() for n in range(200)]

    before = {k: policy.pick(key(k), workers).id for k in keys}
    survivors = [w for w in workers if w.id != "worker-2"]
    after = {k: policy.pick(key(k), survivors).id for k in keys}

    moved = {k for k in keys if before[k] != after[k]}
    assert moved == {k for k in keys if before[k] == "worker-2"}
    assert len(moved) > 0
    # Every worker holds a share of the keys, so the hash actually spreads.
    assert all(20 < count < 60 for count in Counter(before.values()).values())


def test_consistent_hash_placement_is_pinned_across_processes() -> None:
    """Router replicas must agree, so the placement is a fixed function of key and ids."""
    policy = make_policy("consistent_hash")
    workers = [make_worker(f"worker-{i}") for i in range(5)]

    placement = [policy.pick(key(f"s{n}".encode()), workers).id for n in range(8)]

    # Changing the hash re-homes every session on a rolling upgrade of the routers.
    assert placement == [
        "worker-3",
        "worker-0",
        "worker-1",
        "worker-3",
        "worker-4",
        "worker-3",
        "worker-2",
        "worker-4",
    ]


def test_consistent_hash_without_a_key_falls_back_to_round_robin() -> None:
    policy = make_policy("consistent_hash")
    workers = [make_worker(f"w{i}") for i in range(3)]

    picks = Counter(policy.pick(key(None), workers).id for _ in range(9))

    assert picks == {"w0": 3, "w1": 3, "w2": 3}


def test_make_policy_builds_every_named_policy() -> None:
    workers = [make_worker("w0"), make_worker("w1")]
    for name in POLICY_NAMES:
        assert make_policy(name, rng=random.Random(0)).pick(key(b"k"), workers) in workers


def test_make_policy_rejects_an_unknown_name_listing_the_choices() -> None:
    with pytest.raises(ValueError) as info:
        make_policy("fastest")

    message = str(info.value)
    assert "'fastest'" in message
    assert all(name in message for name in POLICY_NAMES)


# --- pick_excluding ----------------------------------------------------------------------


def test_pick_excluding_skips_tried_workers() -> None:
    policy = make_policy("round_robin")
    workers = [make_worker(f"w{i}") for i in range(3)]

    picks = [pick_excluding(policy, key(), workers, {"w0"}) for _ in range(4)]

    assert [w.id for w in picks if w is not None] == ["w1", "w2", "w1", "w2"]


def test_pick_excluding_returns_none_when_everyone_was_tried() -> None:
    policy = make_policy("least_load")
    workers = [make_worker("w0"), make_worker("w1")]

    assert pick_excluding(policy, key(), workers, {"w0", "w1"}) is None
    assert pick_excluding(policy, key(), [], set()) is None


def test_pick_excluding_with_nothing_tried_uses_every_candidate() -> None:
    policy = make_policy("round_robin")
    workers = [make_worker(f"w{i}") for i in range(3)]

    picks = [pick_excluding(policy, key(), workers, ()) for _ in range(3)]

    assert [w.id for w in picks if w is not None] == ["w0", "w1", "w2"]


def test_pick_excluding_keeps_a_session_on_its_worker_until_it_was_tried() -> None:
    policy = make_policy("consistent_hash")
    workers = [make_worker(f"w{i}") for i in range(4)]
    home = policy.pick(key(b"abc"), workers)

    retry = pick_excluding(policy, key(b"abc"), workers, {home.id})

    assert pick_excluding(policy, key(b"abc"), workers, {"nobody"}) is home
    assert retry is not None and retry is not home


# --- routing_key -------------------------------------------------------------------------


def test_routing_key_prefers_the_session_header() -> None:
    body = {"messages": [{"role": "user", "content": "hello"}]}

    assert routing_key(b"sess-1", body) == b"sess-1"
    assert routing_key(b"", body) == b"hello"


def test_routing_key_is_stable_as_a_chat_grows() -> None:
    first_turn = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a prime."},
    ]
    later_turn = [
        *first_turn,
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "Another one."},
    ]

    first = routing_key(None, {"messages": first_turn})

    assert first == b"You are terse.\nName a prime."
    assert routing_key(None, {"messages": later_turn}) == first
    other = [first_turn[0], {"role": "user", "content": "Name a colour."}]
    assert routing_key(None, {"messages": other}) != first


def test_routing_key_reads_text_content_parts() -> None:
    content = [
        {"type": "image_url", "image_url": {"url": "data:,"}},
        {"type": "text", "text": "Describe"},
        {"type": "text", "text": " this."},
    ]

    assert routing_key(None, {"messages": [{"role": "user", "content": content}]}) == (
        b"Describe this."
    )


def test_routing_key_caps_the_prefix() -> None:
    shared = "x" * 256

    one = routing_key(None, {"prompt": shared + "one"})
    two = routing_key(None, {"messages": [{"role": "user", "content": shared + "two"}]})

    assert one == two == shared.encode()


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"prompt": "Once upon"}, b"Once upon"),
        ({"prompt": ["first", "second"]}, b"first"),
        ({"prompt": [1, 2, 3]}, b"ids:1,2,3"),
        ({"prompt": [[4, 5], [6]]}, b"ids:4,5"),
        ({"text": "generate me"}, b"generate me"),
        ({"text": ["batch a", "batch b"]}, b"batch a"),
        ({"input_ids": [9, 8, 7]}, b"ids:9,8,7"),
        ({"input_ids": list(range(100))}, ("ids:" + ",".join(map(str, range(64)))).encode()),
    ],
)
def test_routing_key_from_prompt_fields(body: dict[str, object], expected: bytes) -> None:
    assert routing_key(None, body) == expected


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"model": "m"},
        {"messages": []},
        {"messages": "not a list"},
        {"messages": [{"role": "user", "content": None}]},
        {"prompt": ""},
        {"prompt": []},
        {"prompt": 12},
        {"prompt": [1, "mixed"]},
        {"input_ids": [True, False]},
    ],
)
def test_routing_key_is_none_when_nothing_is_usable(body: dict[str, object]) -> None:
    assert routing_key(None, body) is None


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_ranked_pick_is_the_policys_pick_ranked_and_none_without_one(name: str) -> None:
    policy = make_policy(name, rng=random.Random(0))
    for _ in range(2):  # the second asks the class's cached answer
        ranked = ranked_pick(policy)
        if name == "kv_aware":  # the one policy that chooses the DP rank too
            assert ranked is not None and ranked.__self__ is policy  # type: ignore[attr-defined]
        else:
            assert ranked is None
