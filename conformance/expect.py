"""Compare what a step produced with what the case expects; pure, no I/O.

Each check returns human-readable failure lines (empty when everything holds). A line
names the expectation, the expected value and what was seen, so a report can be read
without the logs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from conformance.client import Answer, error_shape, stream_content, stream_end
from conformance.model import (
    ALL_WORKERS,
    BUSIEST_WORKER,
    NO_STATUS,
    Case,
    Expect,
    HandoffCheck,
    HeaderCheck,
    StatusKey,
)


@dataclass(frozen=True, slots=True)
class WorkerView:
    """What the fleet's `/debug/routing` said about one step."""

    delta: Mapping[str, int]  # dispatches per worker during the step
    total: Mapping[str, int]  # dispatches per worker since the case began
    handoffs: Mapping[str, Sequence[Mapping[str, Any]]]  # handoff fields received during the step


def status_of(answer: Answer) -> StatusKey:
    return NO_STATUS if answer.status is None else answer.status


def check_answers(expect: Expect, answers: Sequence[Answer]) -> list[str]:
    failures: list[str] = []
    seen: Counter[StatusKey] = Counter(status_of(a) for a in answers)
    if expect.status is not None:
        wrong = [
            f"{key}: expected {want}, got {seen.get(key, 0)}"
            for key, want in expect.status.items()
            if seen.get(key, 0) not in want
        ]
        wrong += [
            f"{key}: expected none, got {count}"
            for key, count in seen.items()
            if key not in expect.status
        ]
        if wrong:
            failures.append(
                f"status: {'; '.join(wrong)} (all: {_counts(seen)}){_sample(answers, expect)}"
            )
    if expect.error_code is not None:
        wanted = expect.error_code
        allowed = (wanted,) if isinstance(wanted, str) else wanted
        codes = [a.error_field("code") for a in answers]
        bad = [code for code in codes if code not in allowed]
        if bad:
            what = (
                repr(wanted)
                if isinstance(wanted, str)
                else "one of " + ", ".join(map(repr, wanted))
            )
            failures.append(
                f"error_code: expected {what} on every answer, "
                f"{len(bad)} of {len(answers)} had {_counts(Counter(map(repr, bad)))}{_first_body(answers)}"
            )
    for needle in expect.message_contains:
        missing = [
            a for a in answers if needle.lower() not in (a.error_field("message") or "").lower()
        ]
        if missing:
            failures.append(
                f"message_contains: {needle!r} missing from {len(missing)} of {len(answers)} error messages; "
                f"first: {missing[0].error_field('message')!r}"
            )
    for name, check in expect.headers.items():
        bad_values = [
            a.headers.get(name) for a in answers if not _header_ok(check, a.headers.get(name))
        ]
        if bad_values:
            failures.append(
                f"headers[{name}]: expected {check} on every answer, {len(bad_values)} of {len(answers)} "
                f"had {_counts(Counter(map(repr, bad_values)))}"
            )
    if expect.error_shape is not None:
        shapes: Counter[str] = Counter(
            str(error_shape(a))
            for a in answers
            if a.status is None or a.status >= 400 or stream_end(a) == "error"
        )
        if not shapes:
            failures.append(
                f"error_shape: expected {expect.error_shape} errors, but no answer was an error"
            )
        elif set(shapes) - {expect.error_shape}:
            failures.append(
                f"error_shape: expected {expect.error_shape} on every error, got {_counts(shapes)}{_first_body(answers)}"
            )
    if expect.body_json:
        garbled = [a for a in answers if a.json() is None]
        if garbled:
            failures.append(
                f"body_json: {len(garbled)} of {len(answers)} bodies are not JSON; first: {garbled[0].excerpt()}"
            )
    if expect.lists_models:
        short = [(a, _unlisted(expect.lists_models, a.json())) for a in answers]
        short = [(a, problems) for a, problems in short if problems]
        if short:
            first, problems = short[0]
            failures.append(
                f"lists_models: {len(short)} of {len(answers)} answers fall short; first: "
                f"{'; '.join(problems)}; body: {first.excerpt(300)}"
            )
    if expect.stream_end is not None:
        ends: Counter[str] = Counter(stream_end(a) for a in answers)
        if set(ends) != {expect.stream_end}:
            failures.append(
                f"stream_end: expected {expect.stream_end} on every stream, got {_counts(ends)}{_last_event(answers)}"
            )
    failures += _stream_contents(expect, answers)
    return failures


def _stream_contents(expect: Expect, answers: Sequence[Answer]) -> list[str]:
    if expect.stream_text is None and expect.stream_usage is None and expect.stream_ids is None:
        return []
    failures: list[str] = []
    contents = [stream_content(a) for a in answers]
    if expect.stream_text is not None:
        texts = Counter(c.text for c in contents if c.text != expect.stream_text)
        if texts:
            failures.append(
                f"stream_text: expected {expect.stream_text!r} on every stream, "
                f"{sum(texts.values())} of {len(answers)} had {_counts(Counter(map(repr, texts.elements())))}"
            )
    if expect.stream_usage is not None:
        want = dict(expect.stream_usage)
        got = Counter(
            repr([{k: u.get(k) for k in want} for u in c.usages])
            for c in contents
            if len(c.usages) != 1 or any(c.usages[0].get(k) != v for k, v in want.items())
        )
        if got:
            failures.append(
                f"stream_usage: expected one usage event with {want} on every stream, "
                f"{sum(got.values())} of {len(answers)} had {_counts(got)}"
            )
    if expect.stream_ids is not None:
        counts = Counter(len(c.ids) for c in contents)
        if set(counts) != {expect.stream_ids}:
            failures.append(
                f"stream_ids: expected {expect.stream_ids} distinct id(s) in every stream, "
                f"got {_counts(counts)}"
            )
    return failures


def _unlisted(wanted: Mapping[str, str | None], body: Any) -> list[str]:
    """How a model list falls short of `wanted` (id -> parent); empty when it lists all."""
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        return ["the answer is not a model list"]
    parents = {
        entry["id"]: entry.get("parent")
        for entry in data
        if isinstance(entry, dict) and isinstance(entry.get("id"), str)
    }
    problems = []
    for model, parent in wanted.items():
        if model not in parents:
            problems.append(f"{model!r} is not listed")
        elif parents[model] != parent:
            problems.append(f"{model!r} has parent {parents[model]!r}, expected {parent!r}")
    return problems


def check_workers(expect: Expect, case: Case, view: WorkerView) -> list[str]:
    failures: list[str] = []
    for label, wanted, counts in (
        ("dispatches", expect.dispatches, view.delta),
        ("dispatches_total", expect.dispatches_total, view.total),
    ):
        for name, want in wanted.items():
            if name == ALL_WORKERS:
                got = sum(counts.values())
            elif name == BUSIEST_WORKER:
                got = max(counts.values(), default=0)
            else:
                got = counts.get(name, 0)
            if got not in want:
                failures.append(
                    f"{label}[{name}]: expected {want}, got {got} (per worker: {_counts(counts)})"
                )
    if expect.handoffs is not None:
        failures += check_handoffs(expect.handoffs, case, view.handoffs)
    return failures


def check_handoffs(
    check: HandoffCheck, case: Case, handoffs: Mapping[str, Sequence[Mapping[str, Any]]]
) -> list[str]:
    by_role: dict[str, Counter[int]] = {"prefill": Counter(), "decode": Counter()}
    for name, items in handoffs.items():
        role = case.worker(name).role
        if role in by_role:
            for item in items:
                by_role[role].update(_rooms(item.get("bootstrap_room")))
    failures: list[str] = []
    if check.rooms_match:
        prefill, decode = by_role["prefill"], by_role["decode"]
        if not prefill or not decode:
            failures.append(
                f"handoffs.rooms_match: no handoff seen (prefill legs {sum(prefill.values())}, "
                f"decode legs {sum(decode.values())})"
            )
        elif prefill != decode:
            only_prefill = sorted((prefill - decode).elements())[:3]
            only_decode = sorted((decode - prefill).elements())[:3]
            failures.append(
                f"handoffs.rooms_match: the legs saw different rooms (prefill only: {only_prefill}, "
                f"decode only: {only_decode})"
            )
    if check.room_matches_rank:
        failures += _rank_failures(case, handoffs)
    return failures


def _rank_failures(case: Case, handoffs: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[str]:
    """Every handoff to or from a rank-multiplexed prefill names a rank, and room % dp_size
    equals it: the prefill sees the rank in its header, the decode in
    `disagg_prefill_dp_rank`."""
    prefill_by_port = {w.bootstrap_port: w for w in case.fleet if w.role == "prefill"}
    checked = 0
    problems: list[str] = []
    for name, items in handoffs.items():
        worker = case.worker(name)
        for item in items:
            if worker.role == "prefill":
                dp_size, rank = worker.dp_size, item.get("dp_rank_header")
                where = f"prefill {name} (header X-Data-Parallel-Rank)"
            elif worker.role == "decode":
                prefill = prefill_by_port.get(_int(item.get("bootstrap_port")))
                dp_size = prefill.dp_size if prefill is not None else _dp_of_only_prefill(case)
                rank = item.get("disagg_prefill_dp_rank")
                where = f"decode {name} (field disagg_prefill_dp_rank)"
            else:
                continue
            if dp_size <= 1:
                continue
            for room in _rooms(item.get("bootstrap_room")):
                checked += 1
                if _int(rank) is None:
                    problems.append(f"{where}: no rank for room {room}")
                elif room % dp_size != _int(rank):
                    problems.append(
                        f"{where}: room {room} % {dp_size} = {room % dp_size}, rank {rank}"
                    )
    if problems:
        return [
            f"handoffs.room_matches_rank: {len(problems)} of {checked} rooms wrong; {'; '.join(problems[:3])}"
        ]
    if checked == 0:
        return [
            "handoffs.room_matches_rank: no handoff to or from a rank-multiplexed prefill was seen"
        ]
    return []


def _dp_of_only_prefill(case: Case) -> int:
    sizes = {w.dp_size for w in case.fleet if w.role == "prefill"}
    return sizes.pop() if len(sizes) == 1 else 1


def _rooms(value: Any) -> list[int]:
    values = value if isinstance(value, list) else [value]
    return [room for room in map(_int, values) if room is not None]


def _int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return None


def _header_ok(check: HeaderCheck, value: str | None) -> bool:
    if not check.present:
        return value is None
    if value is None:
        return False
    if check.equals is not None:
        return value == check.equals
    if check.int_min is not None:
        return value.strip().isdigit() and int(value) >= check.int_min
    return True


def _counts(counter: Mapping[Any, int]) -> str:
    return (
        "{"
        + ", ".join(
            f"{key}: {count}" for key, count in sorted(counter.items(), key=lambda kv: str(kv[0]))
        )
        + "}"
    )


def _sample(answers: Sequence[Answer], expect: Expect) -> str:
    """The first answer whose status was not expected, to show what it said."""
    wanted = expect.status or {}
    for answer in answers:
        if status_of(answer) not in wanted:
            detail = answer.transport_error or answer.excerpt()
            return f"; e.g. {status_of(answer)}: {detail}"
    return ""


def _first_body(answers: Sequence[Answer]) -> str:
    return f"; first body: {answers[0].excerpt()}" if answers else ""


def _last_event(answers: Sequence[Answer]) -> str:
    for answer in answers:
        tail = answer.body[-160:].decode("utf-8", "replace").replace("\n", "\\n")
        extra = f" ({answer.transport_error})" if answer.transport_error else ""
        return f"; first stream ends with: ...{tail}{extra}"
    return ""
