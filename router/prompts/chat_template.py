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
   named templates `tool_use` when the request has tools, else `default`
   (`chat_model_dir`).
2. Each message is rebuilt from what vLLM reads of it (`chat_messages`): `role`;
   `content` as the template wants it (its "content format", detected once from the
   template's syntax tree as vLLM detects it, `chat_content_format`): a template that
   loops over a message's content gets a list of `{"type": "text", "text": ...}` parts
   (a string becomes one part), any other gets the text parts joined with newlines;
   `name` and `task`; an assistant's `tool_calls` (their `arguments` parsed to an
   object) and `reasoning` (also as `reasoning_content`); a tool message's
   `tool_call_id` (its text parts joined). A system message loses a leading
   `x-anthropic-billing-header` line. Developer messages become system messages (and
   every system message is merged into the first) when the template never names the
   developer role.
3. The template's variables: `messages`, `tools` (the request's, with vLLM's defaults
   filled in, `chat_request`), `documents`, `add_generation_prompt` (the request's,
   default true), the tokenizer's named special tokens (`bos_token`, `eos_token`, ...,
   any `*_token` of `tokenizer_config.json`), and the request's `chat_template_kwargs`
   the template reads (plus `reasoning_effort` and `enable_thinking` when the request
   sets an effort).
4. It renders in jinja2's immutable sandbox with `trim_blocks`, `lstrip_blocks`, the
   loop controls, `raise_exception`, `strftime_now` and a `tojson` that does not escape
   HTML (`chat_sandbox`); `continue_final_message` cuts the prompt after the final
   message's text, as transformers does.
5. The prompt is tokenized with special tokens added only if the request asks
   (`add_special_tokens`, default false for chat).

Responses bodies are rendered when their `input` is a string or a list of plain messages
(role and text content), without `previous_response_id`, `conversation`, `prompt`,
tools or reasoning: vLLM turns them into chat messages (`instructions` first, as a system
message) and tokenizes the prompt with special tokens added (`chat_from_responses`).
Anthropic Messages bodies (the `messages` route) are rendered when they are text only,
without tools, `output_config`, disabled thinking or system messages inside `messages`
(vLLM probes the template for those two): vLLM turns them into a chat request, `system`
first (`chat_from_messages`).

`NotRendered` (counted as `chat_template`): what the router does not reproduce. No
template; Messages bodies of the shapes above; media parts; a request's own
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

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from router.prompts.chat_content_format import loops_over_content
from router.prompts.chat_from_messages import read_messages_request
from router.prompts.chat_from_responses import read_responses_request
from router.prompts.chat_messages import template_message, with_developer_as_system
from router.prompts.chat_model_dir import (
    find_special_tokens,
    find_templates,
    not_renderable,
    read_json,
)
from router.prompts.chat_request import ChatRequest, NotRendered, read_chat_request
from router.prompts.chat_sandbox import OutOfOperations, sandbox

if TYPE_CHECKING:
    import jinja2

log = logging.getLogger("router")


class TemplateFailed(Exception):
    """The chat template raised for this request, or ran past its bounds."""


# A render runs in the router's one trio thread on the client's messages, so running out
# of the budget holds every other request: about 8-11 ms of CPU here with the test
# model's template and 19-20 ms with a tool template on tool calls, while 200 messages
# spend 1,000-1,700 (docs/policies.md, `kv_aware`, "Which tokens").
DEFAULT_OPERATIONS = 3_000


@dataclass(frozen=True, slots=True)
class RenderLimits:
    """What one render may cost (why these bounds: the module's docstring; what they cost:
    docs/policies.md's kv_aware section)."""

    operations: int = DEFAULT_OPERATIONS
    """Item and attribute reads and calls the template may make."""
    output_chars: int = 16 * 1024 * 1024
    """Characters the rendered prompt may hold."""


@dataclass(frozen=True, slots=True)
class RenderedPrompt:
    text: str
    add_special_tokens: bool
    """Whether the engine adds the tokenizer's special tokens when it encodes `text`."""


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
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


@dataclass(frozen=True, slots=True)
class _Compiled:
    source: str
    template: jinja2.Template
    openai_content: bool
    """Whether messages reach the template with their content as a list of parts."""
    variables: frozenset[str]
    """The variables the template reads without setting them."""
    names_developer: bool


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
        self._env, self._budget = sandbox()
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
        why = not_renderable(directory)
        if why is None:
            config = read_json(directory / "tokenizer_config.json")
            templates = find_templates(directory, config)
            if not templates:
                why = "has no chat template"
            else:
                return cls(templates, find_special_tokens(directory, config), limits)
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
            openai_content=loops_over_content(tree),
            variables=frozenset(jinja2.meta.find_undeclared_variables(tree)),
            names_developer='"developer"' in source or "'developer'" in source,
        )

    def render(self, body: Mapping[str, Any], *, anthropic: bool = False) -> RenderedPrompt:
        """The prompt the engine renders for a chat or Responses `body`, or with
        `anthropic` an Anthropic Messages body.

        Raises NotRendered when the router does not reproduce this request's rendering,
        TemplateFailed when the template raises or runs past `limits`."""
        if anthropic:
            request = read_messages_request(body)
        elif "messages" not in body:
            request = read_responses_request(body)
        else:
            request = read_chat_request(body)
        compiled = self._pick(request.tools is not None)
        # Rebuilding the messages is work per message and part too: it spends the budget
        # the template then renders with.
        items = len(request.messages) + len(request.tools or ())
        for message in request.messages:
            if isinstance(message, dict):
                for field in ("content", "tool_calls"):  # each part, each call is rebuilt
                    value = message.get(field)
                    if isinstance(value, list):
                        items += len(value)
        if items > self.limits.operations:
            raise TemplateFailed("more messages, parts and tool calls than the operation budget")
        self._budget.remaining = self.limits.operations - items
        conversation = [template_message(raw, compiled.openai_content) for raw in request.messages]
        if not conversation:
            raise NotRendered("no messages")
        if not compiled.names_developer and any(m["role"] == "developer" for m in conversation):
            conversation = with_developer_as_system(conversation)
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
        self, compiled: _Compiled, request: ChatRequest, conversation: list[dict[str, Any]]
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
        except OutOfOperations as error:
            raise TemplateFailed(str(error)) from None
        except Exception as error:  # whatever the template raised
            raise TemplateFailed(f"{type(error).__name__}: {error}") from None
        text = "".join(pieces)
        if continue_final:
            text = _cut_after_final(text, final_text)
        return text


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
