"""What a model name means to the router: aliases and fallbacks the operator states.

An **alias** is a public name for one or more served models with weights
(`--model-alias chat=llama-8b-v1:95,llama-8b-v2:5`): each request for `chat` is planned for
one of them, drawn by weight (a canary at 5%), before anything else is planned. An alias
names served models only, never another alias, so an alias cannot loop.

A **fallback** is a model a model gives way to when it has no worker that can take the
request (`--model-fallback llama-70b=llama-8b`): the 503 case of `router.pipeline.plan`,
never its 404 (an unknown model stays unknown), and never after the first byte. A model's
order of fallbacks is its own list, each followed by its own fallbacks (depth first, each
model once). An alias tries the target it drew, then its other targets by weight, then its
own fallbacks: a canary with no worker left sends its share to the stable version rather
than failing it. A chain that comes back to where it started is refused at start-up.

Everything is resolved once, when the settings are read: a request looks its name up in
one dict (nothing at all for a name with neither), and an alias draws one number.

The answer names a model too. By default it names the served one, as the worker wrote it:
the router relays the answer's bytes untouched, and the client can tell the canary's
answers from the stable version's (OpenAI's API answers an alias with the dated snapshot
it served). With `--alias-answer-model alias` the router writes the alias into the
answer's `model` field instead (`ModelNameWriter`), for clients that compare it with what
they asked for. A fallback's answer always names the model that served it.
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

import orjson

from router.http.server.messages import Headers, ResponseWriter

MODEL_HEADER: Final = b"x-router-model"
FALLBACK_HEADER: Final = b"x-router-fallback-from"


class ModelNamesError(ValueError):
    """Aliases or fallbacks that cannot be used; the message names the name and why."""


@dataclass(frozen=True, slots=True)
class ModelRoute:
    """How one request's model name resolves: the models to plan for, in order."""

    requested: str
    models: tuple[str, ...]
    """The served model to plan for first, then what it gives way to."""
    alias: str | None = None
    """The alias the client named, when it named one."""


@dataclass(frozen=True, slots=True)
class _Alias:
    name: str
    targets: tuple[str, ...]
    cumulative: tuple[float, ...]
    """Running sums of the weights, normalised to end at 1."""
    routes: tuple[ModelRoute, ...]
    """One per target: the route of a request that drew it."""


class ModelNames:
    """The operator's aliases and fallbacks, checked and resolved once."""

    def __init__(
        self,
        aliases: Mapping[str, Sequence[tuple[str, float]]] | None = None,
        fallbacks: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        """Raises ModelNamesError for an alias naming an alias, a weight that is not a
        positive number, or fallbacks that come back to where they started."""
        aliases = dict(aliases or {})
        fallbacks = {name: tuple(models) for name, models in (fallbacks or {}).items()}
        _check(aliases, fallbacks)
        self.aliases = tuple(aliases)
        self._fallbacks = fallbacks
        self._weights = {name: tuple(targets) for name, targets in aliases.items()}
        self._alias: dict[str, _Alias] = {}
        self._routes: dict[str, ModelRoute] = {}
        for name, targets in aliases.items():
            total = sum(weight for _, weight in targets)
            running = 0.0
            cumulative = []
            for _, weight in targets:
                running += weight
                cumulative.append(running / total)
            cumulative[-1] = 1.0
            models = tuple(model for model, _ in targets)
            routes = tuple(
                ModelRoute(name, self._alias_order(name, index), name)
                for index in range(len(models))
            )
            self._alias[name] = _Alias(name, models, tuple(cumulative), routes)
        for name in fallbacks:
            if name not in aliases:
                self._routes[name] = ModelRoute(name, self._expand(name, []))
        self.empty = not self._alias and not self._routes
        """No alias and no fallback: requests need not even look their name up."""

    def served_by(self, alias: str) -> tuple[str, ...]:
        """The served models of `alias` (empty for a name that is none)."""
        found = self._alias.get(alias)
        return found.targets if found is not None else ()

    def resolve(self, name: str, draw: Callable[[], float]) -> ModelRoute | None:
        """The route of a request for `name`, or None when the name is neither an alias nor
        a model with fallbacks (the request goes on as it is). `draw` gives a number in
        [0, 1) and is called once, for an alias of more than one model."""
        alias = self._alias.get(name)
        if alias is None:
            return self._routes.get(name)
        if len(alias.targets) == 1:
            return alias.routes[0]
        index = bisect.bisect_right(alias.cumulative, draw())
        return alias.routes[min(index, len(alias.routes) - 1)]

    def _alias_order(self, name: str, drawn: int) -> tuple[str, ...]:
        targets = self._weights[name]
        order: list[str] = []
        self._add(order, targets[drawn][0])
        # The other targets by weight, heaviest first (ties in the order given).
        others = sorted(
            (index for index in range(len(targets)) if index != drawn),
            key=lambda index: -targets[index][1],
        )
        for index in others:
            self._add(order, targets[index][0])
        for fallback in self._fallbacks.get(name, ()):
            self._add(order, fallback)
        return tuple(order)

    def _add(self, order: list[str], name: str) -> None:
        """Append `name` (a served model, or an alias: all its targets by weight) and what
        it falls back to, each model once."""
        targets = self._weights.get(name)
        if targets is not None:
            for model, _ in sorted(targets, key=lambda target: -target[1]):
                self._add(order, model)
            for fallback in self._fallbacks.get(name, ()):
                self._add(order, fallback)
            return
        if name in order:
            return
        order.append(name)
        for fallback in self._fallbacks.get(name, ()):
            self._add(order, fallback)

    def _expand(self, name: str, order: list[str]) -> tuple[str, ...]:
        self._add(order, name)
        return tuple(order)


def _check(
    aliases: Mapping[str, Sequence[tuple[str, float]]], fallbacks: Mapping[str, Sequence[str]]
) -> None:
    for name, targets in aliases.items():
        _check_name(name, "alias")
        if not targets:
            raise ModelNamesError(f"alias {name!r} names no model")
        seen: set[str] = set()
        for model, weight in targets:
            _check_name(model, f"alias {name!r}: model")
            if model in aliases:
                why = "itself" if model == name else f"the alias {model!r}"
                raise ModelNamesError(
                    f"alias {name!r} names {why}: an alias names served models only "
                    "(an alias of an alias could loop)"
                )
            if model in seen:
                raise ModelNamesError(f"alias {name!r} names {model!r} twice")
            seen.add(model)
            if (
                isinstance(weight, bool)
                or not isinstance(weight, int | float)
                or not math.isfinite(weight)
                or weight <= 0
            ):
                raise ModelNamesError(
                    f"alias {name!r}: the weight of {model!r} must be a positive number, "
                    f"got {weight!r}"
                )
    for name, models in fallbacks.items():
        _check_name(name, "fallback: model")
        if not models:
            raise ModelNamesError(f"model {name!r} names no fallback")
        for model in models:
            _check_name(model, f"model {name!r}: fallback")
    # A chain that comes back to where it started, through fallbacks or an alias's targets.
    edges: dict[str, list[str]] = {name: list(models) for name, models in fallbacks.items()}
    for name, targets in aliases.items():
        edges.setdefault(name, []).extend(model for model, _ in targets)
    done: set[str] = set()
    for start in edges:
        _find_cycle(start, edges, [], done)


def _find_cycle(name: str, edges: Mapping[str, list[str]], path: list[str], done: set[str]) -> None:
    if name in path:
        loop = [*path[path.index(name) :], name]
        raise ModelNamesError(f"model fallbacks loop: {' -> '.join(loop)}")
    if name in done:
        return
    path.append(name)
    for following in edges.get(name, ()):
        _find_cycle(following, edges, path, done)
    path.pop()
    done.add(name)


_NAME: Final = re.compile(r"[^\s,=:]{1,256}")


def _check_name(name: object, what: str) -> None:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ModelNamesError(
            f"{what} {name!r} must be 1-256 characters without spaces, ',', '=' or ':'"
        )


class ModelNameWriter:
    """A response writer that tells the client which model answered.

    It adds `x-router-model` (the served model, when the client named another) and
    `x-router-fallback-from` (the model that had no worker) to the answer's head, and, when
    `rename` is set, writes the alias into the answer's `model` field in place of the
    served model: a unary body once, a stream event by event (the relay writes whole
    events, so a field never straddles two writes).
    """

    __slots__ = ("_marks", "_pattern", "_replacement", "_writer")

    def __init__(self, writer: ResponseWriter) -> None:
        self._writer = writer
        self._marks: list[tuple[bytes, bytes]] = []
        self._pattern: re.Pattern[bytes] | None = None
        self._replacement = b""

    def mark(self, served: str, fallback_from: str | None = None) -> None:
        """The request is now served by `served`; `fallback_from` had no worker for it."""
        marks = [item for item in self._marks if item[0] != MODEL_HEADER]
        marks.append((MODEL_HEADER, served.encode()))
        if fallback_from is not None and not any(k == FALLBACK_HEADER for k, _ in marks):
            marks.append((FALLBACK_HEADER, fallback_from.encode()))
        self._marks = marks

    def rename(self, served: str | None, alias: str) -> None:
        """Write `alias` in the answer's `model` field where the worker wrote `served`
        (None: leave the field as the worker wrote it)."""
        if served is None:
            self._pattern = None
            return
        quoted = orjson.dumps(served)
        self._pattern = re.compile(rb'("model"\s*:\s*)' + re.escape(quoted))
        self._replacement = orjson.dumps(alias).replace(b"\\", b"\\\\")

    @property
    def started(self) -> bool:
        return self._writer.started

    def _head(self, headers: Headers) -> list[tuple[bytes, bytes]]:
        return [*headers, *self._marks]

    def _renamed(self, data: bytes) -> bytes:
        pattern = self._pattern
        if pattern is None:
            return data
        return pattern.sub(rb"\g<1>" + self._replacement, data)

    async def respond(self, status: int, headers: Headers, body: bytes) -> None:
        await self._writer.respond(status, self._head(headers), self._renamed(body))

    async def start(self, status: int, headers: Headers, first: bytes = b"") -> None:
        await self._writer.start(status, self._head(headers), self._renamed(first))

    async def write(self, data: bytes) -> None:
        await self._writer.write(self._renamed(data))

    async def finish(self, last: bytes = b"") -> None:
        await self._writer.finish(self._renamed(last))

    async def abort(self, *, reset: bool = False) -> None:
        await self._writer.abort(reset=reset)
