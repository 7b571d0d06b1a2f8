"""Fuzz the traffic policy's two readers of what others write: the claims a request's
headers make, and the aliases and fallbacks an operator states.

Properties, for every example:
- a priority or tenant header of any bytes is a claim the key may make, or one of the
  three 400s (`invalid_priority`, `priority_not_allowed`, `invalid_tenant`), never another
  exception; a granted class is never above the key's ceiling, and an error message
  repeats nothing that is not plain printable ASCII;
- any set of aliases and fallbacks over a few names is refused at start-up with
  ModelNamesError, or resolves every name to a route that names each model once, never
  an alias, and starts with the name or one of the alias's models.

Examples: `ROUTER_FUZZ_EXAMPLES` (200 by default; `make fuzz` runs 10,000).
"""

from __future__ import annotations

import os

from hypothesis import given, settings
from hypothesis import strategies as st

from router.api.errors import BadRequest, InvalidPriority, InvalidTenant, PriorityNotAllowed
from router.edge.claims import Grants, KeyTraffic, PriorityClasses, TrafficSettings
from router.http.server.messages import Request
from router.pipeline.model_names import ModelNames, ModelNamesError

EXAMPLES = int(os.environ.get("ROUTER_FUZZ_EXAMPLES", "200"))
CLASSES = PriorityClasses(("system", "interactive", "standard", "batch"), "standard")
NAMES = ("a", "b", "c", "d", "e")

_header_bytes = st.one_of(
    st.binary(max_size=300),
    st.sampled_from([b"batch", b" Interactive ", b"SYSTEM", b"standard\r\n", b"b\x00atch"]),
)


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    claimed=st.none() | _header_bytes,
    tenant=st.none() | _header_bytes,
    ceiling=st.sampled_from(["system", "interactive", "standard"]),
)
def test_any_header_bytes_are_a_granted_claim_or_a_clear_400(
    claimed: bytes | None, tenant: bytes | None, ceiling: str
) -> None:
    grants = Grants(
        "gateway",
        KeyTraffic(priority="standard", max_priority=ceiling, tenant_header="x-user"),
        TrafficSettings(classes=CLASSES),
    )
    headers = [
        (name, value)
        for name, value in ((b"x-priority", claimed), (b"x-user", tenant))
        if value is not None
    ]
    try:
        claims = grants.claims(Request("POST", "/v1/chat/completions", headers))
    except (InvalidPriority, PriorityNotAllowed, InvalidTenant) as error:
        assert isinstance(error, BadRequest) and error.status == 400
        assert error.message.isprintable() and error.message.isascii()
        return
    assert CLASSES.rank(ceiling) <= claims.rank < len(CLASSES.names)
    key, sub = claims.tenant
    assert key == "gateway" and claims.key == "gateway"
    assert sub == ("" if tenant is None else tenant.decode("ascii"))


_aliases = st.dictionaries(
    st.sampled_from(NAMES),
    st.dictionaries(st.sampled_from(NAMES), st.integers(1, 5), min_size=1, max_size=3),
    max_size=3,
)
_fallbacks = st.dictionaries(
    st.sampled_from(NAMES), st.lists(st.sampled_from(NAMES), min_size=1, max_size=3), max_size=4
)


@settings(max_examples=EXAMPLES, deadline=None)
@given(aliases=_aliases, fallbacks=_fallbacks, draw=st.floats(0, 0.999999))
def test_any_names_are_refused_at_start_up_or_resolve_without_a_loop(
    aliases: dict[str, dict[str, int]], fallbacks: dict[str, list[str]], draw: float
) -> None:
    try:
        names = ModelNames(
            {
                alias: [(m, float(w)) for m, w in targets.items()]
                for alias, targets in aliases.items()
            },
            fallbacks,
        )
    except ModelNamesError as error:
        assert "alias" in str(error) or "loop" in str(error) or "twice" in str(error)
        return
    for name in NAMES:
        route = names.resolve(name, lambda: draw)
        if route is None:
            assert name not in aliases and name not in fallbacks
            continue
        models = route.models
        assert len(models) == len(set(models))
        assert not set(models) & set(aliases)
        if name in aliases:
            assert route.alias == name and models[0] in aliases[name]
        else:
            assert models[0] == name
