"""What a request claims of the admission gate, and what its client key lets it claim.

A request's **priority class** is its key's class (`priority` in the keys file, else
`--default-priority`), or the class it names in the `x-priority` header. A header may
choose any class from the key's `max_priority` (by default the key's own class) down:
moving oneself down hurts nobody, moving up is a grant of the operator's. A class above
that, or a name that is no class, is answered 400, never silently changed: a client that
believes it is interactive while it is served as batch would be debugging the wrong thing.

A request's **tenant**, whose fair share of its class it draws on, is its key, or, for a
key whose entry names a `tenant_header`, the value of that header (one tenant per value,
within the key). A header value is a client's word: a key that names one is trusted to
split its own traffic (a gateway in front of many users), and whatever it sends is held
to 1-128 printable ASCII characters. Requests no keys-file entry speaks for (no client
keys, or `--api-key`) take `--tenant-header`.

Everything a key allows is compiled once per key (`Grants`), when the keys are read: the
request path does at most two header lookups, and none when no class and no tenant
header are configured.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from router.api.errors import InvalidPriority, InvalidTenant, PriorityNotAllowed
from router.edge.fair_queue import TenantId, TenantLimits
from router.http.server.messages import Request

PRIORITY_HEADER = b"x-priority"
MAX_TENANT_BYTES = 128
CLASS_NAME = re.compile(r"[a-z][a-z0-9_-]{0,31}")
HEADER_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,63}")
# Headers whose meaning is fixed elsewhere: a tenant header cannot be one of them.
RESERVED_HEADERS = frozenset(
    {
        "authorization",
        "content-length",
        "content-type",
        "transfer-encoding",
        "host",
        "connection",
        PRIORITY_HEADER.decode(),
    }
)
_TENANT_VALUE = re.compile(rb"[\x21-\x7e]{1,%d}" % MAX_TENANT_BYTES)
_SHOWN_CLAIM = re.compile(rb"[\x21-\x7e]{1,32}")


class TrafficSettingsError(ValueError):
    """A priority class, tenant header or cap that cannot be used; the message says why."""


@dataclass(frozen=True, slots=True)
class PriorityClasses:
    """The operator's priority classes, highest first (none: every request is one class)."""

    names: tuple[str, ...] = ()
    default: str = ""
    lowest_share: float = 0.0
    """Share of the slots handed out the lowest class gets while a higher one waits."""

    def __post_init__(self) -> None:
        for name in self.names:
            if not CLASS_NAME.fullmatch(name):
                raise TrafficSettingsError(
                    f"priority class {name!r} must be 1-32 lower-case letters, digits, '_' or "
                    "'-', starting with a letter"
                )
        if len(set(self.names)) != len(self.names):
            raise TrafficSettingsError(f"priority classes repeat a name: {', '.join(self.names)}")
        if self.names and self.default not in self.names:
            raise TrafficSettingsError(
                f"the default priority {self.default!r} is not one of the classes "
                f"({', '.join(self.names)})"
            )
        if not self.names and self.default:
            raise TrafficSettingsError(
                f"a default priority ({self.default!r}) needs priority classes"
            )
        if not 0 <= self.lowest_share < 1:
            raise TrafficSettingsError(
                f"the lowest class's share must be at least 0 and below 1, got {self.lowest_share}"
            )

    @property
    def count(self) -> int:
        return max(1, len(self.names))

    def rank(self, name: str) -> int:
        """The class's rank (0 is the highest); TrafficSettingsError for a name that is none."""
        if not self.names:
            raise TrafficSettingsError(f"priority {name!r} named, but no priority classes are set")
        try:
            return self.names.index(name)
        except ValueError:
            raise TrafficSettingsError(
                f"{name!r} is not a priority class (one of {', '.join(self.names)})"
            ) from None

    def name_of(self, rank: int) -> str:
        return self.names[rank] if self.names else "-"


@dataclass(frozen=True, slots=True)
class KeyTraffic:
    """What one key's entry says of its traffic; None leaves the router's default."""

    priority: str | None = None
    max_priority: str | None = None
    tenant_header: str | None = None
    weight: int | None = None
    max_inflight: int | None = None
    max_queued: int | None = None


@dataclass(frozen=True, slots=True)
class TrafficSettings:
    """The router-wide part: the classes, and the defaults every key starts from."""

    classes: PriorityClasses = field(default_factory=PriorityClasses)
    tenant_header: str = ""
    """The tenant header of requests no keys-file entry speaks for ("" : none)."""
    tenant_max_inflight: int = 0
    tenant_max_queued: int = 0

    def __post_init__(self) -> None:
        if self.tenant_header:
            check_header_name(self.tenant_header)
        if self.tenant_max_inflight < 0 or self.tenant_max_queued < 0:
            raise TrafficSettingsError("tenant caps must be 0 (none) or more")

    @property
    def plain(self) -> bool:
        """True when nothing here changes admission from one FIFO line per key."""
        return (
            not self.classes.names
            and not self.tenant_header
            and not self.tenant_max_inflight
            and not self.tenant_max_queued
        )


def check_header_name(name: str) -> None:
    if not HEADER_NAME.fullmatch(name) or name in RESERVED_HEADERS:
        raise TrafficSettingsError(
            f"tenant header {name!r} must be a lower-case header name (letters, digits, '-'), "
            f"and none of {', '.join(sorted(RESERVED_HEADERS))}"
        )


@dataclass(frozen=True, slots=True)
class Claims:
    """What the gate reads of one request: its class, its tenant and the tenant's limits."""

    rank: int
    tenant: TenantId
    limits: TenantLimits
    key: str
    """The key's name (`-` without one): the only tenant label metrics ever carry."""


DEFAULT_CLAIMS = Claims(0, ("-", ""), TenantLimits(), "-")


class Grants:
    """What one key may claim, compiled once when the keys are read."""

    __slots__ = ("_ceiling", "_classes", "_default", "_fixed", "_limits", "_tenant_header", "key")

    def __init__(self, key: str, entry: KeyTraffic, settings: TrafficSettings) -> None:
        """Raises TrafficSettingsError when the entry names a class or header that cannot be."""
        classes = settings.classes
        self.key = key
        self._classes = classes
        default = entry.priority if entry.priority is not None else classes.default
        self._default = classes.rank(default) if default else 0
        ceiling = entry.max_priority
        self._ceiling = classes.rank(ceiling) if ceiling is not None else self._default
        if self._ceiling > self._default:
            raise TrafficSettingsError(
                f"max_priority {ceiling!r} is below the key's own priority {default!r}"
            )
        header = entry.tenant_header if entry.tenant_header is not None else settings.tenant_header
        if header:
            check_header_name(header)
        self._tenant_header = header.encode() if header else None
        for setting, value in (
            ("weight", entry.weight),
            ("max_inflight", entry.max_inflight),
            ("max_queued", entry.max_queued),
        ):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 0
            ):
                raise TrafficSettingsError(f"{setting} must be a whole number, got {value!r}")
        if entry.weight is not None and not 1 <= entry.weight <= 100:
            raise TrafficSettingsError(f"weight must be 1 to 100, got {entry.weight}")
        self._limits = TenantLimits(
            weight=entry.weight or 1,
            max_inflight=settings.tenant_max_inflight
            if entry.max_inflight is None
            else entry.max_inflight,
            max_queued=settings.tenant_max_queued if entry.max_queued is None else entry.max_queued,
        )
        self._fixed = (
            Claims(self._default, (key, ""), self._limits, key)
            if not classes.names and self._tenant_header is None
            else None
        )

    @property
    def capped(self) -> bool:
        """Whether the key's tenants have caps of their own (which need the gate)."""
        return bool(self._limits.max_inflight or self._limits.max_queued)

    def claims(self, request: Request) -> Claims:
        """The request's class and tenant. Raises InvalidPriority, PriorityNotAllowed or
        InvalidTenant (400 each) for a header this key may not send as it is."""
        fixed = self._fixed
        if fixed is not None:
            return fixed
        rank = self._default
        if self._classes.names:
            claimed = request.header(PRIORITY_HEADER)
            if claimed is not None:
                rank = self._claimed_rank(claimed)
        sub = ""
        if self._tenant_header is not None:
            value = request.header(self._tenant_header)
            if value is not None:
                if not _TENANT_VALUE.fullmatch(value):
                    raise InvalidTenant(
                        f"the {self._tenant_header.decode()} header must be 1-{MAX_TENANT_BYTES} "
                        "printable ASCII characters without spaces"
                    )
                sub = value.decode("ascii")
        return Claims(rank, (self.key, sub), self._limits, self.key)

    def _claimed_rank(self, claimed: bytes) -> int:
        classes = self._classes
        name = claimed.strip().lower()
        try:
            rank = classes.names.index(name.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            shown = f" {name.decode('ascii')!r}" if _SHOWN_CLAIM.fullmatch(name) else ""
            raise InvalidPriority(
                f"x-priority{shown} is not a priority class of this router "
                f"(one of {', '.join(classes.names)})"
            ) from None
        if rank < self._ceiling:
            who = "requests without a client key" if self.key == "-" else f"key '{self.key}'"
            raise PriorityNotAllowed(
                f"{who} may claim priority '{classes.names[self._ceiling]}' or below, "
                f"not '{classes.names[rank]}' (x-priority)"
            )
        return rank
