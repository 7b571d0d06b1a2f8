"""Client keys: who may use the API routes, checked before anything else happens.

`--api-key` gives one key; `--api-keys-file` gives several, each with a name that becomes
the `key` label of `router_requests_total`. The label's values come only from that file
(or `default` for `--api-key`), never from the client's bytes, so a client cannot grow
the metric's cardinality. Every configured key is compared, in constant time each, so the
answer takes as long for a near miss as for a stranger.

A key's entry is its key (`name: key`, the original form) or a mapping with the key and
what it may claim of admission (`router.edge.claims`): its priority class and the highest
class it may claim, a tenant header, its weight and caps. Both forms mix in one file.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import signal
from dataclasses import dataclass, field
from pathlib import Path

import trio
import yaml

from router.api.errors import InvalidApiKey
from router.edge.claims import Grants, KeyTraffic, TrafficSettings, TrafficSettingsError

log = logging.getLogger("router.auth")

SINGLE_KEY_NAME = "default"
NO_KEY_NAME = "-"
# The fields of a key's entry in its mapping form, beside `key`.
TRAFFIC_FIELDS = (
    "priority",
    "max_priority",
    "tenant_header",
    "weight",
    "max_inflight",
    "max_queued",
)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_BEARER = b"bearer "


class KeysFileError(ValueError):
    """A keys file that cannot be used; the message says which entry and why."""


@dataclass(frozen=True, slots=True)
class NamedKey:
    name: str
    secret: bytes
    traffic: KeyTraffic = field(default_factory=KeyTraffic)

    @property
    def digest(self) -> bytes:
        return _digest(self.secret)


def _digest(secret: bytes) -> bytes:
    """Keys are compared as digests of one length: no timing tells the key's length either."""
    return hashlib.sha256(secret).digest()


def read_keys_file(path: Path) -> list[NamedKey]:
    """A YAML mapping `name: key` or `name: {key: ..., priority: ..., ...}`. Names are short
    labels; keys are non-empty and unique; a mapping's fields are checked for their types
    here and for their meaning (classes, headers) by `ClientKeys`."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise KeysFileError(f"keys file {path}: {exc}") from None
    if isinstance(data, dict) and isinstance(data.get("keys"), dict):
        data = data["keys"]
    if not isinstance(data, dict) or not data:
        raise KeysFileError(f"keys file {path}: expected a mapping of key name to key")
    keys: list[NamedKey] = []
    seen: set[bytes] = set()
    for name, entry in data.items():
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise KeysFileError(
                f"keys file {path}: key name {name!r} must be 1-64 letters, digits, '_', '.' or '-'"
            )
        secret, traffic = _entry(path, name, entry)
        if not isinstance(secret, str) or not secret or not secret.isprintable() or " " in secret:
            raise KeysFileError(
                f"keys file {path}: the key of {name!r} must be a non-empty string without spaces"
            )
        encoded = secret.encode()
        if encoded in seen:
            raise KeysFileError(
                f"keys file {path}: the key of {name!r} is also given to another name"
            )
        seen.add(encoded)
        keys.append(NamedKey(name, encoded, traffic))
    return keys


def _entry(path: Path, name: str, entry: object) -> tuple[object, KeyTraffic]:
    """The key and the traffic settings of one entry, in either form."""
    if not isinstance(entry, dict):
        return entry, KeyTraffic()
    unknown = sorted(str(field) for field in entry if field not in ("key", *TRAFFIC_FIELDS))
    if unknown:
        raise KeysFileError(
            f"keys file {path}: {name!r} has unknown field(s) {', '.join(unknown)} "
            f"(known: key, {', '.join(TRAFFIC_FIELDS)})"
        )
    for setting in ("priority", "max_priority", "tenant_header"):
        value = entry.get(setting)
        if value is not None and not isinstance(value, str):
            raise KeysFileError(f"keys file {path}: {name!r}: {setting} must be a string")
    for setting in ("weight", "max_inflight", "max_queued"):
        value = entry.get(setting)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise KeysFileError(f"keys file {path}: {name!r}: {setting} must be a whole number")
    return entry.get("key"), KeyTraffic(
        priority=entry.get("priority"),
        max_priority=entry.get("max_priority"),
        tenant_header=entry.get("tenant_header"),
        weight=entry.get("weight"),
        max_inflight=entry.get("max_inflight"),
        max_queued=entry.get("max_queued"),
    )


def _warn_if_readable_by_others(path: Path) -> None:
    """Keys in a file anyone on the host can read are keys anyone on the host has."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return
    if mode & 0o077:
        log.warning(
            "keys file %s can be read by other users (mode %o): chmod 600 it", path, mode & 0o777
        )


class ClientKeys:
    """The keys a client may present, and which name each one has.

    `named` is True when the keys come from a file: only then do metrics carry a `key` label.
    `grants(name)` is what a key may claim of admission; `anonymous` is what a request
    without a key may (when the router checks no keys). `caps_in_force` says whether any
    key (or the keyless client) has tenant caps, which need the admission gate even without
    a concurrency limit; `classes_in_force` whether requests have classes to claim.
    """

    def __init__(
        self, single_key: str = "", keys_file: str = "", traffic: TrafficSettings | None = None
    ) -> None:
        self._single = single_key
        self._path = Path(keys_file) if keys_file else None
        self.named = self._path is not None
        self.traffic = traffic if traffic is not None else TrafficSettings()
        self._keys: list[NamedKey] = []
        self._digests: list[tuple[bytes, str]] = []
        self._grants: dict[str, Grants] = {}
        try:
            self.anonymous = Grants(NO_KEY_NAME, KeyTraffic(), self.traffic)
        except TrafficSettingsError as error:
            raise KeysFileError(str(error)) from None
        self.classes_in_force = bool(self.traffic.classes.names)
        self.caps_in_force = self.anonymous.capped
        self.reload()

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def names(self) -> list[str]:
        return [key.name for key in self._keys]

    def grants(self, name: str) -> Grants:
        """What the key `name` (as `check` returned it) may claim of admission."""
        return self._grants[name]

    def reload(self) -> None:
        """Read the keys again. Raises KeysFileError and keeps the old keys when the file is bad."""
        keys: list[NamedKey] = []
        if self._path is not None:
            keys = read_keys_file(self._path)
            _warn_if_readable_by_others(self._path)
        if self._single:
            if any(key.name == SINGLE_KEY_NAME for key in keys):
                raise KeysFileError(
                    f"keys file {self._path}: the name {SINGLE_KEY_NAME!r} is taken by --api-key"
                )
            keys.append(NamedKey(SINGLE_KEY_NAME, self._single.encode()))
        grants: dict[str, Grants] = {}
        for key in keys:
            try:
                grants[key.name] = Grants(key.name, key.traffic, self.traffic)
            except TrafficSettingsError as error:
                raise KeysFileError(f"keys file {self._path}: {key.name!r}: {error}") from None
        self._keys = keys
        self._digests = [(key.digest, key.name) for key in keys]
        self._grants = grants
        self.caps_in_force = self.anonymous.capped or any(grant.capped for grant in grants.values())

    def check(self, authorization: bytes | None) -> str:
        """The name of the key in an `Authorization: Bearer <key>` header.

        Raises InvalidApiKey (401) for a missing header, another scheme, or a key that is
        not configured. The message never repeats what the client sent.
        """
        if authorization is None:
            raise InvalidApiKey(
                "this router requires an API key: send 'Authorization: Bearer <key>'"
            )
        if authorization[:7].lower() != _BEARER:
            raise InvalidApiKey("the Authorization header must be 'Bearer <key>'")
        presented = authorization[7:].strip()
        digest = _digest(presented)
        found: str | None = None
        # Every key is compared, even after a match: the time taken does not say which matched.
        for secret_digest, name in self._digests:
            if hmac.compare_digest(digest, secret_digest) and found is None:
                found = name
        if found is None or not presented:
            raise InvalidApiKey("the API key is not valid")
        return found


async def serve_key_reloads(
    keys: ClientKeys, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Re-read the keys file on every SIGHUP until cancelled.

    A file that cannot be used is logged and the keys in force stay as they were: a typo
    must lock nobody out and let no one in.
    """
    with trio.open_signal_receiver(signal.SIGHUP) as signals:
        task_status.started()
        async for _ in signals:
            try:
                keys.reload()
            except KeysFileError as error:
                log.error("SIGHUP: keeping the %d keys in force: %s", len(keys.names()), error)
                continue
            log.info(
                "SIGHUP: %d client keys in force (%s)", len(keys.names()), ", ".join(keys.names())
            )
