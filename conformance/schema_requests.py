"""The request and expectation parts of a case step: what a `send` or `poll` sends
(`RequestSpec`, raw bodies included) and what must hold after it (`Expect`).

Part of the case schema (`conformance.schema`), split out so that each stays readable.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from yaml.nodes import Node, ScalarNode, SequenceNode

from conformance.model import (
    ALL_WORKERS,
    BUSIEST_WORKER,
    ERROR_SHAPES,
    NO_STATUS,
    ROUTES,
    STREAM_ENDS,
    Expect,
    HandoffCheck,
    HeaderCheck,
    Range,
    RawBody,
    RequestSpec,
    StatusKey,
)
from conformance.nodes import NodeReader, join

REQUEST_FIELDS = (
    "count",
    "concurrency",
    "model",
    "route",
    "stream",
    "body",
    "headers",
    "timeout_s",
    "raw",
    "background",
    "worker",
    "priority",
)
POLL_FIELDS = ("model", "route", "stream", "body", "headers", "timeout_s", "within_s", "interval_s")
RAW_FIELDS = ("text", "nested", "size", "content_type")
EXPECT_FIELDS = (
    "status",
    "error_code",
    "message_contains",
    "headers",
    "dispatches",
    "dispatches_total",
    "stream_end",
    "body_json",
    "handoffs",
    "error_shape",
    "lists_models",
    "stream_text",
    "stream_usage",
    "stream_ids",
)
USAGE_FIELDS = ("prompt_tokens", "completion_tokens")
# Past this a request would hold a fleet longer than any case should take.
MAX_COUNT = 1000
# A raw body is built in memory and sent whole; past this a case costs more than it shows.
MAX_RAW_SIZE = 64 * 1024 * 1024
MAX_NESTED = 100_000


class RequestReader:
    """Reads requests and expectations of one case file; raises SpecError at the first problem."""

    def __init__(self, r: NodeReader) -> None:
        self.r = r

    def raw(self, node: Node, field: str) -> RawBody:
        r = self.r
        m = r.mapping(node, field, RAW_FIELDS)
        kinds = [key for key in ("text", "nested", "size") if key in m]
        if len(kinds) != 1:
            raise r.fail(node, field, f"needs exactly one of text, nested, size, got {len(kinds)}")
        text = None
        if "text" in m:
            value = r.scalar(m["text"], join(field, "text"))
            if not isinstance(value, str):
                raise r.fail(
                    m["text"], join(field, "text"), f"must be a string (quote it), got {value!r}"
                )
            text = value
        return RawBody(
            text=text,
            nested=r.integer(m["nested"], join(field, "nested"), 1, MAX_NESTED)
            if "nested" in m
            else None,
            size=r.integer(m["size"], join(field, "size"), 1, MAX_RAW_SIZE)
            if "size" in m
            else None,
            content_type=r.string(m["content_type"], join(field, "content_type"))
            if "content_type" in m
            else "application/json",
        )

    def request(
        self, node: Node, field: str, fields: Sequence[str] = REQUEST_FIELDS
    ) -> RequestSpec:
        r = self.r
        m = r.mapping(node, field, fields)
        body: dict[str, Any] = {}
        if "body" in m:
            value = r.value(m["body"], join(field, "body"))
            if not isinstance(value, dict):
                raise r.fail(m["body"], join(field, "body"), "must be a mapping of body fields")
            body = value
        headers: dict[str, str] = {}
        for key, _, value_node in r.items(m.get("headers", _null()), join(field, "headers")):
            headers[key] = str(r.scalar(value_node, join(field, f"headers.{key}")))
        raw = self.raw(m["raw"], join(field, "raw")) if "raw" in m else None
        if raw is not None and "body" in m:
            raise r.fail(
                m["body"],
                join(field, "body"),
                "a raw request has no body fields; put everything in raw",
            )
        count = r.integer(m["count"], join(field, "count"), 1, MAX_COUNT) if "count" in m else 1
        concurrency = (
            r.integer(m["concurrency"], join(field, "concurrency"), 1, MAX_COUNT)
            if "concurrency" in m
            else 1
        )
        return RequestSpec(
            count=count,
            concurrency=concurrency,
            model=r.string(m["model"], join(field, "model")) if "model" in m else None,
            route=r.choice(m["route"], join(field, "route"), ROUTES) if "route" in m else "chat",
            stream=r.boolean(m["stream"], join(field, "stream")) if "stream" in m else False,
            body=body,
            headers=headers,
            timeout_s=r.number(m["timeout_s"], join(field, "timeout_s"), positive=True)
            if "timeout_s" in m
            else 10.0,
            raw=raw,
            background=r.string(m["background"], join(field, "background"))
            if "background" in m
            else None,
            worker=r.string(m["worker"], join(field, "worker")) if "worker" in m else None,
            priority=r.string(m["priority"], join(field, "priority")) if "priority" in m else None,
        )

    def expect(
        self, node: Node | None, field: str, names: set[str], request: RequestSpec
    ) -> Expect:
        if node is None:
            return Expect()
        r = self.r
        m = r.mapping(node, field, EXPECT_FIELDS)
        for name in ("stream_text", "stream_usage", "stream_ids"):
            if name in m and not request.stream:
                raise r.fail(
                    m[name], join(field, name), "only a streaming request (stream: true) has one"
                )
        stream_end = None
        if "stream_end" in m:
            stream_end = r.choice(m["stream_end"], join(field, "stream_end"), STREAM_ENDS)
            if not request.stream:
                raise r.fail(
                    m["stream_end"],
                    join(field, "stream_end"),
                    "only a streaming request (stream: true) has one",
                )
        return Expect(
            status=self.status(m["status"], join(field, "status"), request.count)
            if "status" in m
            else None,
            error_code=self.error_code(m["error_code"], join(field, "error_code"))
            if "error_code" in m
            else None,
            message_contains=r.strings(m["message_contains"], join(field, "message_contains"))
            if "message_contains" in m
            else (),
            headers=self.headers(m["headers"], join(field, "headers")) if "headers" in m else {},
            dispatches=self.counts(m["dispatches"], join(field, "dispatches"), names)
            if "dispatches" in m
            else {},
            dispatches_total=(
                self.counts(m["dispatches_total"], join(field, "dispatches_total"), names)
                if "dispatches_total" in m
                else {}
            ),
            stream_end=stream_end,
            error_shape=r.choice(m["error_shape"], join(field, "error_shape"), ERROR_SHAPES)
            if "error_shape" in m
            else None,
            body_json=r.boolean(m["body_json"], join(field, "body_json"))
            if "body_json" in m
            else False,
            handoffs=self.handoffs(m["handoffs"], join(field, "handoffs"))
            if "handoffs" in m
            else None,
            lists_models=self.lists_models(m["lists_models"], join(field, "lists_models"))
            if "lists_models" in m
            else {},
            stream_text=self.text(m["stream_text"], join(field, "stream_text"))
            if "stream_text" in m
            else None,
            stream_usage=self.usage(m["stream_usage"], join(field, "stream_usage"))
            if "stream_usage" in m
            else None,
            stream_ids=r.integer(m["stream_ids"], join(field, "stream_ids"), 1, MAX_COUNT)
            if "stream_ids" in m
            else None,
        )

    def text(self, node: Node, field: str) -> str:
        value = self.r.scalar(node, field)
        if not isinstance(value, str):
            raise self.r.fail(node, field, f"must be a string (quote it), got {value!r}")
        return value

    def usage(self, node: Node, field: str) -> dict[str, int]:
        r = self.r
        m = r.mapping(node, field, USAGE_FIELDS)
        if not m:
            raise r.fail(node, field, f"needs at least one of {', '.join(USAGE_FIELDS)}")
        return {key: r.integer(value, join(field, key), 0) for key, value in m.items()}

    def lists_models(self, node: Node, field: str) -> dict[str, str | None]:
        """Model ids, each with the `parent` it must be listed with (null: none)."""
        r = self.r
        listed: dict[str, str | None] = {}
        for key, _, value in r.items(node, field):
            parent = r.scalar(value, join(field, key))
            if parent is not None and not isinstance(parent, str):
                raise r.fail(value, join(field, key), f"must be a model id or null, got {parent!r}")
            listed[key] = parent
        if not listed:
            raise r.fail(node, field, "names no model")
        return listed

    def error_code(self, node: Node, field: str) -> str | tuple[str, ...]:
        """One code, or a list of the codes an answer may have (at least one)."""
        codes = self.r.strings(node, field)
        if not codes:
            raise self.r.fail(node, field, "names no error code")
        return codes[0] if len(codes) == 1 and isinstance(node, ScalarNode) else codes

    def status(self, node: Node, field: str, count: int) -> dict[StatusKey, Range]:
        r = self.r
        if isinstance(node, ScalarNode):
            code = r.integer(node, field, 100, 599)
            return {code: Range(count, count)}
        counts: dict[StatusKey, Range] = {}
        for key, key_node, value in r.items(node, field):
            status: StatusKey
            if key == NO_STATUS:
                status = NO_STATUS
            elif key.isdigit() and 100 <= int(key) <= 599:
                status = int(key)
            else:
                raise r.fail(
                    key_node, join(field, key), f"must be an HTTP status (100-599) or {NO_STATUS!r}"
                )
            counts[status] = self.range(value, join(field, key))
        if sum(c.low for c in counts.values()) > count:
            raise r.fail(
                node, field, f"the least counts add up to more than the {count} requests sent"
            )
        return counts

    def counts(self, node: Node, field: str, names: set[str]) -> dict[str, Range]:
        r = self.r
        out: dict[str, Range] = {}
        for key, key_node, value in r.items(node, field):
            if key not in (ALL_WORKERS, BUSIEST_WORKER) and key not in names:
                raise r.fail(
                    key_node,
                    join(field, key),
                    f"no worker {key!r} in the fleet ({', '.join(sorted(names))})",
                )
            out[key] = self.range(value, join(field, key))
        return out

    def range(self, node: Node, field: str) -> Range:
        r = self.r
        if isinstance(node, SequenceNode):
            items = r.sequence(node, field)
            if len(items) != 2:
                raise r.fail(node, field, "a range is [min, max]")
            low = r.integer(items[0], join(field, 0), 0)
            high = r.integer(items[1], join(field, 1), 0)
            if high < low:
                raise r.fail(node, field, f"max {high} is below min {low}")
            return Range(low, high)
        value = r.scalar(node, field)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise r.fail(
                node, field, f"must be a count (integer >= 0) or [min, max], got {value!r}"
            )
        return Range(value, value)

    def headers(self, node: Node, field: str) -> dict[str, HeaderCheck]:
        r = self.r
        out: dict[str, HeaderCheck] = {}
        for key, _, value in r.items(node, field):
            where = join(field, key)
            if isinstance(value, ScalarNode):
                word = r.choice(value, where, ("present", "absent"))
                out[key.lower()] = HeaderCheck(present=word == "present")
                continue
            m = r.mapping(value, where, ("equals", "int_min"))
            if len(m) != 1:
                raise r.fail(value, where, "needs exactly one of equals, int_min")
            if "equals" in m:
                out[key.lower()] = HeaderCheck(
                    equals=str(r.scalar(m["equals"], join(where, "equals")))
                )
            else:
                out[key.lower()] = HeaderCheck(
                    int_min=r.integer(m["int_min"], join(where, "int_min"))
                )
        return out

    def handoffs(self, node: Node, field: str) -> HandoffCheck:
        r = self.r
        m = r.mapping(node, field, ("rooms_match", "room_matches_rank"))
        check = HandoffCheck(
            rooms_match=r.boolean(m["rooms_match"], join(field, "rooms_match"))
            if "rooms_match" in m
            else False,
            room_matches_rank=(
                r.boolean(m["room_matches_rank"], join(field, "room_matches_rank"))
                if "room_matches_rank" in m
                else False
            ),
        )
        if not (check.rooms_match or check.room_matches_rank):
            raise r.fail(node, field, "checks nothing")
        return check


def _null() -> Node:
    return ScalarNode("tag:yaml.org,2002:null", "")
