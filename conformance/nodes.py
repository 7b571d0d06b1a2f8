"""Typed reads of a composed YAML node tree, with errors that name the file, line and field.

`yaml.safe_load` forgets where a value came from. Composing to nodes keeps every value's
start mark, so a wrong value is reported at its own line, and a missing field at the line
of the mapping that lacks it.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode


class SpecError(ValueError):
    """A case file that cannot be used: `path:line: field: message`."""

    def __init__(self, path: Path | str, line: int, field: str, message: str) -> None:
        self.path = Path(path)
        self.line = line
        self.field = field
        self.message = message
        super().__init__(
            f"{path}:{line}: {field}: {message}" if field else f"{path}:{line}: {message}"
        )


def line_of(node: Node) -> int:
    return node.start_mark.line + 1


def join(field: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{field}[{key}]"
    return f"{field}.{key}" if field else key


class NodeReader:
    """Reads values of one file's node tree; every failure raises `SpecError`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._constructor = yaml.constructor.SafeConstructor()

    def compose(self, text: str) -> Node:
        try:
            node = yaml.compose(text, Loader=yaml.SafeLoader)
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            line = mark.line + 1 if mark is not None else 1
            raise SpecError(self.path, line, "", f"not valid YAML: {exc.problem or exc}") from None
        except yaml.YAMLError as exc:
            raise SpecError(self.path, 1, "", f"not valid YAML: {exc}") from None
        if node is None:
            raise SpecError(self.path, 1, "", "the file is empty")
        return node

    def fail(self, node: Node, field: str, message: str) -> SpecError:
        return SpecError(self.path, line_of(node), field, message)

    # -- containers ------------------------------------------------------------------

    def mapping(
        self,
        node: Node,
        field: str,
        known: Collection[str] | None = None,
        required: Collection[str] = (),
    ) -> dict[str, Node]:
        """A mapping with string keys; unknown keys (when `known` is given), duplicate keys
        and missing required keys are errors. Null reads as an empty mapping."""
        entries: dict[str, Node] = {}
        for key, key_node, value_node in self.items(node, field):
            if known is not None and key not in known:
                raise self.fail(key_node, join(field, key), self._unknown(key, known))
            entries[key] = value_node
        for name in required:
            if name not in entries:
                raise self.fail(node, join(field, name), "is required")
        return entries

    def items(self, node: Node, field: str) -> Iterator[tuple[str, Node, Node]]:
        """(key, key node, value node) of a mapping whose keys are names; a key that is
        not a name or is given twice is an error. Null reads as an empty mapping."""
        if self.is_null(node):
            return
        if not isinstance(node, MappingNode):
            raise self.fail(node, field, f"must be a mapping, got {self.describe(node)}")
        seen: set[str] = set()
        for key_node, value_node in node.value:
            key = self.scalar(key_node, field)
            if isinstance(key, bool) or not isinstance(key, str | int):
                raise self.fail(key_node, field, f"keys must be names, got {key!r}")
            key = str(key)
            if key in seen:
                raise self.fail(key_node, join(field, key), "given twice")
            seen.add(key)
            yield key, key_node, value_node

    def sequence(self, node: Node, field: str) -> list[Node]:
        if self.is_null(node):
            return []
        if not isinstance(node, SequenceNode):
            raise self.fail(node, field, f"must be a list, got {self.describe(node)}")
        return list(node.value)

    # -- scalars ---------------------------------------------------------------------

    def is_null(self, node: Node) -> bool:
        return isinstance(node, ScalarNode) and node.tag == "tag:yaml.org,2002:null"

    def scalar(self, node: Node, field: str) -> Any:
        if not isinstance(node, ScalarNode):
            raise self.fail(node, field, f"must be a single value, got {self.describe(node)}")
        return self._constructor.construct_object(node, deep=True)

    def value(self, node: Node, field: str) -> Any:
        """Any plain YAML value (mappings and lists included), for free-form JSON bodies."""
        try:
            return self._constructor.construct_object(node, deep=True)
        except yaml.YAMLError as exc:
            raise self.fail(node, field, f"cannot be read: {exc}") from None

    def string(self, node: Node, field: str) -> str:
        value = self.scalar(node, field)
        if not isinstance(value, str) or not value:
            raise self.fail(node, field, f"must be a non-empty string, got {value!r}")
        return value

    def boolean(self, node: Node, field: str) -> bool:
        value = self.scalar(node, field)
        if not isinstance(value, bool):
            raise self.fail(node, field, f"must be true or false, got {value!r}")
        return value

    def integer(
        self, node: Node, field: str, minimum: int | None = None, maximum: int | None = None
    ) -> int:
        value = self.scalar(node, field)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(node, field, f"must be an integer, got {value!r}")
        if minimum is not None and value < minimum:
            raise self.fail(node, field, f"must be >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise self.fail(node, field, f"must be <= {maximum}, got {value}")
        return value

    def number(self, node: Node, field: str, positive: bool = False) -> float:
        value = self.scalar(node, field)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise self.fail(node, field, f"must be a number, got {value!r}")
        if value < 0 or (positive and value == 0):
            raise self.fail(node, field, f"must be {'> 0' if positive else '>= 0'}, got {value}")
        return float(value)

    def choice(self, node: Node, field: str, choices: Collection[str]) -> str:
        value = self.scalar(node, field)
        if value not in choices:
            raise self.fail(node, field, f"must be one of {', '.join(choices)}, got {value!r}")
        return str(value)

    def strings(self, node: Node, field: str) -> tuple[str, ...]:
        """A string or a list of strings."""
        if isinstance(node, ScalarNode) and not self.is_null(node):
            return (self.string(node, field),)
        return tuple(
            self.string(item, join(field, i)) for i, item in enumerate(self.sequence(node, field))
        )

    # -- messages --------------------------------------------------------------------

    def describe(self, node: Node) -> str:
        if isinstance(node, MappingNode):
            return "a mapping"
        if isinstance(node, SequenceNode):
            return "a list"
        return repr(self._constructor.construct_object(node, deep=True))

    @staticmethod
    def unknown_word(word: str, known: Collection[str], kind: str) -> str:
        close = difflib.get_close_matches(word, list(known), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return f"unknown {kind} {word!r}{hint}"

    @staticmethod
    def _unknown(key: str, known: Collection[str]) -> str:
        close = difflib.get_close_matches(key, list(known), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return f"unknown field{hint} (known: {', '.join(sorted(known))})"
