"""Dataclasses on the request path write their `__init__` out (`init=False`), because the
one `dataclass` generates stays interpreted in the compiled build (docs/performance.md,
"fifth round"). A written-out `__init__` must stay the generated one: the same parameters
in the same order with the same defaults (None for a field with a default factory), and
every field set."""

from __future__ import annotations

import ast
import dataclasses
import importlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _written_inits() -> list[tuple[str, str, ast.FunctionDef]]:
    """(module, class, its `__init__`) for every `@dataclass(..., init=False)` class of
    `router/` that defines `__init__`."""
    found = []
    for path in sorted((REPO / "router").rglob("*.py")):
        tree = ast.parse(path.read_text())
        module = ".".join(path.relative_to(REPO).with_suffix("").parts)
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            written = any(
                isinstance(decorator, ast.Call)
                and any(
                    keyword.arg == "init"
                    and isinstance(keyword.value, ast.Constant)
                    and keyword.value.value is False
                    for keyword in decorator.keywords
                )
                for decorator in node.decorator_list
            )
            init = next(
                (
                    item
                    for item in node.body
                    if isinstance(item, ast.FunctionDef) and item.name == "__init__"
                ),
                None,
            )
            if written and init is not None:
                found.append((module, node.name, init))
    return found


WRITTEN = _written_inits()


def _assigned(init: ast.FunctionDef) -> set[str]:
    """The attributes `init` sets: `self.x = ...` and `object.__setattr__(self, "x", ...)`."""
    names = set()
    for node in ast.walk(init):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if (
                    isinstance(target, ast.Attribute)
                    and isinstance(target.value, ast.Name)
                    and target.value.id == "self"
                ):
                    names.add(target.attr)
        elif (
            isinstance(node, ast.Call)
            and ast.unparse(node.func) == "object.__setattr__"
            and isinstance(node.args[1], ast.Constant)
        ):
            names.add(str(node.args[1].value))
    return names


def test_the_request_path_classes_are_found() -> None:
    # The ones a unary request builds: if the scan finds none of them, it checks nothing.
    names = {name for _, name, _ in WRITTEN}
    assert {"RequestHead", "PolicyKey", "Lease", "RequestContext"} <= names


@pytest.mark.parametrize(
    ("module", "name", "init"), WRITTEN, ids=[f"{m}.{n}" for m, n, _ in WRITTEN]
)
def test_a_written_init_matches_the_fields(module: str, name: str, init: ast.FunctionDef) -> None:
    # Read from the source: compiled, `__init__` has no signature to inspect.
    namespace = vars(importlib.import_module(module))
    fields = dataclasses.fields(namespace[name])
    arguments = init.args.args[1:]  # after self
    assert [argument.arg for argument in arguments] == [f.name for f in fields if f.init]
    defaults = dict(
        zip(
            [argument.arg for argument in arguments][len(arguments) - len(init.args.defaults) :],
            init.args.defaults,
            strict=True,
        )
    )
    for argument in arguments:
        field = next(f for f in fields if f.name == argument.arg)
        default = defaults.get(argument.arg)
        if field.default is not dataclasses.MISSING:
            assert default is not None, argument.arg
            assert eval(ast.unparse(default), namespace) == field.default, argument.arg
        elif field.default_factory is not dataclasses.MISSING:
            assert default is not None and ast.unparse(default) == "None", argument.arg
        else:
            assert default is None, argument.arg
    assert _assigned(init) == {f.name for f in fields}
