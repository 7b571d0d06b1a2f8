"""vLLM's detection of a chat template's content format (`renderers/chat_utils.py`
`_detect_content_format`), read once from the template's syntax tree: a template that
loops over a message's content gets each message's content as a list of text parts, any
other gets it as one string."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import jinja2.nodes


def loops_over_content(tree: jinja2.nodes.Template) -> bool:
    """Whether the template loops over a message's content (`{% for part in
    message['content'] %}`, through aliases of `messages`, filters, tests and slices, or
    over a macro parameter given a message's content, or over a variable named `content`
    outside macros). A tree whose matching loop has a tuple target counts as not looping,
    as vLLM's detection fails on it and falls back to strings."""
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
