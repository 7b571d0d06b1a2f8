"""Pods as workers: which Pod is a candidate, what record it makes, and how watch events
change the fleet. Pure and synchronous: the watch loop (router.discovery.kubernetes)
feeds it what the API server says.

A Pod is a candidate when its phase is `Running`, it has a `podIP`, its `Ready`
condition is `True` and it matches a selector. A Pod with `metadata.deletionTimestamp`
is DRAINING at once (a terminating Pod stays `Running` through its preStop sleep); it
leaves the fleet on the `DELETED` event. A Pod that stops being a candidate otherwise
(not Ready, no IP, another phase) leaves at once; requests in flight to it finish.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from router.fleet.records import InvalidWorkerRecord, Role, Status, WorkerRecord, disagg_meta
from router.fleet.registry import Fleet

log = logging.getLogger("router.discovery.kubernetes")

ANNOTATION_PREFIX = "trio-router/"
PORT_ANNOTATION = ANNOTATION_PREFIX + "port"
MODEL_ANNOTATION = ANNOTATION_PREFIX + "model"
ADAPTERS_ANNOTATION = ANNOTATION_PREFIX + "adapters"
ROLE_ANNOTATION = ANNOTATION_PREFIX + "role"
DP_SIZE_ANNOTATION = ANNOTATION_PREFIX + "dp-size"
ENGINE_ANNOTATION = ANNOTATION_PREFIX + "engine"
BOOTSTRAP_PORT_ANNOTATION = "sglang.ai/bootstrap-port"  # the SGLang gateway's own
PD_PROTOCOL_ANNOTATION = ANNOTATION_PREFIX + "pd-protocol"
PROTOCOL_ANNOTATION = ANNOTATION_PREFIX + "protocol"
"""`http` (default) or `grpc`: the scheme of the Pod's worker URL."""


class BadSelector(ValueError):
    """A label selector the router cannot use; the message says why."""


@dataclass(frozen=True, slots=True)
class Selector:
    """Equality terms `k=v[,k=v]`: the form the SGLang gateway's selector flags take."""

    terms: tuple[tuple[str, str], ...]

    @classmethod
    def parse(cls, text: str) -> Selector:
        terms = []
        for raw in text.split(","):
            term = raw.strip()
            if not term:
                continue
            key, sep, value = term.partition("=")
            value = value.removeprefix("=")  # `k==v` means the same
            if not sep or not key.strip() or any(c in key + value for c in "!()<> "):
                raise BadSelector(f"label selector term {term!r} is not key=value")
            terms.append((key.strip(), value.strip()))
        if not terms:
            raise BadSelector(f"label selector {text!r} has no key=value term")
        return cls(tuple(terms))

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(labels.get(key) == value for key, value in self.terms)

    def __str__(self) -> str:
        return ",".join(f"{key}={value}" for key, value in self.terms)


@dataclass(frozen=True, slots=True)
class PodSource:
    """One selector and the role its Pods take (unless a Pod's annotation names one)."""

    role: Role
    selector: Selector


def pod_sources(mixed: str, prefill: str, decode: str) -> tuple[PodSource, ...]:
    """The selectors given, in the order a Pod that matches several is claimed: prefill,
    decode, then mixed. BadSelector when one is malformed or none is given."""
    sources = [
        PodSource(role, Selector.parse(text))
        for role, text in ((Role.PREFILL, prefill), (Role.DECODE, decode), (Role.MIXED, mixed))
        if text.strip()
    ]
    if not sources:
        raise BadSelector(
            "Kubernetes discovery needs --k8s-selector or --k8s-prefill-selector/--k8s-decode-selector"
        )
    return tuple(sources)


@dataclass(frozen=True, slots=True)
class PodFacts:
    """What discovery reads of one Pod."""

    namespace: str
    name: str
    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    phase: str | None
    ip: str | None
    ready: bool
    terminating: bool
    resource_version: str | None

    @property
    def worker_id(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def candidate(self) -> bool:
        return self.phase == "Running" and bool(self.ip) and self.ready and not self.terminating

    @classmethod
    def of(cls, pod: Any) -> PodFacts:
        """Read a Pod object; InvalidWorkerRecord when it is not one."""
        if not isinstance(pod, dict) or not isinstance(pod.get("metadata"), dict):
            raise InvalidWorkerRecord("not a Pod object")
        meta, status = pod["metadata"], pod.get("status") or {}
        name, namespace = meta.get("name"), meta.get("namespace", "")
        if not isinstance(name, str) or not name or not isinstance(namespace, str):
            raise InvalidWorkerRecord("a Pod without a name")
        conditions = status.get("conditions") if isinstance(status, dict) else None
        ready = any(
            isinstance(c, dict) and c.get("type") == "Ready" and c.get("status") == "True"
            for c in (conditions if isinstance(conditions, list) else [])
        )
        labels, annotations = meta.get("labels") or {}, meta.get("annotations") or {}
        ip = status.get("podIP") if isinstance(status, dict) else None
        phase = status.get("phase") if isinstance(status, dict) else None
        return cls(
            namespace=namespace,
            name=name,
            labels=labels if isinstance(labels, dict) else {},
            annotations=annotations if isinstance(annotations, dict) else {},
            phase=phase if isinstance(phase, str) else None,
            ip=ip if isinstance(ip, str) and ip else None,
            ready=ready,
            terminating=meta.get("deletionTimestamp") is not None,
            resource_version=meta.get("resourceVersion")
            if isinstance(meta.get("resourceVersion"), str)
            else None,
        )


def _annotation_int(facts: PodFacts, key: str, minimum: int, maximum: int) -> int | None:
    raw = facts.annotations.get(key)
    if raw is None:
        return None
    try:
        value = int(str(raw).strip())
    except ValueError:
        raise InvalidWorkerRecord(f"annotation {key} must be an integer, got {raw!r}") from None
    if not minimum <= value <= maximum:
        raise InvalidWorkerRecord(f"annotation {key} must be {minimum}-{maximum}, got {value}")
    return value


def pod_record(facts: PodFacts, role: Role, default_port: int) -> WorkerRecord:
    """The worker record of a candidate Pod; facts its annotations leave out are left to
    the engine (`unknown_facts`). InvalidWorkerRecord names a bad annotation."""
    assert facts.ip is not None
    port = _annotation_int(facts, PORT_ANNOTATION, 1, 65535) or default_port
    host = f"[{facts.ip}]" if ":" in facts.ip else facts.ip
    scheme = str(facts.annotations.get(PROTOCOL_ANNOTATION, "http"))
    if scheme not in ("http", "grpc"):
        raise InvalidWorkerRecord(
            f"annotation {PROTOCOL_ANNOTATION} must be http or grpc, got {scheme!r}"
        )
    data: dict[str, Any] = {"id": facts.worker_id, "url": f"{scheme}://{host}:{port}"}
    unknown: set[str] = set()
    data["role"] = facts.annotations.get(ROLE_ANNOTATION, role.value)
    engine = facts.annotations.get(ENGINE_ANNOTATION)
    if engine:
        data["engine"] = str(engine)  # else the engine's answers tell (engine_facts)
    models = facts.annotations.get(MODEL_ANNOTATION)
    if models:
        data["model"] = [m.strip() for m in str(models).replace(",", "+").split("+") if m.strip()]
    else:
        unknown.add("models")
    adapters = facts.annotations.get(ADAPTERS_ANNOTATION)
    if adapters:
        data["adapters"] = [
            a.strip() for a in str(adapters).replace(",", "+").split("+") if a.strip()
        ]
    dp_size = _annotation_int(facts, DP_SIZE_ANNOTATION, 1, 1024)
    if dp_size is not None:
        data["dp_size"] = dp_size
    elif engine in (None, "sglang") or scheme == "grpc":
        # SGLang states it in its server info; an engine that serves none has 1.
        unknown.add("dp_size")
    bootstrap_port = _annotation_int(facts, BOOTSTRAP_PORT_ANNOTATION, 1, 65535)
    if bootstrap_port is not None:
        protocol = str(facts.annotations.get(PD_PROTOCOL_ANNOTATION, "mooncake"))
        data["disagg_meta"] = disagg_meta(host, bootstrap_port, protocol)
    record = WorkerRecord.from_json(data)
    if record.role is Role.PREFILL and bootstrap_port is None:
        unknown.add("bootstrap_port")
    unknown |= set(record.unknown_facts)
    if record.role is not Role.PREFILL:
        unknown.discard("bootstrap_port")
    return dataclasses.replace(record, unknown_facts=frozenset(unknown))


class PodMirror:
    """Keeps the fleet equal to the candidate (and draining) Pods of every source.

    Each source's Pods are tracked apart, so a relist of one selector touches only the
    workers that selector brought. A Pod matching several selectors belongs to the first
    (prefill, decode, mixed); the others ignore it.
    """

    def __init__(self, fleet: Fleet, sources: Iterable[PodSource], default_port: int) -> None:
        self._fleet = fleet
        self._sources = tuple(sources)
        self._port = default_port
        self._owned: dict[Role, set[str]] = {source.role: set() for source in self._sources}

    def _claimed_elsewhere(self, source: PodSource, facts: PodFacts) -> bool:
        for other in self._sources:
            if other == source:
                return False
            if other.selector.matches(facts.labels):
                return True
        return False

    def relist(self, source: PodSource, pods: Iterable[Any]) -> None:
        """Make `source`'s part of the fleet exactly what a fresh listing says."""
        seen: set[str] = set()
        for pod in pods:
            facts = self._facts(pod)
            if facts is not None:
                seen.add(facts.worker_id)
                self._apply(source, facts)
        for worker_id in sorted(self._owned[source.role] - seen):
            self._leave(source, worker_id, "gone from the listing")

    def apply(self, source: PodSource, kind: str, pod: Any) -> None:
        """One watch event (ADDED, MODIFIED, DELETED) of `source`'s watch."""
        facts = self._facts(pod)
        if facts is None:
            return
        if kind == "DELETED":
            if facts.worker_id in self._owned[source.role]:
                self._leave(source, facts.worker_id, "Pod deleted")
            return
        self._apply(source, facts)

    def _facts(self, pod: Any) -> PodFacts | None:
        try:
            return PodFacts.of(pod)
        except InvalidWorkerRecord as exc:
            log.warning("skipping a watch object: %s", exc)
            return None

    def _apply(self, source: PodSource, facts: PodFacts) -> None:
        worker_id = facts.worker_id
        owned = self._owned[source.role]
        if self._claimed_elsewhere(source, facts) or not source.selector.matches(facts.labels):
            if worker_id in owned:
                self._leave(source, worker_id, "no longer matches the selector")
            return
        if facts.terminating:
            self._drain(source, worker_id)
            return
        if not facts.candidate:
            if worker_id in owned:
                why = "not Ready" if not facts.ready else f"phase {facts.phase}, IP {facts.ip}"
                self._leave(source, worker_id, why)
            return
        try:
            record = pod_record(facts, source.role, self._port)
        except InvalidWorkerRecord as exc:
            log.warning("Pod %s is not used: %s", worker_id, exc)
            if worker_id in owned:
                self._leave(source, worker_id, "its annotations became invalid")
            return
        known = self._fleet.get(worker_id)
        owned.add(worker_id)
        if self._fleet.upsert(record) is not None and known is None:
            log.info("Pod %s joined: %s, role %s", worker_id, record.url, record.role.value)

    def _drain(self, source: PodSource, worker_id: str) -> None:
        worker = self._fleet.get(worker_id)
        if worker_id in self._fleet.pending:
            # Never admitted, now terminating: it will not serve.
            self._leave(source, worker_id, "terminating before it was admitted")
            return
        if worker is None or worker.draining:
            return
        self._fleet.upsert(dataclasses.replace(worker.record, status=Status.DRAINING))
        log.info("Pod %s is terminating: DRAINING, no new requests", worker_id)

    def _leave(self, source: PodSource, worker_id: str, why: str) -> None:
        self._owned[source.role].discard(worker_id)
        if self._fleet.remove(worker_id) is not None:
            log.info("Pod %s left the fleet (%s)", worker_id, why)
