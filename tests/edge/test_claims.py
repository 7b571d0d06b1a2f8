"""What a request may claim of admission: its class from its key or the x-priority header
(down from the key's ceiling, never up), its tenant from a header the key names, and the
400s for a claim the key may not make or a header that is garbage."""

from __future__ import annotations

import pytest

from router.api.errors import InvalidPriority, InvalidTenant, PriorityNotAllowed
from router.edge.claims import (
    Grants,
    KeyTraffic,
    PriorityClasses,
    TrafficSettings,
    TrafficSettingsError,
)
from router.edge.fair_queue import TenantLimits
from router.http.server.messages import Request

CLASSES = PriorityClasses(("interactive", "standard", "batch"), "standard")
SETTINGS = TrafficSettings(classes=CLASSES)


def _request(*headers: tuple[bytes, bytes]) -> Request:
    return Request("POST", "/v1/chat/completions", list(headers))


def test_without_classes_or_tenant_headers_the_claims_are_fixed_and_no_header_is_read() -> None:
    grants = Grants("alice", KeyTraffic(), TrafficSettings())
    first = grants.claims(_request((b"x-priority", b"\xff garbage")))
    assert first is grants.claims(_request())
    assert (first.rank, first.tenant, first.key) == (0, ("alice", ""), "alice")


def test_a_key_gets_its_class_and_may_move_itself_down() -> None:
    grants = Grants("bot", KeyTraffic(priority="standard"), SETTINGS)
    assert grants.claims(_request()).rank == 1
    assert grants.claims(_request((b"x-priority", b"batch"))).rank == 2
    assert grants.claims(_request((b"x-priority", b" Standard "))).rank == 1


def test_a_key_claiming_a_class_above_its_ceiling_is_a_400() -> None:
    grants = Grants("bot", KeyTraffic(priority="batch"), SETTINGS)
    with pytest.raises(PriorityNotAllowed) as caught:
        grants.claims(_request((b"x-priority", b"interactive")))
    error = caught.value
    assert (error.status, error.code) == (400, "priority_not_allowed")
    assert error.message == (
        "key 'bot' may claim priority 'batch' or below, not 'interactive' (x-priority)"
    )


def test_a_ceiling_lets_a_key_claim_up_to_it_and_no_further() -> None:
    grants = Grants("app", KeyTraffic(priority="batch", max_priority="standard"), SETTINGS)
    assert grants.claims(_request()).rank == 2
    assert grants.claims(_request((b"x-priority", b"standard"))).rank == 1
    with pytest.raises(PriorityNotAllowed):
        grants.claims(_request((b"x-priority", b"interactive")))


def test_requests_without_a_key_take_the_default_and_its_ceiling() -> None:
    grants = Grants("-", KeyTraffic(), SETTINGS)
    assert grants.claims(_request()).rank == 1
    with pytest.raises(PriorityNotAllowed, match="requests without a client key may claim"):
        grants.claims(_request((b"x-priority", b"interactive")))


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (b"urgent", "'urgent'"),
        (b"", None),
        (b"0", "'0'"),
        (b"inter\xffactive", None),
        (b"a" * 200, None),
        (b"batch, interactive", None),
    ],
)
def test_garbage_in_the_priority_header_is_a_400_that_echoes_only_a_plain_word(
    value: bytes, shown: str | None
) -> None:
    grants = Grants("bot", KeyTraffic(), SETTINGS)
    with pytest.raises(InvalidPriority) as caught:
        grants.claims(_request((b"x-priority", value)))
    error = caught.value
    assert (error.status, error.code) == (400, "invalid_priority")
    assert "(one of interactive, standard, batch)" in error.message
    if shown is not None:
        assert f"x-priority {shown} is not a priority class" in error.message
    else:
        assert error.message.startswith("x-priority is not a priority class")


def test_a_tenant_header_splits_a_key_into_tenants_of_its_own() -> None:
    grants = Grants(
        "gateway",
        KeyTraffic(tenant_header="x-tenant-id", max_inflight=2, weight=3),
        TrafficSettings(tenant_max_queued=5),
    )
    claims = grants.claims(_request((b"x-tenant-id", b"user-17")))
    assert claims.tenant == ("gateway", "user-17")
    assert claims.key == "gateway"
    assert claims.limits == TenantLimits(weight=3, max_inflight=2, max_queued=5)
    assert grants.claims(_request()).tenant == ("gateway", "")
    assert grants.capped


@pytest.mark.parametrize("value", [b"", b"has space", b"x" * 129, "naïve".encode(), b"a\tb"])
def test_garbage_in_the_tenant_header_is_a_400(value: bytes) -> None:
    grants = Grants("gateway", KeyTraffic(tenant_header="x-tenant-id"), TrafficSettings())
    with pytest.raises(InvalidTenant) as caught:
        grants.claims(_request((b"x-tenant-id", value)))
    assert (caught.value.status, caught.value.code) == (400, "invalid_tenant")
    assert "1-128 printable ASCII characters" in caught.value.message


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        (KeyTraffic(priority="urgent"), "'urgent' is not a priority class"),
        (KeyTraffic(max_priority="nope"), "'nope' is not a priority class"),
        (
            KeyTraffic(priority="standard", max_priority="batch"),
            "max_priority 'batch' is below the key's own priority 'standard'",
        ),
        (KeyTraffic(tenant_header="Authorization"), "must be a lower-case header name"),
        (KeyTraffic(tenant_header="x-priority"), "none of"),
        (KeyTraffic(weight=0), "weight must be 1 to 100"),
        (KeyTraffic(weight=1000), "weight must be 1 to 100"),
        (KeyTraffic(max_inflight=-1), "max_inflight must be a whole number"),
    ],
)
def test_an_entry_that_claims_what_cannot_be_is_refused(entry: KeyTraffic, problem: str) -> None:
    with pytest.raises(TrafficSettingsError, match=problem):
        Grants("bot", entry, SETTINGS)


@pytest.mark.parametrize(
    ("names", "default", "share", "problem"),
    [
        (("high", "low"), "medium", 0.0, "the default priority 'medium' is not one"),
        (("high", "high"), "high", 0.0, "repeat a name"),
        (("High",), "High", 0.0, "lower-case letters"),
        ((), "high", 0.0, "needs priority classes"),
        (("a", "b"), "a", 1.0, "below 1"),
    ],
)
def test_classes_that_cannot_be_used_are_refused(
    names: tuple[str, ...], default: str, share: float, problem: str
) -> None:
    with pytest.raises(TrafficSettingsError, match=problem):
        PriorityClasses(names, default, share)
