"""A chat request's prompt, rendered from the model's chat template as vLLM 0.32 renders
it, so that `kv_aware` can compute the token ids the engine will compute.

What the engine does for `/v1/chat/completions`, and so what `ChatTemplate.render` does
(read in vLLM's `renderers/hf.py` `safe_apply_chat_template` and
`resolve_chat_template`, `renderers/chat_utils.py` `_parse_chat_message_content` and
`_postprocess_messages`, `chat_completion/protocol.py` `build_chat_params` and
`build_tok_params`, and transformers 5's `apply_chat_template` and
`render_jinja_template`):

1. The template: `chat_template.jinja` (with the named ones in `chat_templates/`), else
   `tokenizer_config.json`'s `chat_template` (a string, or a list of named ones); of
   named templates `tool_use` when the request has tools, else `default`.
2. Each message is rebuilt from what vLLM reads of it: `role`; `content` as the template
   wants it (its "content format", detected once from the template's syntax tree as vLLM
   detects it): a template that loops over a message's content gets a list of
   `{"type": "text", "text": ...}` parts (a string becomes one part), any other gets the
   text parts joined with newlines; `name` and `task`; an assistant's `tool_calls` (their
   `arguments` parsed to an object) and `reasoning` (also as `reasoning_content`); a
   tool message's `tool_call_id` (its text parts joined). A system message loses a
   leading `x-anthropic-billing-header` line. Developer messages become system messages
   (and every system message is merged into the first) when the template never names
   the developer role.
3. The template's variables: `messages`, `tools` (the request's, with vLLM's defaults
   filled in), `documents`, `add_generation_prompt` (the request's, default true), the
   tokenizer's named special tokens (`bos_token`, `eos_token`, ..., any `*_token` of
   `tokenizer_config.json`), and the request's `chat_template_kwargs` the template reads
   (plus `reasoning_effort` and `enable_thinking` when the request sets an effort).
4. It renders in jinja2's immutable sandbox with `trim_blocks`, `lstrip_blocks`, the
   loop controls, `raise_exception`, `strftime_now` and a `tojson` that does not escape
   HTML; `continue_final_message` cuts the prompt after the final message's text, as
   transformers does.
5. The prompt is tokenized with special tokens added only if the request asks
   (`add_special_tokens`, default false for chat).

Responses bodies are rendered when their `input` is a string or a list of plain messages
(role and text content), without `previous_response_id`, `conversation`, `prompt`,
tools or reasoning: vLLM turns them into chat messages (`instructions` first, as a system
message) and tokenizes the prompt with special tokens added (`responses/utils.py`
`construct_input_messages`, `ResponsesRequest.build_tok_params`).

`NotRendered` (counted as `chat_template`): what the router does not reproduce. No
template; Anthropic Messages bodies (vLLM converts them after probing the template for
its handling of thinking and of inline system messages); media parts; a request's own
`chat_template`; `truncate_prompt_tokens`; decode-side `kv_transfer_params` token ids;
anything of a type the engine would refuse. `TemplateFailed` (`template_error`): the
template raised (`raise_exception`, an undefined call, a type error) or ran past its
bounds. Either way the request is placed by load, never failed by the router.

Bounds: a request's messages are client bytes, at most the router's body limit. The
template runs in the sandbox (no attribute of Python internals, no mutation of the
request's data, `range` capped at 100,000 items), against messages rebuilt from only the
fields above (the values in them are the client's, which the immutable sandbox cannot
change), and under `RenderLimits`: every message, part and tool, and every item and
attribute read and call the template makes, spends one operation of a fixed budget, and
the rendered text may not grow past a fixed length. So a message loop nested in a
message loop, or a request of a million tiny messages, costs at most the budget; a loop
that reads nothing of the data is not counted, but the template is the operator's, not
the client's.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import jinja2
    import jinja2.nodes
    import jinja2.parser

log = logging.getLogger("router")


class NotRendered(Exception):
    """The router does not render this request as the engine does."""


class TemplateFailed(Exception):
    """The chat template raised for this request, or ran past its bounds."""


@dataclass(frozen=True, slots=True)
class RenderLimits:
    """What one render may cost (why these bounds: the module's docstring; what they cost:
    docs/policies.md's kv_aware section)."""

    operations: int = 50_000
    """Item and attribute reads and calls the template may make."""
    output_chars: int = 16 * 1024 * 1024
    """Characters the rendered prompt may hold."""


@dataclass(frozen=True, slots=True)
class RenderedPrompt:
    text: str
    add_special_tokens: bool
    """Whether the engine adds the tokenizer's special tokens when it encodes `text`."""


# What vLLM's `TokenizeParams` add for each API (chat's request field defaults to false;
# Responses never sets it, so the default of true applies).
CHAT_ADDS_SPECIAL_TOKENS = False
RESPONSES_ADD_SPECIAL_TOKENS = True

# transformers' `apply_chat_template` parameters: vLLM passes a request's
# `chat_template_kwargs` of these names whether or not the template reads them.
_APPLY_PARAMETERS = frozenset(
    {
        "self",
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
# ... of which these change the prompt in ways the router does not follow (another
# template, tools of the client's shape, token output, a clash with the messages).
_REFUSED_KWARGS = frozenset(
    {
        "self",
        "conversation",
        "conversations",
        "messages",
        "tools",
        "chat_template",
        "tokenize",
        "return_assistant_tokens_mask",
    }
)
_EFFORTS = frozenset({"none", "minimal", "low", "medium", "high", "xhigh", "max"})
# Content parts read as text, and the field holding their text (chat_utils'
# `MM_PARSER_MAP`); "thinking" parts are left out: an Anthropic body carries them too,
# and vLLM reads those differently.
_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}
_SKIPPED_WHEN_EMPTY = frozenset({"text", "refusal"})
# The fields of every content-part type vLLM knows (chat_utils'
# `_KNOWN_CONTENT_PART_FIELDS`); any other key of a text part reaches the template.
_KNOWN_PART_FIELDS = frozenset(
    {
        "audio_embeds",
        "audio_url",
        "closed",
        "data",
        "file",
        "image_embeds",
        "image_pil",
        "image_url",
        "input_audio",
        "name",
        "prompt_cache_breakpoint",
        "refusal",
        "text",
        "thinking",
        "type",
        "uuid",
        "video_embeds",
        "video_url",
    }
)
_BILLING_HEADER = "x-anthropic-billing-header"
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# Top-level fields only an Anthropic Messages body has (the policy sees the body, not
# the route it came on).
_ANTHROPIC_FIELDS = ("system", "thinking", "output_config", "stop_sequences", "anthropic_version")
_RESPONSES_ITEM_FIELDS = frozenset({"type", "role", "content", "status", "id"})
_RESPONSES_ROLES = frozenset({"user", "system", "developer", "assistant"})


@dataclass(frozen=True, slots=True)
class _Compiled:
    source: str
    template: jinja2.Template
    openai_content: bool
    """Whether messages reach the template with their content as a list of parts."""
    variables: frozenset[str]
    """The variables the template reads without setting them."""
    names_developer: bool


@dataclass(slots=True)
class _Request:
    messages: Sequence[Any]
    add_generation_prompt: bool
    continue_final_message: bool
    add_special_tokens: bool
    tools: list[dict[str, Any]] | None
    kwargs: dict[str, Any]
    """The `chat_template_kwargs` vLLM hands to transformers, before its filter."""


class ChatTemplate:
    """A model's chat template and special tokens; `render` makes a request's prompt.

    Renders one request at a time (the router's policies run in its one trio thread):
    the operation budget is the environment's.
    """

    __slots__ = ("_budget", "_env", "_templates", "limits", "special_tokens")

    def __init__(
        self,
        templates: Mapping[str, str],
        special_tokens: Mapping[str, str],
        limits: RenderLimits = RenderLimits(),
    ) -> None:
        """`templates` by name (a single one under `default`); ValueError when one does not
        parse, or jinja2 is not installed."""
        self._env, self._budget = _sandbox()
        self._templates = {name: self._compile(source) for name, source in templates.items()}
        self.special_tokens: Mapping[str, str] = dict(special_tokens)
        """The template variables that hold the tokenizer's named special tokens."""
        self.limits = limits

    @classmethod
    def from_model_dir(
        cls, path: str | Path, limits: RenderLimits = RenderLimits()
    ) -> ChatTemplate | None:
        """The template of a model directory as vLLM's HF renderer finds it; None (and why,
        logged) when there is none the router can render as the engine does."""
        directory = Path(path)
        why = _not_renderable(directory)
        if why is None:
            config = _read_json(directory / "tokenizer_config.json")
            templates = _templates(directory, config)
            if not templates:
                why = "has no chat template"
            else:
                return cls(templates, _special_tokens(directory, config), limits)
        log.warning("kv_aware: chat requests get no prediction: %s %s", directory, why)
        return None

    def _compile(self, source: str) -> _Compiled:
        import jinja2
        import jinja2.meta

        try:
            tree = self._env.parse(source)
            template = self._env.from_string(source)
        except jinja2.TemplateSyntaxError as error:
            raise ValueError(f"the chat template does not parse: {error}") from None
        return _Compiled(
            source,
            template,
            openai_content=_loops_over_content(tree),
            variables=frozenset(jinja2.meta.find_undeclared_variables(tree)),
            names_developer='"developer"' in source or "'developer'" in source,
        )

    def render(self, body: Mapping[str, Any]) -> RenderedPrompt:
        """The prompt the engine renders for a chat or Responses `body`.

        Raises NotRendered when the router does not reproduce this request's rendering,
        TemplateFailed when the template raises or runs past `limits`."""
        request = _responses_request(body) if "messages" not in body else _chat_request(body)
        compiled = self._pick(request.tools is not None)
        # Rebuilding the messages is work per message and part too: it spends the budget
        # the template then renders with.
        items = len(request.messages) + len(request.tools or ())
        items += sum(
            len(m["content"])
            for m in request.messages
            if isinstance(m, dict) and isinstance(m.get("content"), list)
        )
        if items > self.limits.operations:
            raise TemplateFailed("more messages and parts than the operation budget")
        self._budget.remaining = self.limits.operations - items
        conversation = [_message(raw, compiled.openai_content) for raw in request.messages]
        if not conversation:
            raise NotRendered("no messages")
        if not compiled.names_developer and any(m["role"] == "developer" for m in conversation):
            conversation = _merge_system(
                [_as_system(m) if m["role"] == "developer" else m for m in conversation]
            )
        variables = self._variables(compiled, request, conversation)
        text = self._generate(compiled, conversation, variables, request.continue_final_message)
        return RenderedPrompt(text, request.add_special_tokens)

    def _pick(self, has_tools: bool) -> _Compiled:
        templates = self._templates
        if has_tools and "tool_use" in templates:
            return templates["tool_use"]
        if "default" in templates:
            return templates["default"]
        raise NotRendered("named chat templates without a default")

    def _variables(
        self, compiled: _Compiled, request: _Request, conversation: list[dict[str, Any]]
    ) -> dict[str, Any]:
        accepted = compiled.variables | _APPLY_PARAMETERS
        passed = {key: value for key, value in request.kwargs.items() if key in accepted}
        documents = passed.get("documents")
        if documents is not None and (
            not isinstance(documents, list) or not all(isinstance(d, dict) for d in documents)
        ):
            raise NotRendered("documents that are not a list of objects")
        variables: dict[str, Any] = dict(self.special_tokens)
        variables.update(
            (key, value) for key, value in passed.items() if key not in _APPLY_PARAMETERS
        )
        variables["messages"] = conversation
        variables["tools"] = request.tools
        variables["documents"] = documents
        variables["add_generation_prompt"] = request.add_generation_prompt
        return variables

    def _generate(
        self,
        compiled: _Compiled,
        conversation: list[dict[str, Any]],
        variables: dict[str, Any],
        continue_final: bool,
    ) -> str:
        final_text = ""
        if continue_final:
            final_text = _mark_final(conversation, compiled.source)
        pieces: list[str] = []
        length = 0
        try:
            for piece in compiled.template.generate(variables):
                length += len(piece)
                if length > self.limits.output_chars:
                    raise TemplateFailed("the rendered prompt is over the length bound")
                pieces.append(piece)
        except TemplateFailed:
            raise
        except Exception as error:  # whatever the template raised, or the budget
            raise TemplateFailed(f"{type(error).__name__}: {error}") from None
        text = "".join(pieces)
        if continue_final:
            text = _cut_after_final(text, final_text)
        return text


def _chat_request(body: Mapping[str, Any]) -> _Request:
    if body.get("chat_template") is not None:
        raise NotRendered("the request brings its own chat template")
    if body.get("truncate_prompt_tokens") is not None:
        raise NotRendered("the engine truncates the prompt")
    transfer = body.get("kv_transfer_params")
    if isinstance(transfer, dict) and transfer.get("prompt_token_ids") is not None:
        raise NotRendered("the engine takes forwarded token ids")
    if any(field in body for field in _ANTHROPIC_FIELDS):
        raise NotRendered("an Anthropic Messages body")
    messages = body["messages"]
    if not isinstance(messages, list):
        raise NotRendered("messages is not a list")
    add_generation_prompt = _flag(body, "add_generation_prompt", True)
    continue_final = _flag(body, "continue_final_message", False)
    if add_generation_prompt and continue_final:
        raise NotRendered("add_generation_prompt and continue_final_message")
    extra: dict[str, Any] = {
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final,
    }
    documents = body.get("documents")
    if documents is not None:
        if not isinstance(documents, list) or not all(
            isinstance(d, dict) and all(isinstance(v, str) for v in d.values()) for d in documents
        ):
            raise NotRendered("documents of another shape")
        extra["documents"] = documents
    user = _user_kwargs(body.get("chat_template_kwargs"))
    effort = body.get("reasoning_effort")
    if effort is not None:
        if not isinstance(effort, str) or effort not in _EFFORTS:
            raise NotRendered("an unknown reasoning_effort")
        extra["reasoning_effort"] = effort
        if "enable_thinking" not in user:
            extra["enable_thinking"] = effort != "none"
    # ChatCompletionRequest renames a message's `reasoning_content` to `reasoning`.
    renamed = [_renamed_reasoning(m) for m in messages]
    return _Request(
        renamed,
        add_generation_prompt,
        continue_final,
        _flag(body, "add_special_tokens", CHAT_ADDS_SPECIAL_TOKENS),
        _tools(body.get("tools")),
        _merged_kwargs(user, extra),
    )


def _responses_request(body: Mapping[str, Any]) -> _Request:
    if "encoding_format" in body or "dimensions" in body:
        raise NotRendered("an embeddings body")
    for field in ("previous_response_id", "conversation", "prompt", "reasoning"):
        if body.get(field) is not None:
            raise NotRendered(f"a Responses request with {field}")
    if body.get("tools"):
        raise NotRendered("a Responses request with tools")
    if body.get("truncation", "disabled") != "disabled":
        raise NotRendered("the engine truncates the prompt")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise NotRendered("instructions that are not a string")
    value = body.get("input")
    messages: list[Any] = [{"role": "system", "content": instructions}] if instructions else []
    continue_final = False
    if isinstance(value, str):
        messages.append({"role": "user", "content": value})
    elif isinstance(value, list):
        messages.extend(_responses_item(item) for item in value)
        last = value[-1] if value else None
        continue_final = isinstance(last, dict) and last.get("status") in (
            "in_progress",
            "incomplete",
        )
    else:
        raise NotRendered("input of another shape")
    extra = {"add_generation_prompt": not continue_final, "continue_final_message": continue_final}
    return _Request(
        messages,
        not continue_final,
        continue_final,
        RESPONSES_ADD_SPECIAL_TOKENS,
        None,
        _merged_kwargs(_user_kwargs(body.get("chat_template_kwargs")), extra),
    )


def _responses_item(item: Any) -> Mapping[str, Any]:
    """A Responses input message as vLLM's `construct_chat_messages_with_tool_call` makes
    it a chat message (other item types are not rendered here)."""
    if not isinstance(item, dict) or not set(item) <= _RESPONSES_ITEM_FIELDS:
        raise NotRendered("a Responses input item other than a plain message")
    role = item.get("role")
    if item.get("type", "message") != "message" or not (
        isinstance(role, str) and role in _RESPONSES_ROLES
    ):
        raise NotRendered("a Responses input item other than a plain message")
    if role != "assistant":
        if "id" in item:
            raise NotRendered("an input item the engine reads as a stored one")
        return item
    content = item.get("content")
    if isinstance(content, list) and content and isinstance(content[0], dict):
        content = content[0].get("text")  # vLLM reads the first part only
    if not isinstance(content, str):
        raise NotRendered("an assistant item without text")
    return {"role": "assistant", "content": content}


def _flag(body: Mapping[str, Any], field: str, default: bool) -> bool:
    value = body.get(field, default)
    if not isinstance(value, bool):
        raise NotRendered(f"{field} is not a boolean")
    return value


def _user_kwargs(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
        raise NotRendered("chat_template_kwargs is not an object")
    if _REFUSED_KWARGS & value.keys():
        raise NotRendered("chat_template_kwargs the router does not follow")
    return value


def _merged_kwargs(user: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """vLLM's merge: the request's own fields over its `chat_template_kwargs`, then the
    server's defaults under both, which drops a value of None or "auto"."""
    merged = dict(user)
    merged.update(extra)
    return {key: value for key, value in merged.items() if not _unset(value)}


def _unset(value: Any) -> bool:
    return value is None or (isinstance(value, str) and value == "auto")


def _renamed_reasoning(message: Any) -> Any:
    if not isinstance(message, dict) or "reasoning_content" not in message:
        return message
    renamed = dict(message)
    reasoning = renamed.pop("reasoning_content")
    if reasoning is not None and renamed.get("reasoning") is None:
        renamed["reasoning"] = reasoning
    return renamed


def _tools(value: Any) -> list[dict[str, Any]] | None:
    """The request's tools as vLLM hands them to the template: each validated into its
    `ChatCompletionToolsParam` and dumped (defaults filled in, unknown fields dropped)."""
    if value is None:
        return None
    if not isinstance(value, list) or not value:
        raise NotRendered("tools of another shape")
    return [_tool(tool) for tool in value]


def _tool(tool: Any) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise NotRendered("a tool other than a function")
    function = tool.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise NotRendered("a tool without a function name")
    description = function.get("description")
    parameters = function.get("parameters")
    strict = function.get("strict")
    defer = function.get("defer_loading")
    tool_defer = tool.get("defer_loading")
    if (
        not (description is None or isinstance(description, str))
        or not (parameters is None or isinstance(parameters, dict))
        or any(v is not None and not isinstance(v, bool) for v in (strict, defer, tool_defer))
    ):
        raise NotRendered("a tool field of another type")
    if defer is None:
        defer = tool_defer  # vLLM hands a tool's defer_loading to its function
    dumped: dict[str, Any] = {
        "name": function["name"],
        "description": description,
        "parameters": parameters,
    }
    if strict is not None:
        dumped["strict"] = strict
    if defer is not None:
        dumped["defer_loading"] = defer
    out: dict[str, Any] = {"type": "function", "function": dumped}
    if tool_defer is not None:
        out["defer_loading"] = tool_defer
    return out


def _message(raw: Any, openai_content: bool) -> dict[str, Any]:
    """One message as vLLM's chat parser hands it to the template."""
    if not isinstance(raw, dict) or not isinstance(raw.get("role"), str):
        raise NotRendered("a message without a role")
    role: str = raw["role"]
    content = raw.get("content")
    parts: list[Any]
    if content is None:
        parts = []
    elif isinstance(content, str):
        parts = [{"type": "text", "text": content}]
    elif isinstance(content, list):
        parts = content
    else:
        raise NotRendered("content of another type")
    if role == "system":
        parts = _without_billing_header(parts)
    # vLLM keeps what parses to something truthy: an empty string part goes, an empty
    # text part (a dict) stays.
    texts = [text for part in parts if (text := _part(part, openai_content))]
    message: dict[str, Any] = {
        "role": role,
        "content": texts if openai_content else "\n".join(texts),
    }
    if role == "assistant":
        tool_calls = raw.get("tool_calls")
        if tool_calls is not None:
            if not isinstance(tool_calls, list):
                raise NotRendered("tool_calls is not a list")
            if tool_calls:  # an empty list is dropped
                message["tool_calls"] = [_tool_call(call) for call in tool_calls]
        reasoning = raw.get("reasoning")
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise NotRendered("reasoning is not a string")
            message["reasoning"] = reasoning
            message["reasoning_content"] = reasoning
    elif role == "tool":
        if "tool_call_id" in raw:
            call_id = raw["tool_call_id"]
            if not (call_id is None or isinstance(call_id, str)):
                raise NotRendered("tool_call_id is not a string")
            message["tool_call_id"] = call_id
        if openai_content:  # a tool's text parts reach the template as one string
            message["content"] = "\n".join(part["text"] for part in texts)
    for field in ("name", "task"):
        value = raw.get(field)
        if value is not None:
            if not isinstance(value, str):
                raise NotRendered(f"{field} is not a string")
            message[field] = value
    if role == "developer":
        if raw.get("tools") is not None:
            raise NotRendered("a developer message with tools")
        message["tools"] = None
    return message


def _part(part: Any, openai_content: bool) -> Any:
    """A text part as the template gets it (a string, or a text part and its unknown
    fields); None for a part without text, which vLLM skips."""
    if isinstance(part, str):
        return {"type": "text", "text": part} if openai_content else part
    if not isinstance(part, dict) or part.get("uuid") is not None:
        raise NotRendered("a content part other than text")
    kind = part.get("type")
    field = _TEXT_PARTS.get(kind) if isinstance(kind, str) else None
    if field is None:
        raise NotRendered("a content part other than text")
    text = part.get(field)
    if text is None and kind in _SKIPPED_WHEN_EMPTY:
        return None
    if not isinstance(text, str):
        raise NotRendered("a text part without text")
    if not openai_content:
        return text
    wrapped: dict[str, Any] = {"type": "text", "text": text}
    wrapped.update((k, v) for k, v in part.items() if k not in _KNOWN_PART_FIELDS)
    return wrapped


def _without_billing_header(parts: list[Any]) -> list[Any]:
    kept: list[Any] = []
    for part in parts:
        if isinstance(part, str):
            text: Any = part
        elif isinstance(part, dict) and part.get("type") == "text":
            text = part.get("text")
        else:
            text = None
        if not (isinstance(text, str) and text.startswith(_BILLING_HEADER)):
            kept.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            kept.append(rest if isinstance(part, str) else {**part, "text": rest})
    return kept


def _tool_call(call: Any) -> dict[str, Any]:
    """An assistant's tool call as validated (fields in the schema's order, unknown ones
    after) and post-processed by vLLM: `arguments` parsed to an object, `{}` when it
    is empty, not JSON or not an object."""
    if not isinstance(call, dict) or call.get("type") != "function":
        raise NotRendered("a tool call other than a function")
    function = call.get("function")
    if (
        not isinstance(call.get("id"), str)
        or not isinstance(function, dict)
        or not isinstance(function.get("name"), str)
        or not isinstance(function.get("arguments"), str)
    ):
        raise NotRendered("a tool call of another shape")
    arguments: Any = {}
    if function["arguments"]:
        try:
            arguments = json.loads(function["arguments"])
        except json.JSONDecodeError:
            arguments = {}
        except RecursionError:
            raise NotRendered("tool call arguments nested too deep") from None
        if not isinstance(arguments, dict):
            arguments = {}
    called = {"arguments": arguments, "name": function["name"]}
    called.update((k, v) for k, v in function.items() if k not in ("arguments", "name"))
    out: dict[str, Any] = {"id": call["id"], "function": called, "type": "function"}
    out.update((k, v) for k, v in call.items() if k not in ("id", "function", "type"))
    return out


def _as_system(message: dict[str, Any]) -> dict[str, Any]:
    converted = {**message, "role": "system"}
    converted.pop("tools", None)
    return converted


def _merge_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's merge of every system message into one, first, when one is not first."""
    contents: list[str] = []
    others: list[dict[str, Any]] = []
    merge = False
    for index, message in enumerate(conversation):
        if message["role"] != "system":
            others.append(message)
            continue
        if index > 0 or contents:
            merge = True
        content = message.get("content", "")
        if isinstance(content, list):
            content = "\n".join(
                part["text"] if isinstance(part, dict) else part
                for part in content
                if (isinstance(part, dict) and "text" in part) or isinstance(part, str)
            )
        if content:
            contents.append(content)
    if not merge:
        return conversation
    return [{"role": "system", "content": "\n\n".join(contents)}, *others]


def _mark_final(conversation: list[dict[str, Any]], source: str) -> str:
    """transformers' `continue_final_message`: a tag after the final message's text (the
    prompt is cut there after rendering); the text before the tag."""
    final = conversation[-1].get("content")
    if final is None or "content" not in source:
        raise TemplateFailed("continue_final_message with nothing to continue")
    if isinstance(final, list):
        for block in reversed(final):
            if "text" in block:
                text: str = block["text"]
                block["text"] = text + _CONTINUE_TAG
                return text
        raise TemplateFailed("continue_final_message with no text to continue")
    conversation[-1]["content"] = final + _CONTINUE_TAG
    return str(final)


def _cut_after_final(text: str, final_text: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final_text.strip() not in text or tag not in text:
        raise TemplateFailed(
            "the template drops the final message continue_final_message continues"
        )
    at = text.rindex(tag)
    if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()


class _Budget:
    __slots__ = ("remaining",)

    def __init__(self) -> None:
        self.remaining = 0

    def spend(self) -> None:
        self.remaining -= 1
        if self.remaining < 0:
            raise TemplateFailed("the template ran past its operation budget")


@functools.cache
def _sandbox() -> tuple[jinja2.Environment, _Budget]:
    """The environment transformers renders chat templates in, counting what the template
    reads and calls against a budget. jinja2 is imported here: it is an optional
    dependency (the `kv` extra), needed only with a model directory."""
    try:
        import jinja2
        import jinja2.ext
        import jinja2.nodes
        import jinja2.parser
        import jinja2.sandbox
    except ModuleNotFoundError:
        raise ValueError("needs the `jinja2` package (pip install jinja2)") from None

    budget = _Budget()

    class Generation(jinja2.ext.Extension):
        """transformers' `{% generation %}` block (it marks the assistant's tokens for
        training masks); its body renders as it is."""

        tags = {"generation"}

        def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_body")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    class Sandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
        def getitem(self, obj: Any, argument: Any) -> Any:
            budget.spend()
            return super().getitem(obj, argument)

        def getattr(self, obj: Any, attribute: str) -> Any:
            budget.spend()
            return super().getattr(obj, attribute)

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
            budget.spend()
            return super().call(__context, __obj, *args, **kwargs)

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    env = Sandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env, budget


def _loops_over_content(tree: jinja2.nodes.Template) -> bool:
    """vLLM's content-format detection (`_detect_content_format`): whether the template
    loops over a message's content (`{% for part in message['content'] %}`, through
    aliases of `messages`, filters, tests and slices, or over a macro parameter given a
    message's content, or over a variable named `content` outside macros). A tree whose
    matching loop has a tuple target counts as not looping, as vLLM's detection fails
    on it and falls back to strings."""
    from jinja2 import nodes

    aliases = {"messages"}
    frontier = ["messages"]
    while frontier:
        name = frontier.pop()
        for assign in tree.find_all(nodes.Assign):
            if _reads(assign.node, name):
                if not isinstance(assign.target, nodes.Name):
                    return False
                if assign.target.name not in aliases:
                    aliases.add(assign.target.name)
                    frontier.append(assign.target.name)
    message_names: set[str] = set()
    for loop in tree.find_all(nodes.For):
        if any(_reads(loop.iter, alias) for alias in aliases):
            if not isinstance(loop.target, nodes.Name):
                return False
            message_names.add(loop.target.name)
    in_macros: set[int] = set()
    macro_params: dict[int, set[str]] = {}
    for macro in tree.find_all(nodes.Macro):
        params = [arg.name for arg in macro.args]
        given: set[str] = set()
        for call in tree.find_all(nodes.Call):
            if not (isinstance(call.node, nodes.Name) and call.node.name == macro.name):
                continue
            for index, arg in enumerate(call.args):
                if index < len(params) and _reads_content(arg, message_names):
                    given.add(params[index])
            for keyword in call.kwargs:
                if keyword.key in params and _reads_content(keyword.value, message_names):
                    given.add(keyword.key)
        for loop in macro.find_all(nodes.For):
            in_macros.add(id(loop))
            if given:
                macro_params[id(loop)] = given
    for loop in tree.find_all(nodes.For):
        iterable = loop.iter
        named = iterable.name if isinstance(iterable, nodes.Name) else None
        if (
            _reads_content(iterable, message_names)
            or (named is not None and named in macro_params.get(id(loop), ()))
            or (named == "content" and id(loop) not in in_macros)
        ):
            return isinstance(loop.target, nodes.Name)
    return False


def _reads_content(node: jinja2.nodes.Node, message_names: set[str]) -> bool:
    return any(_reads(node, name, "content") for name in message_names)


def _reads(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    """Whether `node` reads variable `name` (or its item or attribute `key`), directly or
    through a filter, a test or a slice."""
    from jinja2 import nodes

    if isinstance(node, (nodes.Filter, nodes.Test)):
        return node.node is not None and _reads(node.node, name, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _reads(node.node, name, key)
    if key is None:
        return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name
    if isinstance(node, nodes.Getitem):
        return (
            _reads_name(node.node, name)
            and isinstance(node.arg, nodes.Const)
            and node.arg.value == key
        )
    if isinstance(node, nodes.Getattr):
        return _reads_name(node.node, name) and node.attr == key
    return False


def _reads_name(node: jinja2.nodes.Node, name: str) -> bool:
    from jinja2 import nodes

    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name


def _not_renderable(directory: Path) -> str | None:
    """Why vLLM would not render this model's chat with its template (another renderer,
    another template source); None when it would."""
    if not (directory / "tokenizer_config.json").is_file():
        return "has no tokenizer_config.json"
    config = _read_json(directory / "config.json") if (directory / "config.json").is_file() else {}
    if config.get("model_type") == "gpt_oss":
        return "is a gpt-oss model (vLLM renders its chats as Harmony messages)"
    if any(directory.glob("consolidated*.safetensors")) and (
        (directory / "tekken.json").is_file() or any(directory.glob("tokenizer.model.v*"))
    ):
        return "is a Mistral model (vLLM renders it with mistral_common)"
    for name in ("chat_template.json", "processor_config.json", "preprocessor_config.json"):
        if (directory / name).is_file():
            return f"has {name} (a processor's template comes first in vLLM; not read here)"
    return None


def _templates(directory: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """The templates by name, as transformers loads them: template files first, then the
    config's `chat_template`."""
    found: dict[str, str] = {}
    single = directory / "chat_template.jinja"
    if single.is_file():
        found["default"] = _read_text(single)
    named = directory / "chat_templates"
    if named.is_dir():
        for path in sorted(named.glob("*.jinja")):
            found[path.name.removesuffix(".jinja")] = _read_text(path)
    if found:
        return found
    value = config.get("chat_template")
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        for entry in value:
            if isinstance(entry, dict) and isinstance(entry.get("name"), str):
                if isinstance(entry.get("template"), str):
                    found[entry["name"]] = entry["template"]
    return found


def _special_tokens(directory: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """The tokenizer's named special tokens (transformers' `special_tokens_map`): each
    `*_token` of tokenizer_config.json that holds a token, and the named
    `extra_special_tokens`; special_tokens_map.json over them when the config lists no
    `added_tokens_decoder` (transformers' legacy path)."""
    values: dict[str, Any] = dict(config)
    legacy = directory / "special_tokens_map.json"
    if "added_tokens_decoder" not in config and legacy.is_file():
        values.update(_read_json(legacy))
    tokens: dict[str, str] = {}
    for key, value in values.items():
        if key.endswith("_token") and (token := _token_text(value)) is not None:
            tokens[key] = token
    extra = values.get("extra_special_tokens")
    if isinstance(extra, dict):
        for key, value in extra.items():
            if (token := _token_text(value)) is not None:
                tokens[str(key)] = token
    return tokens


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])  # a serialized AddedToken
    return None


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, ValueError) as error:  # ValueError: not UTF-8
        raise ValueError(f"cannot read {path}: {error}") from None


def _read_json(path: Path) -> dict[str, Any]:
    text = _read_text(path)
    try:
        value = json.loads(text)
    except ValueError as error:
        raise ValueError(f"cannot read {path}: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"cannot read {path}: not a JSON object")
    return value
