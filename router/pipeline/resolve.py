"""The resolve stage: parse and check a model-keyed request body, and name its model.

Runs before any worker is chosen, so a malformed request is answered 400 here and never
reaches a worker. The body is parsed once (orjson); the original bytes are what gets
forwarded unless something must be injected. Generation routes have their fields checked;
the other routes only their `model` (the engine judges the rest, and its 4xx goes back
verbatim).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import orjson

from router.api.errors import BadRequest, NoAvailableWorkers
from router.api.routes import ROUTES, Route
from router.pipeline.handoff_body import UnspliceableBody, splice_members


@dataclass(slots=True, init=False)
class GenerationRequest:
    route: str
    path: str
    model: str
    stream: bool
    body: dict[str, Any]
    raw: bytes
    spec: Route
    routing_text: str | None = None
    """The whole prompt, rendered once per request when a policy reads it (`router.policies.routing_keys`)."""
    tokens: list[int] | str | None = None
    """The prompt's token ids for `kv_aware`, resolved once per request before the first
    pick (`router.pipeline.engine_tokens`), or why there are none; None: not resolved."""

    # Written out: compiled, the __init__ dataclass generates would run interpreted
    # (docs/performance.md, "fifth round").
    def __init__(
        self,
        route: str,
        path: str,
        model: str,
        stream: bool,
        body: dict[str, Any],
        raw: bytes,
        spec: Route,
        routing_text: str | None = None,
        tokens: list[int] | str | None = None,
    ) -> None:
        self.route = route
        self.path = path
        self.model = model
        self.stream = stream
        self.body = body
        self.raw = raw
        self.spec = spec
        self.routing_text = routing_text
        self.tokens = tokens

    def set_members(self, **fields: str | int) -> None:
        """Put the router's own members (`model`, `priority`) into the body workers get,
        in place of the client's (`router.pipeline.handoff_body`). A body that cannot be
        spliced is the client's: 400, never 500."""
        try:
            self.raw = splice_members(self.raw, self.body, fields)
        except UnspliceableBody as exc:
            raise BadRequest(
                f"request body cannot carry the router's {', '.join(fields)}: {exc}"
            ) from None
        self.body.update(fields)


DEFAULT_MAX_N: Final = 128


def parse_generation_request(
    path: str, raw: bytes, served_models: Sequence[str], max_n: int = DEFAULT_MAX_N
) -> GenerationRequest:
    """Check the body's shape and resolve its model.

    A missing `model` is filled in only when the fleet serves exactly one model.
    Raises BadRequest (400) for anything malformed, and for `n` (or `sampling_params.n`)
    above `max_n`: a client's number never sizes what the router builds unchecked.
    """
    spec = ROUTES[path]
    route = spec.label
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got {_json_type(body)}")
    model = body.get("model")
    if model is None:
        if len(served_models) == 1:
            model = served_models[0]
        elif not served_models:
            raise NoAvailableWorkers("no workers are registered with the router yet")
        else:
            raise BadRequest(
                f"'model' is required: this router serves {len(served_models)} models "
                f"({', '.join(served_models[:5])}{', ...' if len(served_models) > 5 else ''})"
            )
    elif not isinstance(model, str) or not model:
        raise BadRequest(f"'model' must be a non-empty string, got {_json_type(model)}")
    if not spec.streams:
        return GenerationRequest(
            route=route, path=path, model=model, stream=False, body=body, raw=raw, spec=spec
        )
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(f"'stream' must be a boolean, got {_json_type(stream)}")
    _check_route_fields(route, body)
    _check_choices(body, max_n)
    return GenerationRequest(
        route=route, path=path, model=model, stream=stream, body=body, raw=raw, spec=spec
    )


def _check_route_fields(route: str, body: dict[str, Any]) -> None:
    if route in ("chat", "messages"):
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty list of message objects")
        for index, message in enumerate(messages):
            if not isinstance(message, dict):
                raise BadRequest(
                    f"'messages[{index}]' must be an object, got {_json_type(message)}"
                )
            if not isinstance(message.get("role"), str):
                raise BadRequest(f"'messages[{index}].role' must be a string")
            content = message.get("content")
            if content is not None and not isinstance(content, (str, list)):
                raise BadRequest(
                    f"'messages[{index}].content' must be a string, a list of content parts or null, "
                    f"got {_json_type(content)}"
                )
    elif route == "completions":
        prompt = body.get("prompt")
        if not (
            isinstance(prompt, str)
            or (isinstance(prompt, list) and prompt and _is_prompt_batch(prompt))
        ):
            raise BadRequest(
                "'prompt' must be a string, or a non-empty list of strings, of token ids or of "
                "token id lists"
            )
    elif route == "generate":
        text, input_ids = body.get("text"), body.get("input_ids")
        if text is None and input_ids is None:
            raise BadRequest("'text' or 'input_ids' is required")
        if text is not None and not (
            isinstance(text, str)
            or (isinstance(text, list) and all(isinstance(item, str) for item in text))
        ):
            raise BadRequest(
                f"'text' must be a string or a list of strings, got {_json_type(text)}"
            )
        if input_ids is not None and not (
            isinstance(input_ids, list)
            and (_is_token_ids(input_ids) or all(_is_token_ids(ids) for ids in input_ids))
        ):
            raise BadRequest(
                f"'input_ids' must be a list of token ids or of token id lists, got {_json_type(input_ids)}"
            )
        sampling = body.get("sampling_params")
        if sampling is not None and not isinstance(sampling, dict):
            raise BadRequest(f"'sampling_params' must be an object, got {_json_type(sampling)}")
    for name in ("max_tokens", "max_completion_tokens", "n"):
        value = body.get(name)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 0
        ):
            raise BadRequest(f"'{name}' must be a non-negative integer, got {value!r}"[:200])
    if body.get("n") == 0:
        raise BadRequest("'n' must be at least 1")
    for name in ("temperature", "top_p"):
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise BadRequest(f"'{name}' must be a number, got {_json_type(value)}")


def _check_choices(body: dict[str, Any], max_n: int) -> None:
    sampling = body.get("sampling_params")
    for name, value in (
        ("n", body.get("n")),
        ("sampling_params.n", sampling.get("n") if isinstance(sampling, dict) else None),
    ):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise BadRequest(f"'{name}' must be a positive integer, got {value!r}"[:200])
        if value > max_n:
            raise BadRequest(f"'{name}' is {value}; the limit is {max_n} (--max-n)"[:200])


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(token, int) and not isinstance(token, bool) for token in value
    )


def _is_prompt_batch(prompt: list[Any]) -> bool:
    """A completions prompt list: strings, token ids, or token id lists, not a mix."""
    if all(isinstance(item, str) for item in prompt):
        return True
    return _is_token_ids(prompt) or all(_is_token_ids(item) for item in prompt)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"
